"""One writer per --save folder: a real second process is refused with the holder's host and pid, the lock
goes with the process however it ends, and runs that would overwrite checkpoints they did not load are refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rapidtrain.checkpoint.checkpointer import prepare_save_folder
from rapidtrain.checkpoint.save_folder import (
    LOCK_FILE,
    SaveFolderError,
    acquire_save_lock,
    check_resume_safety,
    check_save_writable,
)

REPO = Path(__file__).resolve().parents[2]
HOLDER = textwrap.dedent("""
    import sys, time
    from rapidtrain.checkpoint.save_folder import acquire_save_lock
    lock = acquire_save_lock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
""")


def start_holder(folder: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True,
                               env=env)
    assert process.stdout.readline().strip() == "locked"
    return process


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL], ids=["terminated", "killed"])
def test_second_run_is_refused_with_the_holder_until_it_ends(tmp_path, ending):
    holder = start_holder(tmp_path / "ck")
    try:
        with pytest.raises(SaveFolderError) as refused:
            acquire_save_lock(tmp_path / "ck")
        message = str(refused.value)
        assert f"--save {tmp_path / 'ck'} is in use by another run (host {socket.gethostname()}, pid {holder.pid}" \
            in message
        assert "give this one another --save" in message
    finally:
        holder.send_signal(ending)
        holder.wait(timeout=30)
    with acquire_save_lock(tmp_path / "ck") as lock:  # a dead holder leaves no stale lock
        assert f'"pid": {os.getpid()}' in (tmp_path / "ck" / LOCK_FILE).read_text()
        assert lock.descriptor is not None


def test_lock_is_released_for_the_next_run_in_the_same_process(tmp_path):
    first = acquire_save_lock(tmp_path)
    first.release()
    acquire_save_lock(tmp_path).release()


def test_a_run_never_overwrites_checkpoints_it_did_not_load(tmp_path):
    save = tmp_path / "ck"
    (save / "iter_0000004").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    for load in (None, tmp_path / "other"):
        if load is not None:
            load.mkdir()
        with pytest.raises(SaveFolderError, match=rf"--save {save} already holds checkpoints \(iter_0000004, "
                           rf"latest_checkpointed_iteration.txt\).*give --load {save}; to start a new one give a "
                           "fresh --save"):
            check_resume_safety(save, load)
    check_resume_safety(save, save)  # resuming it
    check_resume_safety(tmp_path / "fresh", None)  # a new folder
    check_resume_safety(tmp_path / "fresh", tmp_path / "fresh")  # Megatron's --load X --save X on a first run


def test_a_mistyped_load_is_refused_instead_of_starting_from_scratch(tmp_path):
    with pytest.raises(SaveFolderError, match=r"--load .*ckk: no such folder"):
        check_resume_safety(tmp_path / "new", tmp_path / "ckk")


def test_unwritable_or_misplaced_save_is_found_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SaveFolderError, match="is a file, not a folder"):
        check_save_writable(tmp_path / "file")
    with pytest.raises(SaveFolderError, match="is not writable"):
        check_save_writable(tmp_path / "file" / "sub")
    if os.geteuid() != 0:  # root writes into read-only folders
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        with pytest.raises(SaveFolderError, match="is not writable"):
            check_save_writable(read_only)


def test_prepare_cleans_what_killed_saves_left(tmp_path):
    save = tmp_path / "ck"
    (save / "iter_0000006.tmp").mkdir(parents=True)
    (save / "iter_0000004.old").mkdir()  # killed between the two renames of a republish: the only copy
    lock, cleaned = prepare_save_folder(save, save)
    lock.release()
    assert not (save / "iter_0000006.tmp").exists() and (save / "iter_0000004").is_dir()
    assert cleaned == ["removed the unfinished iter_0000006.tmp left by an interrupted save",
                       "restored iter_0000004 from iter_0000004.old (a save was interrupted while replacing it)"]
