"""--async-save on 2 ranks with gloo: checkpoints written in the background hold exactly what a blocking save
writes at the same iteration (while training goes on changing the weights), training is unchanged, and a rank
killed during a background save leaves the previous `latest` intact; the next run resumes from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidtrain.checkpoint.checkpointer import LATEST_FILE, read_metadata_file, safe_dcp_load, verify_checkpoint
from tests.launch import TINY_GPT_PARITY, pretrain, read_losses

pytestmark = [pytest.mark.slow,  # four 2-rank runs in three launches
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # read back in one process

KILLED = Path(__file__).resolve().parent / "killed_during_async_save.py"
RUNS = Path(__file__).resolve().parent / "pretrain_runs.py"
# Three saves (iterations 2, 4 and 6) with training going on between them: the background writes race weights that
# keep changing, and the kill at the second leaves the first as `latest`. Nine iterations saved every 3 proved the
# same with half as many iterations again.
ARGS = [*TINY_GPT_PARITY, "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "2", "--lr",
        "1e-3", "--lr-warmup-iters", "1", "--train-iters", "6", "--save-interval", "2"]


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
def blocking_run(tmp_path_factory, demo_data) -> Path:
    """The blocking run and the background-saving one in one launch (pretrain_runs.py), one after another, each with
    its own engine and checkpointer; `async.log` holds the second's printed section (each run prints its plan
    first). The background-saving run comes last: whatever of its last save is still in flight when its train()
returns, the launch's final engine.shutdown() waits for, as a lone run's would."""
    root = tmp_path_factory.mktemp("blocking")
    runs = [ARGS + ["--save", str(root / "ck"), "--loss-log-file", str(root / "losses.txt")],
            ARGS + ["--save", str(root / "async_ck"), "--async-save", "--loss-log-file", str(root / "async.txt")]]
    (root / "runs.json").write_text(json.dumps(runs))
    result = pretrain(2, [str(root / "runs.json")], script=RUNS, warm=True)
    sections = result.stdout.split("rapidtrain plan —")[1:]
    assert len(sections) == 2, result.stdout[-3000:]
    (root / "async.log").write_text(sections[1])
    return root


def test_background_checkpoints_equal_blocking_ones(blocking_run):
    printed, background_ck = (blocking_run / "async.log").read_text(), blocking_run / "async_ck"
    assert "in the background" in printed and "published at iteration" in printed
    assert read_losses(blocking_run / "async.txt") == read_losses(blocking_run / "losses.txt")
    assert (background_ck / LATEST_FILE).read_text().strip() == "6"
    for iteration in (2, 4, 6):
        name = f"iter_{iteration:07d}"
        assert verify_checkpoint(background_ck / name)  # the manifest covers every file, checksums match
        background, blocking = saved_tensors(background_ck / name), saved_tensors(blocking_run / "ck" / name)
        assert background.keys() == blocking.keys() and any(k.startswith("optimizer.") for k in background)
        for key in blocking:
            assert torch.equal(background[key], blocking[key]), (iteration, key)


def test_killed_during_a_background_save_resumes_from_the_previous_checkpoint(blocking_run, tmp_path):
    folder, losses = tmp_path / "ck", tmp_path / "losses.txt"
    killed = pretrain(2, ARGS + ["--save", str(folder), "--async-save", "--loss-log-file", str(losses)],
                      script=KILLED, env={"KILL_AT_SAVE": "4"}, check=False)
    assert killed.returncode != 0 and "killing rank 0 while iter_0000004.tmp is written" in killed.stdout
    assert (folder / LATEST_FILE).read_text().strip() == "2"
    assert not (folder / "iter_0000004").exists()

    # warm: the resume is an ordinary run (the killed launch above is the process test, launched plainly)
    resumed = pretrain(2, ARGS + ["--save", str(folder), "--load", str(folder), "--async-save",
                                  "--loss-log-file", str(losses)], warm=True)
    assert "removed the unfinished iter_0000004.tmp" in resumed.stdout
    assert "loaded checkpoint" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert read_losses(losses) == read_losses(blocking_run / "losses.txt")  # 3..6 redone exactly
    assert (folder / LATEST_FILE).read_text().strip() == "6"
