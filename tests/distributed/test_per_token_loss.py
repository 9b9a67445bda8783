"""--calculate-per-token-loss and --decoupled-lr on 2 gloo ranks under DDP, OSS, FSDP2, DeepSpeed ZeRO-2 and a 2-stage
pipeline: with micro-batches whose loss masks keep very different token counts, one SGD step moves every weight by
the gradient of the global batch's token mean (one process's reference, which differs from the mean of the
micro-batches' means), the word embedding and output layer at their own rate; their rates then follow the schedule.

All five layouts run in one torchrun launch: run as a script under torchrun, this file is that launch.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

if __package__ in (None, ""):  # run by torchrun as the worker
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rapidtrain.models import build_model  # noqa: E402
from rapidtrain.models.config import ModelConfig  # noqa: E402
from rapidtrain.optim.optimizers import WRAPPER_NAMES, is_embedding_or_output  # noqa: E402
from tests.launch import torchrun  # noqa: E402

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                     vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, tie_embeddings=False)
LR, MIN_LR, DECOUPLED_LR, DECOUPLED_MIN_LR, ITERATIONS, GLOBAL_BATCH = 0.5, 0.05, 2.0, 0.1, 4, 8
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--train-iters", str(ITERATIONS), "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine",
         "--decoupled-lr", str(DECOUPLED_LR), "--decoupled-min-lr", str(DECOUPLED_MIN_LR),
         "--calculate-per-token-loss", "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0",
         "--clip-grad", "0", "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH)]
MODES = {"ddp": [], "oss": ["--oss-memory-optimization"], "fsdp": ["--fsdp-memory-optimization"],
         "zero2": ["--zero-2-memory-optimization"], "pp2": ["--pipeline-model-parallel-size", "2"]}


def global_batch() -> list[dict[str, torch.Tensor]]:
    """Four micro-batches of 2 samples; the loss masks keep 2, 31, 9 and 32 tokens."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, 17), generator=generator)
    mask = torch.zeros(GLOBAL_BATCH, 16)
    for sample, kept in enumerate([1, 1, 16, 15, 4, 5, 16, 16]):
        mask[sample, torch.randperm(16, generator=generator)[:kept]] = 1.0
    return [{"tokens": tokens[i:i + 2, :-1], "labels": tokens[i:i + 2, 1:], "loss_mask": mask[i:i + 2]}
            for i in range(0, GLOBAL_BATCH, 2)]


def bare(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


# ---- the worker: one torchrun launch, every layout in turn on its process group ----

def run_mode(flags: list[str]) -> dict:
    import torch.distributed as dist

    from rapidtrain.train.engine import Engine
    from rapidtrain.train.trainer import Trainer

    class TokenSumTrainer(Trainer):
        def run_forward_step(self, data_iterator, model):
            batch = next(data_iterator)
            losses = model(batch["tokens"], labels=batch["labels"], attention_mask=None)
            return losses, lambda per_token: ((per_token * batch["loss_mask"]).sum(), batch["loss_mask"].sum())

    engine = Engine(argv=FLAGS + flags)
    trainer = TokenSumTrainer(engine)
    trainer.model, *_ = engine.compose(build_model(CONFIG, seed=7))
    layout = engine.plan.layout
    batches = global_batch()
    if layout.data_parallel_size > 1:  # each rank its half of the global batch
        half = len(batches) // layout.data_parallel_size
        batches = batches[dist.get_rank() * half:(dist.get_rank() + 1) * half]
    rates = []
    for iteration in range(3):
        trainer.train_step(batches)
        rates.append(sorted([bool(g.get("max_lr")), float(g["lr"])] for g in engine.runner.optimizer.param_groups))
        if iteration == 0:
            weights = {bare(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
                       for n, p in engine.runner.module.named_parameters()}
    return {"weights": weights, "rates": rates}


def worker(out: Path) -> None:
    import gc

    import torch.distributed as dist

    results = {}
    for mode, flags in MODES.items():
        results[mode] = run_mode(flags)
        gc.collect()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# ---- the test: the launch, then the one-process reference ----

@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("per_token")
    torchrun(2, Path(__file__), [str(out)], timeout=900, warm=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def reference_step(per_token: bool) -> dict[str, torch.Tensor]:
    """One process, one SGD step on the global batch: the token mean over all micro-batches (or, to show the test
    tells them apart, Megatron's default mean of the micro-batches' means)."""
    model = build_model(CONFIG, seed=7)
    batches = global_batch()
    sums = [(model(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() for b in batches]
    counts = [b["loss_mask"].sum() for b in batches]
    loss = sum(sums) / sum(counts) if per_token else sum(s / c for s, c in zip(sums, counts, strict=True)) / 4
    loss.backward()
    return {name: (p - (DECOUPLED_LR if is_embedding_or_output(name) else LR) * p.grad).detach()
            for name, p in model.named_parameters()}


def cosine(peak: float, floor: float, iterations_done: int) -> float:
    ratio = iterations_done / ITERATIONS
    return floor + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - floor)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_one_step_moves_every_weight_by_the_global_token_mean_at_its_groups_rate(ranks, mode):
    expected, mean_of_means = reference_step(per_token=True), reference_step(per_token=False)
    weights = {**ranks[0][mode]["weights"], **ranks[1][mode]["weights"]}  # pipeline stages hold halves
    assert set(weights) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(weights[name]), value, rtol=1e-5, atol=2e-6, msg=name)
    output = "output.weight"
    assert (expected[output] - mean_of_means[output]).abs().max() > 1e-3  # a mean of means would fail above


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_both_groups_rates_follow_the_schedule(ranks, mode):
    for done, rates in enumerate(ranks[0][mode]["rates"], start=1):
        own = [rate for decoupled, rate in rates if decoupled]
        shared = [rate for decoupled, rate in rates if not decoupled]
        assert own and own == [pytest.approx(cosine(DECOUPLED_LR, DECOUPLED_MIN_LR, done), rel=1e-9)] * len(own)
        assert shared and shared == [pytest.approx(cosine(LR, MIN_LR, done), rel=1e-9)] * len(shared)


if __name__ == "__main__":
    from rapidtrain.core.process import exit_after

    exit_after(lambda: worker(Path(sys.argv[1])))  # no interpreter finalization racing gloo's threads
