"""--async-save on 2 ranks with gloo: checkpoints written in the background hold exactly what a blocking save
writes at the same iteration (while training goes on changing the weights), training is unchanged, and a rank
killed during a background save leaves the previous `latest` intact; the next run resumes from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapidtrain.checkpoint.checkpointer import LATEST_FILE, read_metadata_file, safe_dcp_load, verify_checkpoint
from tests.launch import TINY_GPT_PARITY, pretrain, read_losses

pytestmark = [pytest.mark.slow,  # four 2-rank runs
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # read back in one process

KILLED = Path(__file__).resolve().parent / "killed_during_async_save.py"
ARGS = [*TINY_GPT_PARITY, "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "3", "--lr",
        "1e-3", "--lr-warmup-iters", "1", "--train-iters", "9", "--save-interval", "3"]


def saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer state), by its path, read in this one process."""
    metadata = read_metadata_file(directory / ".metadata")
    state: dict = {}
    for key, path in metadata.planner_data.items():
        stored = metadata.state_dict_metadata[key]
        if hasattr(stored, "size") and all(isinstance(part, str) for part in path):
            node = state
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = torch.empty(stored.size, dtype=stored.properties.dtype)
    safe_dcp_load(state, directory, no_dist=True)
    flat: dict[str, torch.Tensor] = {}

    def collect(node: dict, prefix: str) -> None:
        for name, value in node.items():
            if isinstance(value, dict):
                collect(value, f"{prefix}{name}.")
            else:
                flat[prefix + name] = value

    collect(state, "")
    return flat


@pytest.fixture(scope="module")
def blocking_run(tmp_path_factory, demo_data):
    root = tmp_path_factory.mktemp("blocking")
    pretrain(2, ARGS + ["--save", str(root / "ck"), "--loss-log-file", str(root / "losses.txt")], warm=True)
    return root


def test_background_checkpoints_equal_blocking_ones(blocking_run, tmp_path):
    result = pretrain(2, ARGS + ["--save", str(tmp_path / "ck"), "--async-save",
                                 "--loss-log-file", str(tmp_path / "losses.txt")], warm=True)
    assert "in the background" in result.stdout and "published at iteration" in result.stdout
    assert read_losses(tmp_path / "losses.txt") == read_losses(blocking_run / "losses.txt")
    assert (tmp_path / "ck" / LATEST_FILE).read_text().strip() == "9"
    for iteration in (3, 6, 9):
        name = f"iter_{iteration:07d}"
        assert verify_checkpoint(tmp_path / "ck" / name)  # the manifest covers every file, checksums match
        background, blocking = saved_tensors(tmp_path / "ck" / name), saved_tensors(blocking_run / "ck" / name)
        assert background.keys() == blocking.keys() and any(k.startswith("optimizer.") for k in background)
        for key in blocking:
            assert torch.equal(background[key], blocking[key]), (iteration, key)


def test_killed_during_a_background_save_resumes_from_the_previous_checkpoint(blocking_run, tmp_path):
    folder, losses = tmp_path / "ck", tmp_path / "losses.txt"
    killed = pretrain(2, ARGS + ["--save", str(folder), "--async-save", "--loss-log-file", str(losses)],
                      script=KILLED, env={"KILL_AT_SAVE": "6"}, check=False)
    assert killed.returncode != 0 and "killing rank 0 while iter_0000006.tmp is written" in killed.stdout
    assert (folder / LATEST_FILE).read_text().strip() == "3"
    assert not (folder / "iter_0000006").exists()

    resumed = pretrain(2, ARGS + ["--save", str(folder), "--load", str(folder), "--async-save",
                                  "--loss-log-file", str(losses)])
    assert "removed the unfinished iter_0000006.tmp" in resumed.stdout
    assert "loaded checkpoint" in resumed.stdout and "at iteration 3" in resumed.stdout
    assert read_losses(losses) == read_losses(blocking_run / "losses.txt")  # 4..9 redone exactly
    assert (folder / LATEST_FILE).read_text().strip() == "9"
