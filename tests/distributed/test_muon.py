"""--optimizer muon on 2 gloo ranks: DDP, ZeroRedundancyOptimizer (OSS), 2 pipeline stages, FSDP and tensor
parallelism (whose sharded matrices Muon gathers whole for the step), and an MoE model under DDP, 2 expert-parallel
ranks and FSDP reach one process's losses; runs stopped at iteration 3 and resumed with --load (DDP, OSS, FSDP, TP, MoE
under expert parallelism) continue bitwise (Muon's momentum, the experts' stacked momentum and AdamW's moments come back
from the checkpoint).

All 2-rank trainings share one torchrun launch (`pretrain_runs.py`); the one-process references run in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import TINY_GPT_PARITY, read_grad_norms, read_losses, relative_difference, torchrun

RUNS = Path(__file__).with_name("pretrain_runs.py")
# Six iterations, stopped and resumed at the third: the loss has fallen by 1.05 at the sixth (one process), and each
# of the launch's 20 two-rank runs pays for every iteration.
ITERS, STOP = 6, 3
# Global batch 8 = micro 2 × accumulation 2 × 2 ranks (accumulation 4 in one process, and under 2 pipeline stages).
TINY = [*TINY_GPT_PARITY, "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", str(STOP), "--lr",
        "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "2", "--train-iters", str(ITERS), "--weight-decay", "0.1",
        "--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov", "--muon-extra-scale-factor", "0.2",
        "--make-vocab-size-divisible-by", "512"]  # the vocabulary pads to 2048 at TP 1 and 2: one model
# MoE: each expert's matrix is orthogonalized on its own (stacked [E, in, out] weights); under expert parallelism
# each rank steps its own experts.
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
LAYOUTS = {"ddp": [], "oss": ["--oss-memory-optimization"], "pp2": ["--pipeline-model-parallel-size", "2"],
           "fsdp": ["--fsdp-memory-optimization"], "tp2": ["--tensor-model-parallel-size", "2"],
           "moe_ddp": MOE, "moe_ep2": [*MOE, "--expert-model-parallel-size", "2"],
           "moe_fsdp": [*MOE, "--fsdp-memory-optimization"]}
# Muon orthogonalizes in bfloat16: gradients that differ in their last fp32 bits (a reduction's order) can round to
# different bfloat16 inputs, so layouts agree to bfloat16's precision, not fp32's (AdamW alone agrees within 1e-5,
# test_data_parallel.py), and an MoE router's top-k choices amplify that. Measured over 10 iterations (torch 2.13,
# CPU, the update scale Moonshot's 0.2 × spectral), relative on the losses / gradient norms: DDP, OSS and FSDP
# 3.4e-6 / 1.8e-4 (FSDP's and OSS's losses are DDP's bitwise), 2 pipeline stages 9.9e-7 / 7.6e-5, TP 2 5.2e-6 /
# 4.0e-4; MoE under DDP and FSDP 9.1e-5 / 1.6e-3, 2 expert-parallel ranks 4.4e-5 / 4.9e-4. (With the scale × 1 and
# --lr 1e-2 each update moves weights by ~1e-2 per element, and MoE's differences grow to 7e-4 on the losses.)
# Tolerances: (losses, gradient norms).
TOLERANCES = {"dense": (1e-4, 2e-3), "moe": (5e-4, 1e-2)}


# Resumed: the dense model under DDP, OSS (each rank saves its own share), FSDP and TP (the momentum sharded as its
# weight); MoE under expert parallelism (each rank saves its own experts' momentum).
RESUMED = ("ddp", "oss", "fsdp", "tp2", "moe_ep2")


def two_rank_runs(out: Path) -> list[list[str]]:
    runs = [TINY + flags + ["--loss-log-file", str(out / f"{name}.txt")] for name, flags in LAYOUTS.items()]
    for name in RESUMED:
        flags, resumed = LAYOUTS[name], ["--loss-log-file", str(out / f"{name}_resumed.txt")]
        runs.append(TINY + flags + resumed + ["--exit-interval", str(STOP), "--save", str(out / f"{name}_stopped")])
        runs.append(TINY + flags + resumed + ["--load", str(out / f"{name}_stopped")])
    # DDP's checkpoint (whole momentum) continued under FSDP, where Muon gathers each matrix and shards its momentum.
    runs.append(TINY + LAYOUTS["fsdp"] + ["--load", str(out / "ddp_stopped"), "--loss-log-file",
                                         str(out / "fsdp_from_ddp.txt")])
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
    assert sorted(ours) == list(range(1, ITERS + 1))
    assert single[ITERS] < single[1] - 0.5  # it trains
    loss_tolerance, grad_norm_tolerance = TOLERANCES["moe" if layout.startswith("moe") else "dense"]
    assert relative_difference(ours, single) < loss_tolerance
    assert relative_difference(read_grad_norms(runs / f"{layout}.txt"), read_grad_norms(reference)) \
        < grad_norm_tolerance


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["oss", "fsdp"])
def test_muon_under_sharded_state_steps_as_ddp_does(runs, layout):
    """ZeroRedundancyOptimizer steps each matrix whole on the rank that owns it; under FSDP each rank gathers every
    matrix whole and keeps its shard of the result. From the same reduced gradients, the losses are bitwise DDP's."""
    assert read_losses(runs / f"{layout}.txt") == read_losses(runs / "ddp.txt")


@pytest.mark.slow
@pytest.mark.parametrize("layout", RESUMED)
def test_muon_resume_is_bitwise_exact(runs, layout):
    resumed, straight = read_losses(runs / f"{layout}_resumed.txt"), read_losses(runs / f"{layout}.txt")
    assert sorted(resumed) == list(range(1, ITERS + 1))
    assert (runs / f"{layout}_stopped" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STOP)
    after = range(STOP + 1, ITERS + 1)
    assert [resumed[i] for i in after] == [straight[i] for i in after]


@pytest.mark.slow
def test_ddp_checkpoint_continues_under_fsdp(runs):
    """The checkpoint's optimizer groups come from DDP; under FSDP the same groups' matrices are gathered whole for
    the step: iterations 4..6 are bitwise DDP's uninterrupted run's (FSDP's and DDP's losses agree bitwise)."""
    continued, straight = read_losses(runs / "fsdp_from_ddp.txt"), read_losses(runs / "ddp.txt")
    assert sorted(continued) == list(range(STOP + 1, ITERS + 1))
    assert continued == {i: straight[i] for i in range(STOP + 1, ITERS + 1)}
