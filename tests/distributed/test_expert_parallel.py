"""Expert parallelism on gloo: gradients against a one-process reference (4 ranks, also with tensor and sequence
parallelism), EP 2 against EP 1 losses on 2 ranks, exact resume, and an EP 2 checkpoint loaded at EP 1; and EP
composed with pipeline parallelism, FSDP, ZeRO-2, ZeRO-1 over TP and OSS on 4 ranks (issue 12), each against
one process, resumed exactly, and loaded across layouts (the 4-rank loss parity lives there: a per-layer expert
list with a dense first layer too)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import read_extra, read_grad_norms, read_losses, relative_difference, torchrun

WORKER = Path(__file__).with_name("expert_parallel_worker.py")
RUNS = Path(__file__).with_name("pretrain_runs.py")
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    "--global-batch-size 8 --num-workers 0 --log-interval 1 --eval-iters 0 --lr 1e-3 --lr-warmup-iters 1 "
    "--train-iters 6 --moe-loss-coeff 0.1"
).split()
NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0".split()


def worker_reports(tmp_path: Path, nproc: int, ep: int, extra: list[str]) -> list[dict]:
    torchrun(nproc, WORKER, [str(tmp_path), str(ep), *extra], warm=True)
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


def ep1_ep2_runs(out: Path) -> dict[str, list[str]]:
    """Top-2 of 4 experts in both layers, dropout on: EP 1, EP 2 (saving every STOP iterations), EP 2 stopped at
    STOP, that checkpoint resumed at EP 2 and loaded at EP 1."""
    moe = TINY + ["--num-experts", "4", "--moe-router-topk", "2", "--train-iters", str(ITERS)]
    ep2 = moe + ["--expert-model-parallel-size", "2"]
    return {"ep1": moe, "ep2": ep2 + ["--save", str(out / "ck"), "--save-interval", str(STOP)],
            "ep2_stopped": ep2 + ["--save", str(out / "ck_stopped"), "--exit-interval", str(STOP)],
            "resumed": ep2 + ["--load", str(out / "ck_stopped")], "at_ep1": moe + ["--load", str(out / "ck_stopped")]}


def oss_runs(out: Path) -> dict[str, list[str]]:
    """EP 2 + OSS at DP 2, uninterrupted, and stopped at STOP then resumed (both halves log to one file)."""
    flags = COMPOSED_FLAGS + COMPOSED["ep2_oss"]
    return {"oss_uninterrupted": flags + ["--loss-log-file", str(out / "oss_uninterrupted.txt")],
            "oss_stopped": flags + ["--loss-log-file", str(out / "oss_resumed.txt"), "--exit-interval", str(STOP),
                                    "--save", str(out / "oss_stopped")],
            "oss_resumed": flags + ["--loss-log-file", str(out / "oss_resumed.txt"),
                                    "--load", str(out / "oss_stopped")]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, demo_data) -> tuple[Path, dict[str, str]]:
    """Every 2-rank run of this file in one torchrun launch (pretrain_runs.py), one after another: the EP 1 / EP 2
    runs and OSS's. Two launches of the same world size paid the agent's imports and the rendezvous twice; each run
    builds its own engine, model and optimizer, so sharing the launch changes no number. Returns the folder and each
    run's printed section (every run prints its plan first)."""
    out = tmp_path_factory.mktemp("ep_two_ranks")
    ep_runs = {name: flags + ["--loss-log-file", str(out / f"{name}.txt")] for name, flags in ep1_ep2_runs(out).items()}
    runs = {**ep_runs, **oss_runs(out)}
    (out / "runs.json").write_text(json.dumps(list(runs.values())))
    launch = torchrun(2, RUNS, [str(out / "runs.json")], warm=True)
    return out, dict(zip(runs, launch.stdout.split("rapidtrain plan —")[1:], strict=True))


@pytest.mark.slow
def test_ep2_matches_ep1_resumes_exactly_and_loads_at_ep1(two_ranks):
    """2 ranks, top-2 of 4 experts in both layers, dropout on (ep1_ep2_runs): EP 2's losses and norms are EP 1's; the
    run stopped at iteration 2 resumes bitwise at EP 2 and continues at EP 1."""
    out_dir, out = two_ranks
    names = list(ep1_ep2_runs(out_dir))
    losses = {name: read_losses(out_dir / f"{name}.txt") for name in names}
    norms = {name: read_grad_norms(out_dir / f"{name}.txt") for name in ("ep1", "ep2")}
    before, after = range(1, STOP + 1), range(STOP + 1, ITERS + 1)
    assert "expert parallel 2" in out["ep2"] and "load balancing loss:" in out["ep2"]
    assert sorted(losses["ep2"]) == list(range(1, ITERS + 1))
    assert relative_difference(losses["ep2"], losses["ep1"]) < 1e-5
    assert relative_difference(norms["ep2"], norms["ep1"]) < 1e-5
    assert (out_dir / "ck" / f"iter_{STOP:07d}").is_dir()  # the periodic save, beside the stopped run's
    assert [losses["ep2_stopped"][i] for i in before] == [losses["ep2"][i] for i in before]
    # Both loads say so (loaded at EP 1, the checkpoint's layout is read before the run prints its plan: that line
    # ends the section before it).
    loaded = f"loaded checkpoint from {out_dir / 'ck_stopped'} at iteration {STOP}"
    assert sum(out[name].count(loaded) for name in names) == 2
    assert [losses["resumed"][i] for i in after] == [losses["ep2"][i] for i in after]  # bitwise
    at_ep1 = {i: losses["at_ep1"][i] for i in after}
    assert relative_difference(at_ep1, {i: losses["ep2"][i] for i in after}) < 1e-5


# ---- expert parallelism composed with pipeline parallelism and state partitioning (one torchrun launch) ----

# 4 experts in both layers, global batch 8 of micro-batches of 2: 4 micro-batches in one process, 1 per rank at
# DP 4, 2 per rank at PP 2 × DP 2. The vocabulary (2,005 ids) pads to 2048 at TP 1 and TP 2.
# Four iterations, stopped at the second (argparse: the last --train-iters wins over TINY's 6): each of the launch's
# 16 four-rank runs (and the 2-rank launch's 8) pays for every iteration, and a resume past the warm-up checks the
# same state at either length.
ITERS, STOP = 4, 2
COMPOSED_FLAGS = TINY + NO_DROPOUT + ["--num-experts", "4", "--make-vocab-size-divisible-by", "256",
                                      "--train-iters", str(ITERS)]
EP2 = ["--expert-model-parallel-size", "2"]
# The four layouts issue 12 names; each is also stopped at iteration 2 (checkpoint) and, but for OSS, resumed.
COMPOSED = {
    "pp2_ep2": EP2 + ["--pipeline-model-parallel-size", "2"],  # DP 2 = EP 2: each stage's experts over 2 ranks
    "ep2_fsdp": EP2 + ["--fsdp-memory-optimization"],  # DP 4: FSDP2 shards each slice over its 2 holders
    "ep2_zero2": EP2 + ["--zero-2-memory-optimization"],  # FSDP2 with reshard_after_forward=False
    "ep2_oss": EP2 + ["--oss-memory-optimization"],  # experts stepped by each rank's local optimizer
}
# The other branches, parity only: experts left out of FSDP2 (DP = EP; TP), and a pipeline stage without MoE.
BRANCHES = {
    "ep4_fsdp": ["--expert-model-parallel-size", "4", "--fsdp-memory-optimization"],
    "tp2_ep2_zero1": EP2 + ["--tensor-model-parallel-size", "2", "--zero-1-memory-optimization"],
}
DENSE_FIRST = ["--num-experts", "0", "4"]  # replaces COMPOSED_FLAGS' expert count (argparse: the last wins)
# Checkpoints loaded across layouts: EP 2 (with FSDP, OSS, PP) at EP 1 in one process, and EP 1 at EP 2.
LOADED_AT_EP1 = ("ep2_fsdp", "ep2_oss", "pp2_ep2")
LOADED_FROM_EP1 = ("ep2_fsdp", "ep2_oss")
# OSS wraps DDP, which on 4 ranks rebuilds its gradient buckets after the first iteration of every run, and gloo
# sums 4 ranks in an order that depends on a gradient's place in its bucket: the first iteration after a resume
# rounds differently (plain DDP at DP 4 too). OSS + EP resumes bitwise on 2 ranks (test below).
RESUMED_ON_FOUR_RANKS = ("pp2_ep2", "ep2_fsdp", "ep2_zero2")
PARITY = 1e-5  # relative, fp32


def train_here(args: list[str]) -> None:
    """One process, in this process: the reference every layout must reproduce."""
    from rapidtrain.pretrain import main

    main(args)


def composed_runs(out: Path) -> list[list[str]]:
    def log(name: str) -> list[str]:
        return ["--loss-log-file", str(out / f"{name}.txt")]

    runs = []
    for name, flags in COMPOSED.items():
        runs.append(COMPOSED_FLAGS + flags + log(name))
        halves = log(f"{name}_resumed")
        runs.append(COMPOSED_FLAGS + flags + halves + ["--exit-interval", str(STOP),
                                                       "--save", str(out / f"{name}_stopped")])
        if name in RESUMED_ON_FOUR_RANKS:
            runs.append(COMPOSED_FLAGS + flags + halves + ["--load", str(out / f"{name}_stopped")])
    for name, flags in BRANCHES.items():
        runs.append(COMPOSED_FLAGS + flags + log(name))
    runs.append(COMPOSED_FLAGS + DENSE_FIRST + ["--pipeline-model-parallel-size", "2"] + log("pp2_dense_first"))
    for name in LOADED_FROM_EP1:
        runs.append(COMPOSED_FLAGS + COMPOSED[name] + log(f"{name}_from_ep1")
                    + ["--load", str(out / "single_stopped")])
    return runs


@pytest.fixture(scope="module")
def composed(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("ep_composed")
    train_here(COMPOSED_FLAGS + ["--loss-log-file", str(out / "single.txt"), "--save", str(out / "single_ck"),
                                 "--save-interval", str(STOP)])
    (out / "single_stopped").mkdir()  # the iteration-2 checkpoint alone, as if the run had stopped there
    shutil.copytree(out / "single_ck" / f"iter_{STOP:07d}", out / "single_stopped" / f"iter_{STOP:07d}")
    (out / "single_stopped" / "latest_checkpointed_iteration.txt").write_text(f"{STOP}\n")
    train_here(COMPOSED_FLAGS + DENSE_FIRST + ["--loss-log-file", str(out / "single_dense_first.txt")])
    (out / "runs.json").write_text(json.dumps(composed_runs(out)))
    torchrun(4, RUNS, [str(out / "runs.json")], timeout=1800, warm=True)
    for name in LOADED_AT_EP1:
        train_here(COMPOSED_FLAGS + ["--load", str(out / f"{name}_stopped"),
                                     "--loss-log-file", str(out / f"ep1_from_{name}.txt")])
    return out


def parity(out: Path, name: str, reference: str = "single") -> dict[str, float]:
    """Largest relative difference to the reference, per logged quantity (lm loss, grad norm, balancing loss)."""
    run, ref = out / f"{name}.txt", out / f"{reference}.txt"
    losses = read_losses(run)
    iterations = sorted(losses)
    assert iterations == sorted(read_losses(ref))[-len(iterations):]

    def only(values: dict[int, float]) -> dict[int, float]:
        return {i: values[i] for i in iterations}

    return {
        "lm loss": relative_difference(losses, only(read_losses(ref))),
        "grad norm": relative_difference(read_grad_norms(run), only(read_grad_norms(ref))),
        "load balancing loss": relative_difference(read_extra(run, "load_balancing_loss"),
                                                   only(read_extra(ref, "load_balancing_loss"))),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", [*COMPOSED, *BRANCHES])
def test_expert_parallel_composition_matches_one_process(composed, name):
    """Four iterations on 4 ranks with clipping on: lm loss, gradient norm and the logged load-balancing loss (the
    mean over every MoE layer of every pipeline stage) equal one process's with the same global batch."""
    differences = parity(composed, name)
    print(f"{name}: {differences}")
    assert sorted(read_losses(composed / f"{name}.txt")) == list(range(1, ITERS + 1))
    assert all(value < PARITY for value in differences.values()), differences


@pytest.mark.slow
def test_pipeline_stage_without_experts_joins_the_balancing_loss(composed):
    """PP 2 with a dense first layer: the first stage has no MoE layer, the logged loss is still the model's."""
    differences = parity(composed, "pp2_dense_first", reference="single_dense_first")
    print(f"pp2_dense_first: {differences}")
    assert all(value < PARITY for value in differences.values()), differences


def assert_resumed_bitwise(resumed: Path, uninterrupted: Path) -> None:
    assert sorted(read_losses(resumed)) == list(range(1, ITERS + 1))
    for read in (read_losses, read_grad_norms, lambda path: read_extra(path, "load_balancing_loss")):
        after, before = read(resumed), read(uninterrupted)
        assert [after[i] for i in range(STOP + 1, ITERS + 1)] == [before[i] for i in range(STOP + 1, ITERS + 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMED_ON_FOUR_RANKS)
def test_expert_parallel_composition_resumes_bitwise(composed, name):
    """Stopped at iteration 2 by --exit-interval (checkpoint), resumed with --load: iterations 3..4 are bitwise the
    uninterrupted run's, balancing loss and gradient norm included."""
    assert_resumed_bitwise(composed / f"{name}_resumed.txt", composed / f"{name}.txt")


@pytest.mark.slow
def test_ep2_with_oss_resumes_bitwise_on_two_ranks(two_ranks):
    """EP 2 + OSS at DP 2: the expert slices' state (each rank's local optimizer) and the partitioned rest come
    back from the checkpoint, and iterations 3..4 are bitwise the uninterrupted run's (oss_runs)."""
    out_dir, _ = two_ranks
    assert_resumed_bitwise(out_dir / "oss_resumed.txt", out_dir / "oss_uninterrupted.txt")


@pytest.mark.slow
@pytest.mark.parametrize("name", LOADED_AT_EP1)
def test_composed_checkpoint_continues_at_ep1_in_one_process(composed, name):
    """The iteration-2 checkpoint of EP 2 (+ FSDP2's split slices, OSS's local state, pipeline stages) continues in
    one process as the one-process run does."""
    differences = parity(composed, f"ep1_from_{name}")
    print(f"ep1_from_{name}: {differences}")
    assert sorted(read_losses(composed / f"ep1_from_{name}.txt")) == list(range(STOP + 1, ITERS + 1))
    assert all(value < PARITY for value in differences.values()), differences


@pytest.mark.slow
@pytest.mark.parametrize("name", LOADED_FROM_EP1)
def test_one_process_checkpoint_continues_under_composed_ep2(composed, name):
    differences = parity(composed, f"{name}_from_ep1")
    print(f"{name}_from_ep1: {differences}")
    assert sorted(read_losses(composed / f"{name}_from_ep1.txt")) == list(range(STOP + 1, ITERS + 1))
    assert all(value < PARITY for value in differences.values()), differences
