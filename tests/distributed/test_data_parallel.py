"""DDP, OSS, SDP and FSDP on 2 gloo ranks: the losses and gradient norms of one process with the same global
batch, no gradient reduction on accumulation micro-batches, exact resume and loads across modes.

All 2-rank trainings run in one torchrun launch (`pretrain_runs.py`); the one-process references run in
this process. Run as a script under torchrun, this file is the gradient-synchronisation probe.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run by torchrun as the probe
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.launch import TINY_GPT_PARITY, read_grad_norms, read_losses, relative_difference, torchrun  # noqa: E402

RUNS = Path(__file__).with_name("pretrain_runs.py")
# Global batch 8 = micro 2 × accumulation 2 × 2 ranks (accumulation 4 in one process). Six iterations, stopped
# and resumed at the third: every iteration accumulates, so more of them prove nothing more (and cost each of the
# 24 two-rank runs of the launch below).
ITERS, STOP = 6, 3
TINY = [
    *TINY_GPT_PARITY,
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--log-interval",
    str(STOP),
    "--lr",
    "1e-3",
    "--train-iters",
    str(ITERS),
]
TORCH_MODES = {
    "ddp": [],
    "oss": ["--oss-memory-optimization"],
    "sdp": ["--oss-sdp-memory-optimization"],
    "fsdp": ["--fsdp-memory-optimization"],
}
# The optional FairScale backend is tested where it is installed (pip install --no-deps fairscale==0.4.13).
FAIRSCALE_MODES = {
    "fairscale-oss": ["--sharding-backend", "fairscale", "--oss-memory-optimization"],
    "fairscale-sdp": ["--sharding-backend", "fairscale", "--oss-sdp-memory-optimization"],
}
MODES = TORCH_MODES | (FAIRSCALE_MODES if importlib.util.find_spec("fairscale") else {})
PRECISIONS = {"fp32": ([], 1e-5), "bf16": (["--bf16"], 1e-2)}


def train_here(args: list[str]) -> None:
    """One process, in this process: the reference every layout must reproduce."""
    from rapidtrain.pretrain import main

    main(args)


def two_rank_runs(out: Path) -> list[list[str]]:
    runs = []
    for mode, flags in MODES.items():
        for precision, (precision_flags, _) in PRECISIONS.items():
            runs.append(
                TINY + flags + precision_flags + ["--loss-log-file", str(out / f"{mode}_{precision}.txt")]
            )
        resumed = ["--loss-log-file", str(out / f"{mode}_resumed.txt")]
        runs.append(TINY + flags + resumed + ["--exit-interval", str(STOP), "--save", str(out / f"{mode}_stopped")])
        runs.append(
            TINY + flags + resumed + ["--load", str(out / f"{mode}_stopped"), "--save", str(out / f"{mode}_end")]
        )
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data) -> Path:
    out = tmp_path_factory.mktemp("data_parallel")
    for precision, (precision_flags, _) in PRECISIONS.items():
        train_here(TINY + precision_flags + ["--loss-log-file", str(out / f"single_{precision}.txt")])
    (out / "runs.json").write_text(json.dumps(two_rank_runs(out)))
    torchrun(2, RUNS, [str(out / "runs.json")], timeout=900, warm=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", MODES)
def test_layout_matches_single_process_losses_and_grad_norms(runs, mode, precision):
    """6 iterations, accumulation 2: losses and the logged global gradient norm (which --clip-grad 1.0
    uses) equal one process's, fp32 within 1e-5 and bf16 within 1e-2 relative."""
    tolerance = PRECISIONS[precision][1]
    single, layout = runs / f"single_{precision}.txt", runs / f"{mode}_{precision}.txt"
    assert len(read_losses(layout)) == ITERS
    assert relative_difference(read_losses(layout), read_losses(single)) < tolerance
    assert relative_difference(read_grad_norms(layout), read_grad_norms(single)) < tolerance


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bitwise_exact(runs, mode):
    """Stopped at iteration 3 (checkpoint), resumed with --load: iterations 4..6 are bitwise the
    uninterrupted run's on the same machine."""
    resumed, uninterrupted = read_losses(runs / f"{mode}_resumed.txt"), read_losses(runs / f"{mode}_fp32.txt")
    assert sorted(resumed) == list(range(1, ITERS + 1))
    after = range(STOP + 1, ITERS + 1)
    assert [resumed[i] for i in after] == [uninterrupted[i] for i in after]
    assert (runs / f"{mode}_stopped" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STOP)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [m for m in MODES if m in ("fsdp", "oss", "fairscale-sdp")])
def test_two_rank_checkpoint_continues_in_one_process(runs, mode, tmp_path):
    """FSDP on 2 ranks → one process, and OSS on 2 ranks (each rank saved its own optimizer share; also
    FairScale's) → plain model on 1: iterations 4..6 continue with the one-process run's losses."""
    log = tmp_path / "continued.txt"
    train_here(TINY + ["--load", str(runs / f"{mode}_stopped"), "--loss-log-file", str(log)])
    continued, single = read_losses(log), read_losses(runs / "single_fp32.txt")
    assert sorted(continued) == list(range(STOP + 1, ITERS + 1))
    assert relative_difference(continued, {i: single[i] for i in continued}) < 1e-5


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("probe")
    torchrun(2, __file__, [str(out)], timeout=600, warm=True)
    return json.loads((out / "probe.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "oss"])
def test_ddp_accumulation_reduces_only_on_the_last_micro_batch(probes, mode):
    """DDP's communication hook runs no all-reduce in the first micro-batch (no_sync), and the ranks' gradients
    still differ there; after the last micro-batch they are reduced and equal on both ranks."""
    probe = probes[mode]
    assert probe["all_reduces"][0] == 0 and probe["all_reduces"][1] > 0
    first, last = probe["grad_norms"]
    assert first[0] != first[1]
    assert last[0] == last[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sdp", "fsdp"])
def test_fsdp_accumulation_reduces_only_on_the_last_micro_batch(probes, mode):
    """FSDP2 with set_requires_gradient_sync(False) on the first micro-batch: no reduce-scatter ran, so no
    sharded gradient exists yet (even though backward runs after the micro-batch context); after the last
    one the reduced gradient equals DDP's."""
    probe = probes[mode]
    assert probe["sharded_grads"][0] == 0 and probe["sharded_grads"][1] > 0
    last, ddp_last = probe["grad_norms"][1], probes["ddp"]["grad_norms"][1]
    assert last[0] == last[1]
    assert abs(last[0] - ddp_last[0]) <= 1e-6 * ddp_last[0]


def test_fsdp_cpu_offload_is_refused_with_reason():
    from rapidtrain.config import arguments, rules
    from rapidtrain.config.settings import RunContext

    args = arguments.parse_args(
        ["--train-iters", "1", "--lr", "1e-3", "--fsdp-memory-optimization", "--cpu-offload"]
    )
    messages = rules.violations(args, RunContext(world_size=2))
    assert len(messages) == 1
    assert (
        "--fsdp-memory-optimization" in messages[0]
        and "--zero-3-memory-optimization --cpu-offload" in messages[0]
    )


def test_fairscale_fsdp_is_refused_with_reason():
    from rapidtrain.config import arguments, rules
    from rapidtrain.config.settings import RunContext

    args = arguments.parse_args(
        [
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
            "--sharding-backend",
            "fairscale",
            "--fsdp-memory-optimization",
        ]
    )
    messages = rules.violations(args, RunContext(world_size=2))
    assert len(messages) == 1 and "FairScale's FSDP does not run with current PyTorch" in messages[0]


# ---- the probe, run by torchrun on 2 ranks ----

PROBE = [
    "--train-iters",
    "1",
    "--lr",
    "1e-3",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
VOCAB = 128


def probe_gradient_sync(flags: list[str]) -> dict[str, list]:
    """Two micro-batches of one global batch, as the trainer runs them (backward after the micro-batch
    context): reductions and gradients after each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from rapidtrain.models import build_model
    from rapidtrain.train.engine import Engine

    engine = Engine(argv=PROBE + flags)
    module, *_ = engine.compose(build_model(engine.plan.model, seed=1))
    calls = [0]
    if isinstance(module, DistributedDataParallel):

        def counting_hook(group, bucket):
            calls[0] += 1
            return allreduce_hook(group, bucket)

        module.register_comm_hook(engine.mesh.group("dp"), counting_hook)
    report: dict[str, list] = {"all_reduces": [], "sharded_grads": [], "grad_norms": []}
    for index in range(2):
        generator = torch.Generator().manual_seed(10 * dist.get_rank() + index)
        tokens = torch.randint(0, VOCAB, (2, 16), generator=generator)
        with engine.runner.micro_batch(is_last=index == 1):
            loss = module(tokens, labels=tokens).mean()
        engine.runner.backward(loss)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        norm = float(torch.stack([g.double().norm() for g in full]).norm()) if full else 0.0
        norms = [None, None]
        dist.all_gather_object(norms, norm)
        report["all_reduces"].append(calls[0])
        report["sharded_grads"].append(sum(hasattr(g, "full_tensor") for g in grads))
        report["grad_norms"].append(norms)
    return report


if __name__ == "__main__":
    from rapidtrain.core.process import exit_after

    def _main() -> None:
        import torch.distributed as dist

        reports = {mode: probe_gradient_sync(flags) for mode, flags in TORCH_MODES.items()}
        if dist.get_rank() == 0:
            (Path(sys.argv[1]) / "probe.json").write_text(json.dumps(reports))
        dist.barrier()
        dist.destroy_process_group()

    exit_after(_main)  # no interpreter finalization racing gloo's threads
