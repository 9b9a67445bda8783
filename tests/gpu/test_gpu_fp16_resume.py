"""fp16 under DeepSpeed (CUDA only: the CPU refuses fp16 with ZeRO), saved while its first iterations overflow and
are skipped, before the optimizer has taken a step: the run that saved must go on as if it had not, and a run
resumed from that checkpoint must count its Adam steps from the first real one.

Saving makes the optimizer's state if none exists yet (a step at rate 0, as torch does for loading); before the
fix, that step stayed: Adam's bias correction counted one step too many for the rest of the run, in the run that
saved and in every run loaded from it. Checked exactly by the step count the last checkpoint holds (the number of
iterations the log does not mark as skipped), and the losses after the stop against the uninterrupted run's
(within 1e-3: GPU kernels such as attention's backward need not be bitwise run to run).

    python -m pytest tests/gpu/test_gpu_fp16_resume.py -v      # skipped without CUDA
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.gpu.test_gpu_modes import torchrun_pretrain

ITERATIONS = 12
GPT = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
       "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", str(ITERATIONS), "--lr", "1e-3",
       "--lr-warmup-iters", "2", "--log-interval", "4", "--eval-iters", "0", "--num-workers", "2",
       "--fp16", "--initial-loss-scale", "16777216", "--hysteresis", "1"]  # 2^24: the first iterations overflow
LAYOUTS = {
    "zero2": ["--zero-2-memory-optimization"],
    "zero3": ["--zero-3-memory-optimization"],
    "zero2_offload": ["--zero-2-memory-optimization", "--cpu-offload"],
    "ddp": [],  # the torch runner's path, fixed before (its CPU test is tests/e2e/test_resume_search.py)
}


def log_of(path: Path) -> dict[int, tuple[float, bool]]:
    """iteration → (exact loss, skipped) from --loss-log-file (later lines win, as after a resume)."""
    rows = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        rows[int(fields[0])] = (float.fromhex(fields[1]), fields[2] == "1")
    return rows


def adam_steps(checkpoint: Path) -> set[int]:
    """The step counts of every parameter's optimizer state in one iter_* folder."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = checkpoint.parent / (checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint, whole)
    state = torch.load(whole, weights_only=True)["optimizer"]["state"]
    return {int(entry["step"]) for entry in state.values()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_saved_before_the_first_step_resumes_counting_from_it(layout, demo_data, tmp_path):
    flags = GPT + LAYOUTS[layout]
    straight, resumed = tmp_path / "straight.txt", tmp_path / "resumed.txt"
    torchrun_pretrain(flags + ["--save", str(tmp_path / "s"), "--save-interval", "1", "--loss-log-file", str(straight)])
    torchrun_pretrain(flags + ["--save", str(tmp_path / "r"), "--exit-interval", "1", "--loss-log-file", str(resumed)])
    torchrun_pretrain(flags + ["--save", str(tmp_path / "r"), "--load", str(tmp_path / "r"),
                               "--loss-log-file", str(resumed)])
    expected, got = log_of(straight), log_of(resumed)
    assert expected[1][1], f"iteration 1 was not skipped (the test's premise): {expected}"
    stepped = sum(1 for _, skipped in expected.values() if not skipped)
    assert 0 < stepped < ITERATIONS, expected
    assert [got[i][1] for i in range(1, ITERATIONS + 1)] == [expected[i][1] for i in range(1, ITERATIONS + 1)]
    last = f"iter_{ITERATIONS:07d}"
    assert adam_steps(tmp_path / "s" / last) == {stepped}, "the run that saved before its first step"
    assert adam_steps(tmp_path / "r" / last) == {stepped}, "the run resumed from that checkpoint"
    for i in range(2, ITERATIONS + 1):
        assert math.isclose(got[i][0], expected[i][0], rel_tol=1e-3), (i, got, expected)
