"""fp16 with dynamic loss scaling under every sharding, on 4 CPU ranks with gloo.

One process is the reference. The loss scale starts at 2^20 with hysteresis 1, so the first iterations
overflow in fp16 and are skipped (the scale halves each time) before steps are taken. Under TP 2 × DP 2,
FSDP2 over 4 ranks, PP 2 × DP 2, TP 2 × PP 2 and expert parallelism (EP 2, DP 4) the same iterations are
skipped and the losses match. Then an overflow is forced into one rank's own gradient shard: every rank
skips that iteration, its weights stay bitwise unchanged and the loss scale backs off everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.parallel_runs import train_here
from tests.launch import read_grad_norms, read_losses, relative_difference, torchrun

RUNS = Path(__file__).with_name("fp16_runs.py")
FP16 = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
    "--global-batch-size 4 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0 "
    "--train-iters 6 --log-interval 100 --lr 1e-3 --make-vocab-size-divisible-by 512 "
    "--fp16 --initial-loss-scale 1048576 --hysteresis 1"
).split()
MOE = ["--num-experts", "4"]
LAYOUTS = {
    "tp2_dp2": ["--tensor-model-parallel-size", "2"],
    "fsdp_dp4": ["--fsdp-memory-optimization"],
    "pp2_dp2": ["--pipeline-model-parallel-size", "2"],
    "tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "ep2_dp4": [*MOE, "--expert-model-parallel-size", "2"],
}
# Measured with the demo tokenizer (2,005 ids): at 2^20 the first iteration overflows in both models; at 2^19 the
# plain model's gradients stay in fp16's range, the MoE model's pass it again at iteration 4.
SKIPPED = {"single": [1], "single_moe": [1, 4]}
# The forced overflow goes where neither model overflows by itself, so that only rank 3 sees one.
INJECT = {"iteration": 3, "rank": 3}
# Measured: with the scale halved at 3, the MoE model's gradients of iteration 4 stay in range (2^18), so both skip
# the first and the forced iteration only.
INJECTED_SKIPS = [1, 3]
# fp16 matmuls reduce in different orders under each split; the losses agree to ~1e-6, the norms to ~1e-4.
LOSS_TOLERANCE = 1e-4
NORM_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("fp16")
    data = ["--data-path", demo_data.data_prefix, "--tokenizer-type", demo_data.tokenizer_type,
            "--tokenizer-model", demo_data.tokenizer_model]
    train_here(FP16 + data + ["--loss-log-file", str(out / "single.txt")])
    train_here(FP16 + data + MOE + ["--loss-log-file", str(out / "single_moe.txt")])
    specs = []
    for name, flags in LAYOUTS.items():
        argv = FP16 + data + flags
        specs.append({"name": name, "argv": argv + ["--loss-log-file", str(out / f"{name}.txt")], "out": str(out)})
        specs.append({"name": f"{name}_inject", "argv": argv[:], "out": str(out), "inject": INJECT})
    (out / "runs.json").write_text(json.dumps(specs))
    torchrun(4, RUNS, [str(out / "runs.json")], timeout=1800, warm=True)
    return out


def skipped(path: Path) -> list[int]:
    return [int(line.split()[0]) for line in path.read_text().splitlines() if line.split()[2] == "1"]


def reports(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}_rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.slow
def test_one_process_fp16_skips_the_first_overflowing_iterations(runs):
    """The reference itself: the first iteration overflows at 2^20, then steps are taken (the MoE model's skip one
    more when its gradients grow past 2^19's range); the skipped iterations log no grad norm."""
    for reference, overflowing in SKIPPED.items():
        assert skipped(runs / f"{reference}.txt") == overflowing
        assert sorted(read_grad_norms(runs / f"{reference}.txt")) == [i for i in range(1, 7) if i not in overflowing]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp16_layout_matches_one_process_losses_and_skips(runs, layout):
    """Same skipped iterations on every rank and in the loss file, losses within 1e-4, grad norms within 2e-3."""
    name = "single_moe" if layout.startswith("ep") else "single"
    reference = runs / f"{name}.txt"
    assert skipped(runs / f"{layout}.txt") == skipped(reference) == SKIPPED[name]
    assert all(report["skipped"] == SKIPPED[name] for report in reports(runs, layout))
    assert relative_difference(read_losses(runs / f"{layout}.txt"), read_losses(reference)) < LOSS_TOLERANCE
    norms = read_grad_norms(runs / f"{layout}.txt")
    assert relative_difference(norms, read_grad_norms(reference)) < NORM_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overflow_on_one_ranks_shard_skips_the_step_everywhere(runs, layout):
    """inf written into rank 3's own gradient shard at iteration 3: only rank 3 sees it locally, yet every rank
    skips iteration 3 (and otherwise only the iterations that overflow by themselves), keeps every local weight
    bitwise and halves the loss scale."""
    ranks = reports(runs, f"{layout}_inject")
    assert [r["injected"]["local_overflow"] for r in ranks] == [False, False, False, True]
    for report in ranks:
        injected = report["injected"]
        assert injected["skipped"] and injected["weights_unchanged"] and injected["parameters"] > 0
        assert injected["scale_after"] == injected["scale_before"] / 2
        assert report["skipped"] == INJECTED_SKIPS
