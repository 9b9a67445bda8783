"""Training time lost per checkpoint: a blocking save against --async-save, side by side in one run.

One process (a gloo group of one, so the collectives the loop makes run as they do in training) trains a
stack of linear layers with AdamW; a checkpoint (model + optimizer, a few hundred MB) is saved after step
--save-at. Time lost = the time in the save call, plus for a background save the steps slowed by the writing thread
(it shares the CPU: the overlapped steps' time beyond the run's median step), the polls (one host all-reduce
per step while the write is under way) and the publish (manifest, rename).

    python bench/async_save.py [--params-millions 40] [--steps 40] [--save-at 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from machine import cpu_name
from torch import nn


class Runner:
    """A model, AdamW and a training step, with rapidtrain's checkpoint protocol (state_dict)."""

    def __init__(self, params_millions: int, width: int = 1024, batch: int = 16) -> None:
        layers = max(1, params_millions * 10**6 // (width * width))
        self.module = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.inputs = torch.randn(batch, width)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.module(self.inputs).square().mean().backward()
        self.optimizer.step()

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optimizer}


def train(runner: Runner, steps: int, save_at: int, mode: str, folder: Path, group: object) -> dict:
    """`steps` steps with a save after step `save_at` (blocking or in the background): each step's seconds and
    the seconds spent in the save call, the polls and the publish."""
    from rapidtrain.checkpoint.checkpointer import (
        async_save_done,
        publish_async_save,
        save_checkpoint,
        start_async_save,
    )

    pending, published_at = None, None
    step_s, call_s, poll_s, publish_s = [], 0.0, 0.0, 0.0
    for step in range(1, steps + 1):
        t = time.perf_counter()
        runner.step()
        step_s.append(time.perf_counter() - t)
        if pending is not None:
            t = time.perf_counter()
            done = async_save_done(pending)
            poll_s += time.perf_counter() - t
            if done:
                t = time.perf_counter()
                publish_async_save(pending)
                publish_s, pending, published_at = time.perf_counter() - t, None, step
        if step == save_at:
            t = time.perf_counter()
            if mode == "blocking":
                save_checkpoint(folder, step, runner, None, 0, {})
                published_at = step
            else:
                pending = start_async_save(folder, step, runner, None, 0, {}, None, process_group=group)
            call_s = time.perf_counter() - t
    if pending is not None:  # the end of the run waits for it, as the loop does
        t = time.perf_counter()
        publish_async_save(pending)
        publish_s, published_at = time.perf_counter() - t, steps
    return {"steps": step_s, "call": call_s, "poll": poll_s, "publish": publish_s, "published_at": published_at}


def time_lost(run: dict, save_at: int) -> tuple[float, float]:
    """(seconds lost to the save, of which steps slowed while it was written): the save call, polls and publish,
    plus how much longer the steps that overlapped the background write took than the run's other steps (their
    median; a signed sum, so that other processes' noise on a shared machine averages out)."""
    overlapped = run["steps"][save_at:run["published_at"]]
    others = run["steps"][:save_at] + run["steps"][run["published_at"]:]
    slowed = sum(overlapped) - len(overlapped) * statistics.median(others) if overlapped else 0.0
    return run["call"] + run["poll"] + run["publish"] + slowed, slowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=int, default=40)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-at", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="Each measurement's best of this many.")
    options = parser.parse_args()
    from rapidtrain.checkpoint.checkpointer import background_save_group

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = background_save_group()
    runner = Runner(options.params_millions)
    for _ in range(3):
        runner.step()  # warm-up: allocator, optimizer state
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        for repeat in range(options.repeats):
            for mode in ("blocking", "async"):
                run = train(runner, options.steps, options.save_at, mode, Path(root) / f"{mode}{repeat}", group)
                if mode not in results or time_lost(run, options.save_at) < time_lost(results[mode], options.save_at):
                    results[mode] = run
        size = sum(p.stat().st_size for p in (Path(root) / "blocking0").rglob("*") if p.is_file())
    dist.destroy_process_group()

    typical = statistics.median(results["blocking"]["steps"])
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}")
    print(f"model {sum(p.numel() for p in runner.module.parameters()) / 1e6:.1f} M parameters; checkpoint "
          f"{size / 2**20:.0f} MiB (model + AdamW); median step {typical * 1000:.0f} ms; one save after step "
          f"{options.save_at} of {options.steps}; best of {options.repeats}")
    print(f"{'save':<9} {'lost (s)':>9} {'save call (s)':>14} {'steps slowed (s)':>17} {'polls (s)':>10} "
          f"{'publish (s)':>12} {'published after step':>21}")
    for mode in ("blocking", "async"):
        r = results[mode]
        lost, slowed = time_lost(r, options.save_at)
        print(f"{mode:<9} {lost:>9.2f} {r['call']:>14.2f} {slowed:>17.2f} {r['poll']:>10.4f} {r['publish']:>12.3f} "
              f"{r['published_at']:>21}")


if __name__ == "__main__":
    main()
