"""Per-rank parameter and optimizer bytes and step time of the built-in GPT under 3D layouts on 4 CPU ranks.

One torchrun launch (this file as the worker) trains the same GPT under TP 1/2/4, PP 1/2/4 and TP 2 × PP 2
through `Engine.compose` (data parallelism takes the ranks that tensor × pipeline leave) with the same global
batch. Each rank adds up what it holds: parameters (its local shards of tensor-parallel DTensors, only its
pipeline stage's layers), optimizer state after a step; the table shows the largest rank, as Rapidformer's
published TP × PP table does (reference/rapidformer-flags.md) so the memory division is visible.

    python bench/parallel_layouts.py                # the default layouts, 4 ranks
    python bench/parallel_layouts.py --steps 6 --json rows.json
    python bench/parallel_layouts.py --layouts 1,1 2,2       # a subset (1,1 is the column's base)
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# (TP, PP) as in Rapidformer's table.
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]
# ~7.4 M parameters: 8 layers (PP 4 gets 2 each), 8 heads (TP 4 gets 2 each).
MODEL = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --hidden-dropout 0 "
    "--attention-dropout 0 --micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 100"
).split()
VOCAB = 8192  # divisible by 128 × TP for TP up to 4: the same model in every layout
WORLD = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="optimizer steps per layout; the first is not timed"
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--layouts", nargs="+", type=layout, default=LAYOUTS, metavar="TP,PP",
                        help="layouts to measure (default: all of the table's); must include 1,1")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if (1, 1) not in args.layouts:
        parser.error("--layouts must include 1,1: the 'vs (1,1)' column divides by it")
    return args


def layout(text: str) -> tuple[int, int]:
    tensor, _, pipeline = text.partition(",")
    ranks = int(tensor) * int(pipeline) if tensor.isdigit() and pipeline.isdigit() else 0
    if ranks == 0 or WORLD % ranks:
        raise argparse.ArgumentTypeError(f"{text!r} is not TP,PP with TP × PP dividing {WORLD} (e.g. 2,2)")
    return int(tensor), int(pipeline)


# ---- the worker: every layout, every rank ----


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (a DTensor's local shard), each tensor counted once (tied weights)."""
    unique = {id(tensor): tensor for tensor in tensors}
    total = 0
    for tensor in unique.values():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def optimizer_tensors(optimizer):
    import torch

    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def synthetic_batches(engine, steps: int):
    import torch

    generator = torch.Generator().manual_seed(engine.mesh.data_parallel_rank)
    batches = engine.plan.batches
    shape = (batches.micro_batch_size, engine.args.seq_length)
    for _ in range(steps):
        yield [
            {
                "tokens": torch.randint(0, VOCAB, shape, generator=generator),
                "labels": torch.randint(0, VOCAB, shape, generator=generator),
                "loss_mask": torch.ones(shape),
            }
            for _ in range(batches.accumulation_steps)
        ]


def measure_layout(tensor_parallel: int, pipeline_parallel: int, steps: int) -> dict:
    import torch.distributed as dist

    from rapidtrain.models import build_model
    from rapidtrain.train.builtin_pretrainer import masked_sum
    from rapidtrain.train.engine import Engine
    from rapidtrain.train.trainer import Trainer

    class SyntheticTrainer(Trainer):
        def run_forward_step(self, data_iterator, model):
            batch = next(data_iterator)
            losses = model(batch["tokens"], labels=batch["labels"])
            return losses, lambda per_token: masked_sum(per_token, batch["loss_mask"])

    argv = MODEL + [
        "--tensor-model-parallel-size",
        str(tensor_parallel),
        "--pipeline-model-parallel-size",
        str(pipeline_parallel),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),  # VOCAB rows with its end of document
    ]
    engine = Engine(argv=argv)
    engine.compose(build_model(engine.plan.model, seed=1234))
    trainer = SyntheticTrainer(engine)
    trainer.model = engine.runner.module
    parameter_bytes = local_bytes(p for p in engine.runner.module.parameters())
    seconds = []
    for batches in synthetic_batches(engine, steps):
        dist.barrier()
        started = time.perf_counter()
        trainer.train_step(batches)
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    optimizer_bytes = local_bytes(optimizer_tensors(engine.runner.optimizer))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (parameter_bytes, optimizer_bytes))
    layout = engine.plan.layout
    return {
        "tp": tensor_parallel,
        "pp": pipeline_parallel,
        "dp": layout.data_parallel_size,
        "parameter_bytes": max(p for p, _ in per_rank),
        "optimizer_bytes": max(o for _, o in per_rank),
        "parameter_bytes_min": min(p for p, _ in per_rank),
        "step_seconds": statistics.median(seconds[1:] or seconds),
        "samples_per_second": engine.plan.batches.global_batch_size
        / statistics.median(seconds[1:] or seconds),
        "total_parameters": engine.plan.memory.total_params,
    }


def worker(out: str, steps: int, layouts: list[tuple[int, int]]) -> None:
    import torch.distributed as dist

    rows = [measure_layout(tp, pp, steps) for tp, pp in layouts]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---- the launcher ----


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(steps: int, layouts: list[tuple[int, int]]) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={WORLD}",
            f"--master-port={free_port()}",
            __file__,
            "--worker",
            str(out),
            "--steps",
            str(steps),
            "--layouts",
            *(f"{tp},{pp}" for tp, pp in layouts),
        ]
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        subprocess.run(command, check=True, env={**__import__("os").environ, **env}, cwd=REPO)
        return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["tp"] == r["pp"] == 1)
    lines = [
        f"built-in GPT, {base['total_parameters']:,} parameters, fp32 + AdamW, {WORLD} CPU ranks (gloo), "
        "global batch 8, micro batch 1, seq 128; memory = the largest rank",
        "| TP × PP (DP) | parameters / rank | vs (1,1) | optimizer state / rank | step time | samples/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| ({r['tp']},{r['pp']}) ({r['dp']}) | {r['parameter_bytes'] / 2**20:.2f} MiB | "
            f"{r['parameter_bytes'] / base['parameter_bytes']:.2f} | {r['optimizer_bytes'] / 2**20:.2f} MiB | "
            f"{1000 * r['step_seconds']:.0f} ms | {r['samples_per_second']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.layouts)
        return
    rows = run(args.steps, args.layouts)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
