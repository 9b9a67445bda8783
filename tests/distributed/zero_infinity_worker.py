"""Worker for test_zero_infinity.py (run under torchrun): for each list of extra flags in the JSON list it is given,
one after another on the launch's one process group, trains the tiny GPT three steps under ZeRO-3 with those flags
and prints, from rank 0, one JSON line: losses, where the parameters live, and the plan's offload targets."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rapidtrain.core.process import exit_after  # noqa: E402
from rapidtrain.models import build_model  # noqa: E402
from rapidtrain.parallel.deepspeed import parameter_residency  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402

# Vocabulary 8192 × hidden 128: the embedding's shard per rank (2 MiB) passes DeepSpeed's 1 MiB async-I/O block,
# below which NVMe-offloaded shards stay in host memory.
VOCAB = 8192
FLAGS = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--zero-3-memory-optimization", "--num-workers", "0",
         "--zero-stage3-param-persistence-threshold", "1000"]


def main(configurations: list[list[str]]) -> None:
    engine = None
    for extra in configurations:
        engine = train(extra)  # the next Engine reuses the process group this one started
        gc.collect()  # the previous run's model, engine and optimizer state
    if engine is not None:
        engine.shutdown()


def train(extra: list[str]) -> Engine:
    # NullTokenizer's vocabulary is --vocab-size + 1 (its end of document): VOCAB rows, already a multiple of 128.
    engine = Engine(argv=FLAGS + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)] + extra)
    plan = engine.plan
    assert plan.model is not None and plan.model.vocab_size == VOCAB
    model, *_ = engine.compose(build_model(plan.model, seed=1), model_factory=lambda: build_model(plan.model, seed=1))
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=generator)
        loss = model(tokens, labels=tokens).float().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    residency = parameter_residency(engine.runner.engine.module, plan.zero.offload_params)
    if dist.get_rank() == 0:
        print(json.dumps({"losses": losses, "residency": residency, "offload_params": plan.zero.offload_params,
                          "threads": torch.get_num_threads(), "planned_threads": plan.zero.cpu_adam_threads}),
              flush=True)
    return engine


if __name__ == "__main__":
    # no interpreter finalization racing gloo's threads (rapidtrain/core/process.py)
    exit_after(lambda: main(json.loads(sys.argv[1])))
