"""Memory per rank: model state under every partitioning mode, start-up, and a ZeRO checkpoint save.

Three sections, each launching torchrun with this file as the worker:

- state (default): the built-in GPT (a few million parameters) trains a few steps through `Engine.compose`,
  and each rank adds up the tensors it actually holds: parameters (local shards of FSDP's DTensors,
  DeepSpeed's 16-bit weights or ZeRO-3 partitions), gradients after the last backward (before the step),
  optimizer state after the step (ZeroRedundancyOptimizer's local state, DeepSpeed's fp32 master partitions
  and Adam moments). The formula is `rapidtrain.config.memory.memory_estimate` (one place); ratio = measured /
  formula. Peak RSS is the rank's peak process memory; step time is relative to DDP at the same world size.
- startup: a ~100M-parameter GPT composed under FSDP, ZeRO-3, TP 2 and PP 2, built as the plan says (on the
  meta device: each rank materializes its shards) and, for comparison, whole on every rank first (the way
  rapidtrain built it before). Each rank samples its resident memory every millisecond from just before the
  model is built until the runner is ready; the peak increase is set against the whole model's fp32 bytes
  and the goal: 1/N of them plus 10%.
- save: ZeRO-2 and ZeRO-3 after one step (Adam state exists), the peak increase of resident memory while the
  checkpoint state is taken and written by torch.distributed.checkpoint, against the rank's shard of the model
  state (fp32 weights + two Adam moments, 12 bytes per parameter / N) plus the largest parameter; and, as the
  baseline, the same save with every value gathered whole on every rank (what rapidtrain did before).

    python bench/memory.py                      # state: all modes at 2 and 4 ranks, --bf16 (DeepSpeed's bf16)
    python bench/memory.py --modes ddp fsdp --world-sizes 2 --precision fp32
    python bench/memory.py --section startup --world-sizes 2 4
    python bench/memory.py --section save --world-sizes 2
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
    parser.add_argument("--section", choices=("state", "startup", "save"), default="state")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is not timed")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--one-launch", action="store_true",
                        help="state: every mode of a world size in one torchrun launch, one after another (start-up "
                             "paid once, for a smoke test); peak RSS is then the launch's peak so far, not the mode's")
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


def run_worker(modes: list[str], precision: str, steps: int, out: Path) -> None:
    """Each mode in turn on this launch's one process group (a mode's Engine reuses it), then the group ends."""
    import gc

    import torch.distributed as dist

    for mode in modes:
        run_mode(mode, precision, steps, out)
        gc.collect()  # the previous mode's model, engine and optimizer state
    dist.barrier()
    dist.destroy_process_group()


def run_mode(mode: str, precision: str, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from rapidtrain.models import build_model
    from rapidtrain.train.engine import Engine

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
    engine = Engine(argv=flags + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)])
    plan = engine.plan
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
    (out / f"{mode}_rank_{dist.get_rank()}.json").write_text(json.dumps(report))


# ---- start-up and save: resident memory sampled while the model is built or the checkpoint written ----

# ~107 M parameters: 8 layers of hidden 1024 and an 8,192-token vocabulary (the largest tensor, the embedding,
# is 8% of the model), fp32.
BIG_MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "128",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "8191"]
STARTUP_MODES = {
    "fsdp": ["--fsdp-memory-optimization"],
    "zero-3": ["--zero-3-memory-optimization"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}
SAVE_MODES = {"zero-2": ["--zero-2-memory-optimization"], "zero-3": ["--zero-3-memory-optimization"]}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Peak resident memory above the level at `start`, sampled every millisecond by a thread (torch's ops
    release the GIL, so the sampler runs while they allocate)."""

    def __enter__(self) -> PeakSampler:
        import ctypes
        import threading

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap pages back to the system: the base is what is live
        self.base = self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def increase(self) -> int:
        return self.peak - self.base


def big_engine(flags: list[str]):
    import __main__
    from rapidtrain.train.engine import Engine

    # pretrain.py's plan (the built-in pretraining), not a user script's: it decides where the model is built.
    __main__.__file__ = str(REPO / "rapidtrain" / "pretrain.py")
    # glibc's default malloc (memory freed is returned, so resident memory follows what is live), not the
    # CPU-allocator tuning that keeps freed blocks for the next step.
    common = ["--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-4", "--num-workers", "0",
              "--no-cpu-allocator-tuning"]
    return Engine(argv=BIG_MODEL + common + flags, entry="pretrain")


def run_startup_worker(mode: str, build: str, out: Path) -> None:
    """Compose the big model as the plan says (`build` "plan") or whole on every rank first ("whole")."""
    import gc

    import torch.distributed as dist

    from rapidtrain.models import build_model
    from rapidtrain.models.counting import count_parameters
    from rapidtrain.parallel.meta_init import build_model_for

    engine = big_engine(STARTUP_MODES[mode])
    plan = engine.plan
    import_what_compose_imports()
    gc.collect()
    dist.barrier()
    with PeakSampler() as sampler:
        model = build_model_for(plan) if build == "plan" else build_model(plan.model, seed=plan.training.seed)
        engine.compose(model, model_factory=lambda: build_model(plan.model, seed=None))
    report = {"increase": sampler.increase, "on_meta": plan.switches.build_on_meta and build == "plan",
              "model_bytes": 4 * count_parameters(plan.model)[0], "largest": 4 * largest_parameter(plan.model)}
    (out / f"rank_{dist.get_rank()}.json").write_text(json.dumps(report))
    engine.shutdown()


def import_what_compose_imports() -> None:
    """Import before measuring what composing imports on first use (their code is not the model's memory)."""
    import importlib

    for name in ("deepspeed", "torch.distributed.fsdp", "torch.distributed._composable.replicate_with_fsdp",
                 "torch.distributed.pipelining", "torch.distributed.tensor.parallel",
                 "torch.distributed.checkpoint.state_dict", "rapidtrain.parallel.apply",
                 "rapidtrain.parallel.pipeline", "rapidtrain.parallel.tensor_parallel", "rapidtrain.parallel.deepspeed",
                 "rapidtrain.optim.optimizers", "rapidtrain.models.hf_weights"):
        importlib.import_module(name)


def largest_parameter(config) -> int:
    import torch

    from rapidtrain.models import build_model

    with torch.device("meta"):
        return max(p.numel() for p in build_model(config, seed=None).parameters())


def gather_everything(zero_state) -> dict:
    """The previous way to save ZeRO state: every value gathered whole on every rank (the baseline)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero_state.ensure_optimizer_state()
    optimizer = {zero_state.names[id(p)]: {key: safe_get_full_optimizer_state(p, key).float().cpu()
                                          for key in zero_state.optimizer_keys()}
                 for params in zero_state.groups for p in params}
    return {"model": zero_state.model_state(sharded=False), "optimizer": {"state": optimizer}}


def run_save_worker(mode: str, how: str, out: Path) -> None:
    """One step of the big model under ZeRO, then the checkpoint state taken and written (`how`: "sharded",
    rapidtrain's; "gathered", the baseline), resident memory sampled throughout."""
    import gc

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rapidtrain.models import build_model
    from rapidtrain.models.counting import count_parameters
    from rapidtrain.parallel.meta_init import build_model_for

    engine = big_engine(SAVE_MODES[mode])
    plan = engine.plan
    module, *_ = engine.compose(build_model_for(plan), model_factory=lambda: build_model(plan.model, seed=None))
    tokens = torch.randint(0, 8191, (1, 128))
    with engine.runner.micro_batch(is_last=True):
        loss = module(tokens, labels=tokens).float().mean()
    engine.backward(loss)
    engine.step()
    gc.collect()
    dist.barrier()
    with tempfile.TemporaryDirectory() as folder, PeakSampler() as sampler:
        state = engine.runner.state_dict() if how == "sharded" else gather_everything(engine.runner.checkpoint_state)
        dcp.save(state, checkpoint_id=folder)
        del state
    parameters = count_parameters(plan.model)[0]
    report = {"increase": sampler.increase, "shard": 12 * parameters / dist.get_world_size(),
              "largest": 4 * largest_parameter(plan.model), "model_state": 12 * parameters}
    (out / f"rank_{dist.get_rank()}.json").write_text(json.dumps(report))
    engine.shutdown()


def launch(world: int, worker_args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                   f"--master-port={free_port()}", __file__, *worker_args, folder]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if result.returncode != 0:
            raise RuntimeError(f"{worker_args} on {world} ranks failed:\n{result.stdout[-2000:]}\n"
                               f"{result.stderr[-4000:]}")
        return [json.loads((Path(folder) / f"rank_{r}.json").read_text()) for r in range(world)]


def startup_table(world_sizes: list[int]) -> str:
    lines = ["start-up: peak resident-memory increase per rank (the largest rank's) while the model is built and "
             "composed, MiB; goal: 1/N of the whole model's fp32 bytes + 10%",
             "| mode | ranks | whole model | as planned | built whole first | goal | planned ≤ goal |",
             "|---|---|---|---|---|---|---|"]
    for world in world_sizes:
        for mode in STARTUP_MODES:
            shards = 2 if mode in ("tp2", "pp2") else world
            planned = launch(world, ["--startup-worker", mode, "plan"])
            whole = launch(world, ["--startup-worker", mode, "whole"])
            model = planned[0]["model_bytes"]
            goal = model / shards + 0.1 * model
            peak_planned = max(r["increase"] for r in planned)
            peak_whole = max(r["increase"] for r in whole)
            where = "meta" if planned[0]["on_meta"] else "whole"
            lines.append(f"| {mode} | {world} | {mib(model)} | {mib(peak_planned)} ({where}) | {mib(peak_whole)} | "
                         f"{mib(goal)} | {'yes' if peak_planned <= goal else 'no'} |")
            print(f"measured start-up of {mode} on {world} ranks", file=sys.stderr, flush=True)
    return "\n".join(lines + ["", "- N for tp2 and pp2 is 2 (the ranks sharing one replica's parameters); the "
                               "pipeline's first and last stages both hold the tied word embedding."])


def save_table(world_sizes: list[int]) -> str:
    lines = ["save: peak resident-memory increase per rank (the largest rank's) while the ZeRO checkpoint state is "
             "taken and written, MiB; goal: the rank's shard of the model state (12 B/parameter / N) + the largest "
             "parameter",
             "| mode | ranks | model state | sharded (rapidtrain) | gathered whole (baseline) | goal | met |",
             "|---|---|---|---|---|---|---|"]
    for world in world_sizes:
        for mode in SAVE_MODES:
            sharded = launch(world, ["--save-worker", mode, "sharded"])
            gathered = launch(world, ["--save-worker", mode, "gathered"])
            goal = sharded[0]["shard"] + sharded[0]["largest"]
            peak = max(r["increase"] for r in sharded)
            lines.append(f"| {mode} | {world} | {mib(sharded[0]['model_state'])} | {mib(peak)} | "
                         f"{mib(max(r['increase'] for r in gathered))} | {mib(goal)} | "
                         f"{'yes' if peak <= goal else 'no'} |")
            print(f"measured the save of {mode} on {world} ranks", file=sys.stderr, flush=True)
    return "\n".join(lines)


# ---- the driver ----


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(modes: list[str], world: int, precision: str, steps: int) -> list[dict]:
    """One torchrun launch for `modes`, one after another; per mode the largest rank's numbers (ranks differ only by
    uneven shards)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            f"--master-port={free_port()}",
            __file__,
            "--worker",
            ",".join(modes),
            precision,
            str(steps),
            folder,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if result.returncode != 0:
            raise RuntimeError(
                f"{', '.join(modes)} on {world} ranks failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
            )
        return [mode_row(mode, world, [json.loads((Path(folder) / f"{mode}_rank_{r}.json").read_text())
                                       for r in range(world)]) for mode in modes]


def mode_row(mode: str, world: int, reports: list[dict]) -> dict:
    """A mode's row from its ranks' reports."""
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
    "last backward (reduced, before the step); the formula is rapidtrain.config.memory.memory_estimate (ZeRO paper "
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
    if args.section == "startup":
        print(startup_table(args.world_sizes))
        return
    if args.section == "save":
        print(save_table(args.world_sizes))
        return
    rows = []
    for world in args.world_sizes:
        for modes in [args.modes] if args.one_launch else [[mode] for mode in args.modes]:
            rows += measure(modes, world, args.precision, args.steps)
            print(f"measured {', '.join(modes)} on {world} ranks", file=sys.stderr, flush=True)
    print(format_table(rows, args.precision))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2].split(","), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--startup-worker":
        run_startup_worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--save-worker":
        run_save_worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    else:
        main()
