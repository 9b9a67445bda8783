"""Resume is bitwise exact in the configuration users run, not only in the parity tests' (dropout 0, data in the
training process): dropout 0.1 on hidden states and attention, the default 2 DataLoader workers per rank, in
each layout on 2 gloo ranks. A run stopped at iteration 3 (--exit-interval) and resumed with --load gives
iterations 4..6 exactly as the run that never stopped (the stop lies past the 2-iteration warm-up; 12 iterations
stopped at 6 checked the same restore at twice the cost).

What has to come back for that: the dropout stream (torch's global generator, from which tensor parallelism's
per-rank dropout seeds are drawn), the sample position, and nothing may draw from the global generator between
the restore and the first forward (a DataLoader's worker seed comes from its own seeded generator).
All runs share one torchrun launch (`pretrain_runs.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import TINY_GPT_SHAPE, read_losses, torchrun

RUNS = Path(__file__).with_name("pretrain_runs.py")
USER_DEFAULTS = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--num-workers", "2"]
TINY = [*TINY_GPT_SHAPE, *USER_DEFAULTS, "--eval-iters", "0", "--micro-batch-size", "2", "--global-batch-size",
        "8", "--log-interval", "3", "--lr", "1e-3", "--lr-warmup-iters", "2", "--train-iters", "6"]
LAYOUTS = {
    "ddp": [],
    "zero2": ["--zero-2-memory-optimization"],
    "fsdp": ["--fsdp-memory-optimization"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}
ITERS, STOP_AT = 6, 3


def layout_runs(out: Path) -> list[list[str]]:
    runs = []
    for name, flags in LAYOUTS.items():
        straight, resumed, save = out / f"{name}_straight.txt", out / f"{name}_resumed.txt", out / f"{name}_ck"
        runs.append(TINY + flags + ["--loss-log-file", str(straight)])
        runs.append(TINY + flags + ["--loss-log-file", str(resumed), "--save", str(save),
                                    "--exit-interval", str(STOP_AT)])
        runs.append(TINY + flags + ["--loss-log-file", str(resumed), "--save", str(save), "--load", str(save)])
    # One iteration without dropout: its loss differs from the dropout runs', so dropout was really on.
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "1", "--lr-warmup-iters", "0"]
    runs.append(TINY + no_dropout + ["--loss-log-file", str(out / "no_dropout.txt")])
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("exact_resume")
    (out / "runs.json").write_text(json.dumps(layout_runs(out)))
    torchrun(2, RUNS, [str(out / "runs.json")], timeout=1500, warm=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_with_dropout_and_workers_is_bitwise_exact(runs, layout):
    straight, resumed = read_losses(runs / f"{layout}_straight.txt"), read_losses(runs / f"{layout}_resumed.txt")
    assert sorted(straight) == sorted(resumed) == list(range(1, ITERS + 1))
    assert (runs / f"{layout}_ck" / f"iter_{STOP_AT:07d}" / ".metadata").is_file()
    assert [resumed[i] for i in range(STOP_AT + 1, ITERS + 1)] == [straight[i] for i in range(STOP_AT + 1, ITERS + 1)]
    if layout == "ddp":  # the masks were drawn: the first loss is not the dropout-free model's
        assert straight[1] != read_losses(runs / "no_dropout.txt")[1]
