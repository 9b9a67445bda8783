"""Faults: a rank SIGKILLed under `torchrun --max-restarts 1` resumes from the last complete checkpoint with
the uninterrupted run's losses; half-written checkpoints are never loaded."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from rapidtrain.checkpoint.checkpointer import CheckpointError
from tests.launch import TINY_GPT_PARITY, pretrain, read_losses

KILLED_PRETRAIN = Path(__file__).resolve().parent / "killed_pretrain.py"

TINY = [
    *TINY_GPT_PARITY,
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--log-interval",
    "5",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--lr-decay-iters",
    "20",
]


@pytest.mark.slow
def test_killed_rank_restarts_and_matches_uninterrupted_losses(tmp_path, demo_data):
    """Rank 1 is SIGKILLed after iteration 12 (checkpoints every 5): torchrun restarts both ranks, they load
    iteration 10 from the same folder, redo 11 and 12, and all 20 losses are bitwise the uninterrupted run's."""
    args = TINY + ["--train-iters", "20"]
    uninterrupted, faulty, folder = tmp_path / "uninterrupted.txt", tmp_path / "faulty.txt", tmp_path / "ck"
    pretrain(2, args + ["--loss-log-file", str(uninterrupted)], warm=True)  # the reference: not the faulty launch
    result = pretrain(
        2,
        args
        + [
            "--save",
            str(folder),
            "--load",
            str(folder),
            "--save-interval",
            "5",
            "--loss-log-file",
            str(faulty),
        ],
        env={"KILL_AT_ITERATION": "12"},
        extra_torchrun=["--max-restarts", "1"],
        script=KILLED_PRETRAIN,
    )
    assert (folder / ".test_killed").read_text().startswith("killed rank 1 after iteration 12")
    assert "loaded checkpoint" in result.stdout and "at iteration 10" in result.stdout
    iterations = [int(line.split()[0]) for line in faulty.read_text().splitlines()]
    # 11 and 12 ran twice: before the kill and after the restart.
    assert iterations == list(range(1, 13)) + list(range(11, 21))
    assert read_losses(faulty) == read_losses(uninterrupted)
    assert (folder / "latest_checkpointed_iteration.txt").read_text().strip() == "20"


def train_here(args: list[str]) -> None:
    from rapidtrain.pretrain import main

    main(TINY + args)


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory, demo_data) -> Path:
    """Checkpoints at iterations 2 and 4 of a one-process run; `latest` says 4. Trained once for the module."""
    folder = tmp_path_factory.mktemp("trained") / "ck"
    train_here(["--train-iters", "4", "--save", str(folder), "--save-interval", "2"])
    assert (folder / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    return folder


@pytest.fixture
def saved(trained_once, tmp_path) -> Path:
    """A test's own copy of the trained checkpoints (the tests damage them)."""
    return Path(shutil.copytree(trained_once, tmp_path / "ck"))


def test_unpublished_tmp_checkpoint_is_ignored(saved, tmp_path):
    """A save that died before publishing leaves `iter_0000006.tmp` (no .metadata, half the files): resuming
    loads iteration 4, the last complete one, and trains 5 and 6."""
    partial = saved / "iter_0000006.tmp"
    shutil.copytree(saved / "iter_0000004", partial)
    (partial / ".metadata").unlink()
    log = tmp_path / "resumed.txt"
    train_here(["--train-iters", "6", "--load", str(saved), "--loss-log-file", str(log)])
    assert sorted(read_losses(log)) == [5, 6]


def refused(args: list[str], capsys) -> str:
    """The message a user sees when the run stops with a CheckpointError: exit status 2, no traceback."""
    with pytest.raises(SystemExit) as raised:
        train_here(args)
    assert raised.value.code == 2 and isinstance(raised.value.__cause__, CheckpointError)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_latest_pointing_at_incomplete_checkpoint_is_refused(saved, capsys):
    """`latest` naming a folder without .metadata (its files never all written) stops with a clear error
    instead of loading part of a model."""
    incomplete = saved / "iter_0000006"
    shutil.copytree(saved / "iter_0000004", incomplete)
    (incomplete / ".metadata").unlink()
    (saved / "latest_checkpointed_iteration.txt").write_text("6\n")
    err = refused(["--train-iters", "8", "--load", str(saved)], capsys)
    assert re.search(r"iter_0000006 is incomplete \(missing \.metadata\)", err)


def test_latest_pointing_at_missing_checkpoint_is_refused(saved, capsys):
    (saved / "latest_checkpointed_iteration.txt").write_text("8\n")
    err = refused(["--train-iters", "10", "--load", str(saved)], capsys)
    assert re.search(r"names iteration 8, but .*iter_0000008 does not exist", err)
