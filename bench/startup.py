"""Start-up: how long a tiny pretraining run takes to reach its first iteration, and where that time goes.

Each run is a fresh process (so imports are paid as a user pays them); the parent notes the time just before
starting it, and the child reports each part:
  interpreter      the Python process starting, up to the first line of this script
  imports          rapidtrain's training entry (torch included)
  plan + group     Engine(): flags, rules, plan, the process group and the mesh
  data index       the demo corpus's GPT datasets (index built or read from its cache)
  model build      the model, optimizer and schedule built and composed (parallelize, wrap)
  first step       the first train_step (autograd's and the allocator's first use)
Also `rapidtrain plan FLAGS` (the plan alone), the same way.

    python bench/startup.py [--repeats 3] [-- extra rapidtrain flags, e.g. --bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
        "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1000"]
PARTS = ("interpreter", "imports", "plan + group", "data index", "model build", "first step")


def child(flags: list[str]) -> dict[str, float]:
    """The child's whole job: run to the first iteration, timing each part."""
    started = float(os.environ["STARTUP_BENCH_T0"])
    stamps = {"interpreter": time.time() - started}
    t = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    from rapidtrain.pretrain import MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    stamps["imports"] = time.perf_counter() - t
    t = time.perf_counter()
    engine = Engine(argv=TINY + flags)
    stamps["plan + group"] = time.perf_counter() - t

    class Timed(MegatronPreTrainer):
        def train_valid_test_datasets_provider(self, counts):
            t = time.perf_counter()
            datasets = super().train_valid_test_datasets_provider(counts)
            stamps["data index"] = time.perf_counter() - t
            return datasets

        def setup(self):
            t = time.perf_counter()
            super().setup()
            stamps["model build"] = time.perf_counter() - t - stamps["data index"]

        def train_step(self, micro_batches, stop_requested=False):
            t = time.perf_counter()
            result = super().train_step(micro_batches, stop_requested=stop_requested)
            stamps["first step"] = time.perf_counter() - t
            return result

    Timed(engine).train()
    return stamps


def timed_child(args: list[str]) -> tuple[float, str]:
    started = time.time()
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "STARTUP_BENCH_T0": repr(started), "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return time.time() - started, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest counts")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs="*", help="extra rapidtrain flags for the tiny run (after --)")
    o = parser.parse_args()
    if o.child:
        print(json.dumps(child(o.flags)))
        return
    plans, runs = [], []
    for _ in range(o.repeats):
        plans.append(timed_child(["-m", "rapidtrain.cli", "plan", *TINY, *o.flags])[0])
        total, out = timed_child([__file__, "--child", "--", *o.flags])
        runs.append((total, json.loads(out.strip().splitlines()[-1])))
    total, parts = min(runs, key=lambda run: run[0])
    print(f"tiny pretraining run ({' '.join(o.flags) or 'fp32'}), best of {o.repeats}; "
          f"CPU {os.cpu_count()} cores, {sys.platform}")
    print(f"  rapidtrain plan: {min(plans):6.2f} s")
    for part in PARTS:
        print(f"  {part:<15}  {parts[part]:6.2f} s")
    print(f"  {'first iteration':<15}  {sum(parts[p] for p in PARTS):6.2f} s  (process end: {total:.2f} s)")


if __name__ == "__main__":
    main()
