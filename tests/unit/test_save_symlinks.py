"""--save is safe to share (issue 25 item 5): no save writes through a symlink planted under a temporary name."""

from __future__ import annotations

import pytest

from rapidtrain.checkpoint.checkpointer import _prepare_save, _write_atomically, publish_folder
from rapidtrain.checkpoint.save_folder import SaveFolderError


def test_a_symlinked_temporary_checkpoint_folder_is_refused(tmp_path):
    save, outside = tmp_path / "save", tmp_path / "elsewhere"
    save.mkdir()
    outside.mkdir()
    (save / "iter_0000002.tmp").symlink_to(outside)
    with pytest.raises(SaveFolderError, match=r"iter_0000002\.tmp is a symbolic link"):
        _prepare_save(save, 2)
    assert list(outside.iterdir()) == []


def test_a_symlinked_temporary_tracker_is_refused_and_the_target_kept(tmp_path):
    save, victim = tmp_path / "save", tmp_path / "precious.txt"
    save.mkdir()
    victim.write_text("keep me")
    (save / "latest_checkpointed_iteration.txt.tmp").symlink_to(victim)
    with pytest.raises(SaveFolderError, match="symbolic link"):
        _write_atomically(save / "latest_checkpointed_iteration.txt", "7\n")
    assert victim.read_text() == "keep me"


def test_a_leftover_temporary_folder_is_replaced_and_a_symlinked_old_copy_is_not_followed(tmp_path):
    save, outside = tmp_path / "save", tmp_path / "elsewhere"
    (save / "iter_0000003.tmp" / "junk").mkdir(parents=True)
    outside.mkdir()
    final, tmp = _prepare_save(save, 3)
    assert sorted(p.name for p in tmp.iterdir()) == ["rng"]
    final.mkdir()
    (save / "iter_0000003.old").symlink_to(outside)
    publish_folder(tmp, final)
    assert (final / "rng").is_dir() and outside.is_dir() and not (save / "iter_0000003.old").exists()
