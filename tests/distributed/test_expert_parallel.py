"""Expert parallelism on gloo: gradients against a one-process reference, EP 2 against EP 1 losses on 2
and 4 ranks (also with tensor parallelism), exact resume, and an EP 2 checkpoint loaded at EP 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import pretrain, read_grad_norms, read_losses, relative_difference, torchrun

WORKER = Path(__file__).with_name("expert_parallel_worker.py")
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    "--global-batch-size 8 --num-workers 0 --log-interval 1 --eval-iters 0 --lr 1e-3 --lr-warmup-iters 1 "
    "--train-iters 6 --moe-loss-coeff 0.1"
).split()
NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0".split()


def run_losses(tmp_path: Path, name: str, nproc: int, args: list[str]) -> tuple[dict, dict, str]:
    log = tmp_path / f"{name}.txt"
    result = pretrain(nproc, args + ["--loss-log-file", str(log)])
    return read_losses(log), read_grad_norms(log), result.stdout


def worker_reports(tmp_path: Path, nproc: int, ep: int, extra: list[str]) -> list[dict]:
    torchrun(nproc, WORKER, [str(tmp_path), str(ep), *extra])
    return [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [["--checkpoint-activations"], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
    ids=["dp4-ep2-checkpointing", "tp2-dp2-ep2-sequence-parallel"],
)
def test_expert_parallel_gradients_match_one_process_reference(tmp_path, demo_data, extra):
    """4 ranks, EP 2 (with DP 4: two expert_dp groups), 2 micro-batches each: every gradient the optimizer sees
    (experts after the expert_dp reduction) equals the gradient of mean lm loss + 0.5 × mean balancing loss
    over the global batch in one process; the norm counts each expert once; the checkpoint loads into a
    plain full-size model and back into the run itself."""
    reports = worker_reports(tmp_path, 4, 2, extra)
    for report in reports:
        assert report["expert_parts"] == ["ExpertParallelism"]  # the experts' reduction joined the runner
        assert report["sharded_modules"] == ["layers.1.mlp.experts"]
        assert report["expert_shapes"]["layers.1.mlp.experts.w1"] == [2, 16, 64]  # 4 experts over 2 ranks
        assert report["gradient_difference"] < 1e-6
        assert report["grad_norm"] == pytest.approx(report["expected_norm"], rel=1e-6)
        assert report["loaded_ok"] and report["reloaded_ok"]
    assert len({r["loss"] for r in reports}) == 1


@pytest.mark.slow
def test_ep2_matches_ep1_resumes_exactly_and_loads_at_ep1(tmp_path, demo_data):
    """2 ranks, top-2 of 4 experts in both layers, dropout on."""
    moe = TINY + ["--num-experts", "4", "--moe-router-topk", "2"]
    ep1, ep1_norms, _ = run_losses(tmp_path, "ep1", 2, moe)
    ep2, ep2_norms, out = run_losses(
        tmp_path,
        "ep2",
        2,
        moe + ["--expert-model-parallel-size", "2", "--save", str(tmp_path / "ck"), "--save-interval", "3"],
    )
    assert "expert parallel 2" in out and "load balancing loss:" in out
    assert sorted(ep2) == list(range(1, 7))
    assert relative_difference(ep2, ep1) < 1e-5
    assert relative_difference(ep2_norms, ep1_norms) < 1e-5
    # The iteration-3 checkpoint alone, as if the run had stopped there.
    (tmp_path / "ck3").mkdir()
    shutil.copytree(tmp_path / "ck" / "iter_0000003", tmp_path / "ck3" / "iter_0000003")
    (tmp_path / "ck3" / "latest_checkpointed_iteration.txt").write_text("3\n")
    resumed, _, out = run_losses(
        tmp_path, "resumed", 2, moe + ["--expert-model-parallel-size", "2", "--load", str(tmp_path / "ck3")]
    )
    assert "loaded checkpoint" in out
    assert [resumed[i] for i in (4, 5, 6)] == [ep2[i] for i in (4, 5, 6)]  # bitwise
    at_ep1, _, out = run_losses(tmp_path, "at_ep1", 2, moe + ["--load", str(tmp_path / "ck3")])
    assert "loaded checkpoint" in out
    assert relative_difference({i: at_ep1[i] for i in (4, 5, 6)}, {i: ep2[i] for i in (4, 5, 6)}) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["dp4", "tp2-dp2"])
def test_ep2_matches_ep1_on_four_ranks(tmp_path, demo_data, tensor_parallel):
    """4 ranks, a per-layer expert list (dense first layer); with TP 2 the experts are replicated over TP."""
    args = (
        TINY + NO_DROPOUT + ["--num-experts", "0", "4", "--tensor-model-parallel-size", str(tensor_parallel)]
    )
    ep1, ep1_norms, _ = run_losses(tmp_path, "ep1", 4, args)
    ep2, ep2_norms, out = run_losses(tmp_path, "ep2", 4, args + ["--expert-model-parallel-size", "2"])
    assert "expert parallel 2" in out
    assert relative_difference(ep2, ep1) < 1e-5
    assert relative_difference(ep2_norms, ep1_norms) < 1e-5
