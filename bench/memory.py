"""Model-state bytes per rank under every partitioning mode, measured beside the ZeRO paper's formula.

For each mode and world size it launches torchrun with this file as the worker: the built-in GPT (a few
million parameters) trains a few steps through `Engine.compose`, and each rank adds up the tensors it
actually holds: parameters (local shards of FSDP's DTensors, DeepSpeed's 16-bit weights or ZeRO-3
partitions), gradients after the last backward (before the step), optimizer state after the step
(ZeroRedundancyOptimizer's local state, DeepSpeed's fp32 master partitions and Adam moments). The
formula is `rapidtrain.plan.memory_estimate` (one place); ratio = measured / formula. Peak RSS is the
rank's peak process memory; step time is relative to DDP at the same world size.

    python bench/memory.py                      # all modes at 2 and 4 ranks, --bf16 (DeepSpeed's own bf16)
    python bench/memory.py --modes ddp fsdp --world-sizes 2 --precision fp32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODES = {
    "ddp": [],
    "oss": ["--oss-memory-optimization"],
    "sdp": ["--oss-sdp-memory-optimization"],
    "fsdp": ["--fsdp-memory-optimization"],
    "zero-1": ["--zero-1-memory-optimization"],
    "zero-2": ["--zero-2-memory-optimization"],
    "zero-3": ["--zero-3-memory-optimization"],
    "zero-2+offload": ["--zero-2-memory-optimization", "--cpu-offload"],
}
# ~5.3 M parameters in 4 layers and a small vocabulary, so that no single tensor dominates: OSS partitions
# whole parameters, and one embedding of half the model would land on one rank. Every matrix is above
# DeepSpeed's ZeRO-3 persistence threshold (1e5 elements), so ZeRO-3 partitions all but biases and norms.
MODEL = ["--num-layers", "4", "--hidden-size", "320", "--num-attention-heads", "4", "--seq-length", "128"]
VOCAB = 1024
MICRO_BATCH = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is not timed")
    parser.add_argument("--json", default=None, help="also write the rows here")
    return parser.parse_args(argv)


# ---- the worker: one mode, one world size, every rank ----


def tensor_bytes(tensors) -> int:
    """Bytes of the local storage of `tensors` (DTensor: this rank's shard), each distinct tensor once."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.data_ptr(), local.numel(), local.dtype)
        if local.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def state_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel")]


def deepspeed_states(engine) -> dict[str, list]:
    """DeepSpeed ZeRO's own buffers, by kind (stage 1/2: DeepSpeedZeroOptimizer; stage 3: its Stage3 sibling)."""
    zero = engine.optimizer
    params = list(engine.module.parameters())
    if hasattr(
        zero, "fp32_partitioned_groups_flat"
    ):  # stage 3: partitions, plus whole small "persistent" ones
        weights = list(zero.fp16_partitioned_groups_flat) + [
            p.data for p in params if getattr(p, "ds_persist", 0)
        ]
        masters = list(zero.fp32_partitioned_groups_flat)
        grads = [zero.grad_partitions_flat_buffer] + [m.grad for m in masters]
    else:
        weights = list(zero.bit16_groups_flat)
        masters = list(zero.single_partition_of_fp32_groups)
        averaged = getattr(zero, "averaged_gradients", {}) or {}
        grads = [g for group in averaged.values() for g in group or []]
        grads += [p.grad for p in params] + [m.grad for m in masters]
    return {"params": weights, "grads": grads, "optimizer": masters + state_tensors(zero.optimizer)}


def torch_states(runner) -> dict[str, list]:
    params = list(runner.module.parameters())
    optimizer = getattr(runner.optimizer, "optim", runner.optimizer)  # ZeroRedundancyOptimizer: local share
    return {"params": params, "grads": [p.grad for p in params], "optimizer": state_tensors(optimizer)}


def held_bytes(runner) -> dict[str, int]:
    engine = getattr(runner, "engine", None)
    states = deepspeed_states(engine) if engine is not None else torch_states(runner)
    return {kind: tensor_bytes(tensors) for kind, tensors in states.items()}


def run_worker(mode: str, precision: str, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from rapidtrain.engine import Engine
    from rapidtrain.models import build_model

    world = int(os.environ["WORLD_SIZE"])
    flags = MODEL + MODES[mode] + ([] if precision == "fp32" else ["--bf16"])
    flags += ["--train-iters", str(steps), "--lr", "1e-4", "--micro-batch-size", str(MICRO_BATCH)]
    flags += [
        "--global-batch-size",
        str(MICRO_BATCH * world),
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ]
    engine = Engine(argv=flags)
    plan = engine.resolve_model(VOCAB)
    module, *_ = engine.compose(
        build_model(plan.model, seed=1), model_factory=lambda: build_model(plan.model, None)
    )
    runner, seq = engine.runner, plan.model.seq_length
    generator = torch.Generator().manual_seed(dist.get_rank())
    measured, started = {}, 0.0
    for step in range(steps):
        if step == 1:
            started = time.perf_counter()
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, seq), generator=generator)
        with runner.micro_batch(is_last=True):
            loss = module(tokens, labels=tokens).float().mean()
        runner.backward(loss)
        measured["grads"] = held_bytes(runner)["grads"]  # reduced, before the step consumes them
        engine.step()
    seconds = (time.perf_counter() - started) / max(steps - 1, 1)
    after = held_bytes(runner)
    memory = plan.memory
    report = {
        "mode": mode,
        "world": world,
        "rank": dist.get_rank(),
        "params": after["params"],
        "grads": measured["grads"],
        "optimizer": after["optimizer"],
        "step_seconds": seconds,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "formula": {
            "params": memory.param_bytes,
            "grads": memory.grad_bytes,
            "optimizer": memory.optimizer_bytes,
            "optimizer_on_cpu": memory.optimizer_on_cpu,
        },
        "parameters": memory.total_params,
    }
    (out / f"rank_{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver ----


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(mode: str, world: int, precision: str, steps: int) -> dict:
    """One torchrun launch; the largest rank's numbers (ranks differ only by uneven shards)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            f"--master-port={free_port()}",
            __file__,
            "--worker",
            mode,
            precision,
            str(steps),
            folder,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if result.returncode != 0:
            raise RuntimeError(
                f"{mode} on {world} ranks failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
            )
        reports = [json.loads((Path(folder) / f"rank_{r}.json").read_text()) for r in range(world)]
    row = {key: max(r[key] for r in reports) for key in ("params", "grads", "optimizer", "peak_rss")}
    row.update(
        mode=mode,
        world=world,
        formula=reports[0]["formula"],
        parameters=reports[0]["parameters"],
        step_seconds=max(r["step_seconds"] for r in reports),
    )
    return row


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:7.2f}"


def format_table(rows: list[dict], precision: str) -> str:
    lines = [
        f"model: {rows[0]['parameters']:,} parameters; {precision}; MiB per rank, measured / formula (ratio)",
        "| mode | ranks | parameters | gradients | optimizer state | peak RSS | step time vs DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    ddp = {r["world"]: r["step_seconds"] for r in rows if r["mode"] == "ddp"}
    for r in rows:
        cells = []
        for kind in ("params", "grads", "optimizer"):
            formula = r["formula"][kind]
            ratio = r[kind] / formula if formula else float("nan")
            where = " (CPU)" if kind == "optimizer" and r["formula"]["optimizer_on_cpu"] else ""
            cells.append(f"{mib(r[kind])} / {mib(formula)} ({ratio:.2f}){where}")
        relative = f"{r['step_seconds'] / ddp[r['world']]:.2f}×" if r["world"] in ddp else "n/a"
        lines.append(
            f"| {r['mode']} | {r['world']} | " + " | ".join(cells) + f" | {mib(r['peak_rss'])} | {relative} |"
        )
    return "\n".join(lines + [""] + [f"- {note}" for note in NOTES])


NOTES = (
    "measured: the largest rank's bytes; parameters and optimizer state after the step, gradients after the "
    "last backward (reduced, before the step); the formula is rapidtrain.plan.memory_estimate (ZeRO paper "
    "accounting: torch keeps fp32 weights and gradients under autocast, DeepSpeed 16-bit ones plus fp32 master "
    "weights in the optimizer state).",
    "sdp: FSDP2 with reshard_after_forward=False holds whole parameters only from forward to the end of "
    "backward; at rest they are sharded, hence a ratio of 1/N against the formula's whole copy.",
    "zero-1: after the accumulation boundary DeepSpeed keeps only the reduced gradient partition; the whole "
    "16-bit gradients the formula counts exist during backward.",
    "zero-3: biases and norms (below DeepSpeed's 1e5-element persistence threshold) stay whole on every rank.",
    "zero-2+offload: the fp32 gradient partition, master weights and Adam moments live in CPU memory.",
)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for world in args.world_sizes:
        for mode in args.modes:
            rows.append(measure(mode, world, args.precision, args.steps))
            print(f"measured {mode} on {world} ranks", file=sys.stderr, flush=True)
    print(format_table(rows, args.precision))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
    else:
        main()
