"""--optimizer muon on 2 gloo ranks: DDP, ZeroRedundancyOptimizer (OSS), 2 pipeline stages, and an MoE model under DDP
and 2 expert-parallel ranks reach one process's losses, and runs stopped at iteration 5 and resumed with --load (DDP,
and MoE under expert parallelism) continue bitwise (Muon's momentum, the experts' stacked momentum and AdamW's moments
come back from the checkpoint).

All 2-rank trainings share one torchrun launch (`pretrain_runs.py`); the one-process references run in this process.
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
        "--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov", "--muon-extra-scale-factor", "0.2"]
# MoE: each expert's matrix is orthogonalized on its own (stacked [E, in, out] weights); under expert parallelism
# each rank steps its own experts.
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
LAYOUTS = {"ddp": [], "oss": ["--oss-memory-optimization"], "pp2": ["--pipeline-model-parallel-size", "2"],
           "moe_ddp": MOE, "moe_ep2": [*MOE, "--expert-model-parallel-size", "2"]}
# Muon orthogonalizes in bfloat16: gradients that differ in their last fp32 bits (a reduction's order) can round to
# different bfloat16 inputs, so layouts agree to bfloat16's precision, not fp32's (AdamW alone agrees within 1e-5,
# test_data_parallel.py), and an MoE router's top-k choices amplify that. Measured over 10 iterations (torch 2.13,
# CPU, the update scale Moonshot's 0.2 × spectral): dense DDP/OSS 9.2e-6 relative on the losses and 2.6e-4 on the
# gradient norms, 2 pipeline stages 2.2e-6 and 1.2e-4; MoE DDP 8.8e-5 and 1.6e-3, 2 expert-parallel ranks 4.8e-5
# and 1.1e-3. (With the scale × 1 and --lr 1e-2 each update moves weights by ~1e-2 per element, and MoE's differences
# grow to 7e-4 on the losses.) Tolerances: (losses, gradient norms).
TOLERANCES = {"dense": (1e-4, 2e-3), "moe": (5e-4, 1e-2)}


# Resumed: the dense model under DDP; MoE under expert parallelism (each rank saves its own experts' momentum).
RESUMED = ("ddp", "moe_ep2")


def two_rank_runs(out: Path) -> list[list[str]]:
    runs = [TINY + flags + ["--loss-log-file", str(out / f"{name}.txt")] for name, flags in LAYOUTS.items()]
    for name in RESUMED:
        flags, resumed = LAYOUTS[name], ["--loss-log-file", str(out / f"{name}_resumed.txt")]
        runs.append(TINY + flags + resumed + ["--exit-interval", "5", "--save", str(out / f"{name}_at5")])
        runs.append(TINY + flags + resumed + ["--load", str(out / f"{name}_at5")])
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Path:
    from rapidtrain.pretrain import main

    out = tmp_path_factory.mktemp("muon")
    main(TINY + ["--loss-log-file", str(out / "single.txt")])
    main(TINY + MOE + ["--loss-log-file", str(out / "moe_single.txt")])
    (out / "runs.json").write_text(json.dumps(two_rank_runs(out)))
    torchrun(2, RUNS, [str(out / "runs.json")], timeout=900, warm=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_layout_matches_one_process(runs, layout):
    reference = runs / ("moe_single.txt" if layout.startswith("moe") else "single.txt")
    single, ours = read_losses(reference), read_losses(runs / f"{layout}.txt")
    assert sorted(ours) == list(range(1, 11))
    assert single[10] < single[1] - 0.5  # it trains
    loss_tolerance, grad_norm_tolerance = TOLERANCES["moe" if layout.startswith("moe") else "dense"]
    assert relative_difference(ours, single) < loss_tolerance
    assert relative_difference(read_grad_norms(runs / f"{layout}.txt"), read_grad_norms(reference)) \
        < grad_norm_tolerance


@pytest.mark.slow
def test_muon_under_oss_steps_as_ddp_does(runs):
    """ZeroRedundancyOptimizer steps each matrix whole on the rank that owns it, from DDP's reduced gradients: the
    losses are bitwise DDP's."""
    assert read_losses(runs / "oss.txt") == read_losses(runs / "ddp.txt")


@pytest.mark.slow
@pytest.mark.parametrize("layout", RESUMED)
def test_muon_resume_is_bitwise_exact(runs, layout):
    resumed, straight = read_losses(runs / f"{layout}_resumed.txt"), read_losses(runs / f"{layout}.txt")
    assert sorted(resumed) == list(range(1, 11))
    assert (runs / f"{layout}_at5" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert [resumed[i] for i in range(6, 11)] == [straight[i] for i in range(6, 11)]
