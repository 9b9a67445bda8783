"""--optimizer muon on 2 gloo ranks: DDP, ZeroRedundancyOptimizer (OSS) and 2 pipeline stages reach one process's
losses, and a DDP run stopped at iteration 5 and resumed with --load continues bitwise (Muon's momentum and AdamW's
moments come back from the checkpoint).

All 2-rank trainings share one torchrun launch (`pretrain_runs.py`); the one-process reference runs in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import TINY_GPT_PARITY, read_grad_norms, read_losses, relative_difference, torchrun

RUNS = Path(__file__).with_name("pretrain_runs.py")
# Global batch 8 = micro 2 × accumulation 2 × 2 ranks (accumulation 4 in one process, and under 2 pipeline stages).
TINY = [*TINY_GPT_PARITY, "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "5", "--lr",
        "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "2", "--train-iters", "10", "--weight-decay", "0.1",
        "--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov"]
LAYOUTS = {"ddp": [], "oss": ["--oss-memory-optimization"], "pp2": ["--pipeline-model-parallel-size", "2"]}
# Muon orthogonalizes in bfloat16: gradients that differ in their last fp32 bits (a reduction's order) can round to
# different bfloat16 inputs, so layouts agree to bfloat16's precision, not fp32's. Measured over 10 iterations
# (torch 2.13, CPU): iterations 1-2 equal, then at most 2.8e-5 relative on the losses and 7.1e-4 on the gradient norms
# (DDP and OSS; 2 pipeline stages 7.4e-6 and 3.6e-4). AdamW alone agrees within 1e-5 (test_data_parallel.py).
LOSS_TOLERANCE, GRAD_NORM_TOLERANCE = 1e-4, 2e-3


def two_rank_runs(out: Path) -> list[list[str]]:
    runs = [TINY + flags + ["--loss-log-file", str(out / f"{name}.txt")] for name, flags in LAYOUTS.items()]
    resumed = ["--loss-log-file", str(out / "ddp_resumed.txt")]
    runs.append(TINY + resumed + ["--exit-interval", "5", "--save", str(out / "ddp_at5")])
    runs.append(TINY + resumed + ["--load", str(out / "ddp_at5")])
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Path:
    from rapidtrain.pretrain import main

    out = tmp_path_factory.mktemp("muon")
    main(TINY + ["--loss-log-file", str(out / "single.txt")])
    (out / "runs.json").write_text(json.dumps(two_rank_runs(out)))
    torchrun(2, RUNS, [str(out / "runs.json")], timeout=900, warm=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_layout_matches_one_process(runs, layout):
    single, ours = read_losses(runs / "single.txt"), read_losses(runs / f"{layout}.txt")
    assert sorted(ours) == list(range(1, 11))
    assert single[10] < single[1] - 0.5  # it trains
    assert relative_difference(ours, single) < LOSS_TOLERANCE
    assert relative_difference(read_grad_norms(runs / f"{layout}.txt"), read_grad_norms(runs / "single.txt")) \
        < GRAD_NORM_TOLERANCE


@pytest.mark.slow
def test_muon_under_oss_steps_as_ddp_does(runs):
    """ZeroRedundancyOptimizer steps each matrix whole on the rank that owns it, from DDP's reduced gradients: the
    losses are bitwise DDP's."""
    assert read_losses(runs / "oss.txt") == read_losses(runs / "ddp.txt")


@pytest.mark.slow
def test_muon_resume_is_bitwise_exact(runs):
    resumed, straight = read_losses(runs / "ddp_resumed.txt"), read_losses(runs / "ddp.txt")
    assert sorted(resumed) == list(range(1, 11))
    assert (runs / "ddp_at5" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert [resumed[i] for i in range(6, 11)] == [straight[i] for i in range(6, 11)]
