"""Where one rapidtrain training step's time goes, on the pretraining bench's shape (bench/pretrain_throughput.py).

Runs the built-in GPT through the product's own loop (the same flags as the bench's rapidtrain row) and prints:
- the step split into forward, backward, clip + optimizer (the runner's `step`: norm, clipping, the optimizer and
  the bf16 copies' refresh) and the rest (loss reduction, agreement, schedule, data), wall and CPU time, median
  over the steady steps;
- the top operators by self CPU time over a window of steady steps (torch.profiler).

    OMP_NUM_THREADS=1 python bench/step_profile.py [--precision bf16] [--iters 12] [--warmup 3] [--top 15]
        [--layers 6 --hidden 384 --heads 6 --seq 256 --batch 4] [--no-profiler] [-- EXTRA FLAGS]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("forward", "backward", "clip+optimizer", "rest", "step")


class PhaseClock:
    """Wall and CPU seconds of each phase of each step, accumulated by wrapping the runner's methods."""

    def __init__(self) -> None:
        self.steps: list[dict[str, tuple[float, float]]] = []
        self.current: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def add(self, phase: str, wall: float, cpu: float) -> None:
        self.current[phase][0] += wall
        self.current[phase][1] += cpu

    def end_step(self, wall: float, cpu: float) -> None:
        phases = {name: (w, c) for name, (w, c) in self.current.items()}
        phases["forward"] = (phases["forward_backward"][0] - phases["backward"][0],
                             phases["forward_backward"][1] - phases["backward"][1])
        measured = ("forward", "backward", "clip+optimizer")
        phases["rest"] = (wall - sum(phases[p][0] for p in measured), cpu - sum(phases[p][1] for p in measured))
        phases["step"] = (wall, cpu)
        self.steps.append(phases)
        self.current = defaultdict(lambda: [0.0, 0.0])


def timed(clock: PhaseClock, phase: str, method: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        result = method(*args, **kwargs)
        clock.add(phase, time.perf_counter() - wall, time.process_time() - cpu)
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3, help="steady steps traced by torch.profiler")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--no-profiler", action="store_true", help="phase times only")
    parser.add_argument("extra", nargs="*", help="more rapidtrain flags (after --)")
    o = parser.parse_args()

    from rapidtrain.pretrain import MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    clock = PhaseClock()
    profiled_from = o.iters - o.profile_steps if not o.no_profiler else o.iters + 1
    profiler: list[Any] = []

    class Profiled(MegatronPreTrainer):
        def train_step(self, micro_batches: list[Any], stop_requested: bool = False) -> Any:
            runner = self.engine.runner
            if not hasattr(runner, "_phases_wrapped"):
                runner._phases_wrapped = True
                runner.forward_backward = timed(clock, "forward_backward", runner.forward_backward)
                runner.backward = timed(clock, "backward", runner.backward)
                runner.step = timed(clock, "clip+optimizer", runner.step)
            if self.iteration == profiled_from:
                profiler.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]))
                profiler[0].__enter__()
            wall, cpu = time.perf_counter(), time.process_time()
            result = super().train_step(micro_batches, stop_requested=stop_requested)
            clock.end_step(time.perf_counter() - wall, time.process_time() - cpu)
            if profiler and self.iteration == o.iters - 1:  # the demo's closing generation is not traced
                profiler[0].__exit__(None, None, None)
            return result

    argv = ["--num-layers", str(o.layers), "--hidden-size", str(o.hidden), "--num-attention-heads", str(o.heads),
            "--seq-length", str(o.seq), "--micro-batch-size", str(o.batch), "--train-iters", str(o.iters),
            "--lr", "3e-4", "--lr-decay-style", "constant", "--num-workers", "0", "--log-interval", str(10**6),
            "--eval-interval", str(10**6), "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--clip-grad", "1.0", *(["--bf16"] if o.precision == "bf16" else []), *o.extra]
    Profiled(Engine(argv=argv)).train()

    steady = clock.steps[o.warmup:profiled_from] if profiled_from <= o.iters else clock.steps[o.warmup:]
    step_wall = statistics.median(s["step"][0] for s in steady)
    print(f"\n{o.precision}, {torch.get_num_threads()} threads, {o.layers} layers x {o.hidden}, seq {o.seq}, batch "
          f"{o.batch}: median of {len(steady)} steady steps (unprofiled)")
    print(f"{'phase':<16} {'wall ms':>9} {'share':>7} {'CPU ms':>9}")
    for phase in PHASES:
        wall = statistics.median(s[phase][0] for s in steady)
        cpu = statistics.median(s[phase][1] for s in steady)
        print(f"{phase:<16} {wall * 1000:9.1f} {wall / step_wall:7.1%} {cpu * 1000:9.1f}")
    if profiler:
        events = profiler[0].key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\ntop operators by self CPU over {o.profile_steps} profiled steps (per step)")
        print(f"{'operator':<44} {'self CPU ms':>11} {'share':>7} {'calls':>7}")
        for event in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:o.top]:
            print(f"{event.key[:44]:<44} {event.self_cpu_time_total / 1000 / o.profile_steps:11.2f} "
                  f"{event.self_cpu_time_total / total:7.1%} {event.count // o.profile_steps:7d}")
        print(f"{'all operators':<44} {total / 1000 / o.profile_steps:11.2f}")


if __name__ == "__main__":
    main()
