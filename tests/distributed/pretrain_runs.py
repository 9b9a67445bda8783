"""Run several `rapidtrain/pretrain.py` trainings one after another inside one torchrun launch.

Usage: `torchrun --nproc-per-node N tests/distributed/pretrain_runs.py RUNS.json`, where RUNS.json is a
list of argument lists. Each run is `rapidtrain.pretrain.main`'s code path (Engine → MegatronPreTrainer →
train) on the launch's one process group, so a test pays for process start-up, DeepSpeed's import and
the rendezvous once instead of once per run. The group is destroyed once, at the end.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rapidtrain.core.process import exit_after  # noqa: E402
from rapidtrain.pretrain import ENTRY, MegatronPreTrainer  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402


def run_all(runs: list[list[str]]) -> None:
    import __main__

    # pretrain.py's code path, so the plan is the built-in pretraining's (not a user script's): sharded layouts
    # build the model on the meta device, as `torchrun rapidtrain/pretrain.py` does.
    __main__.__file__ = str(Path(__file__).resolve().parents[2] / "rapidtrain" / "pretrain.py")
    engine = None
    for argv in runs:
        engine = Engine(argv=argv, entry=ENTRY)  # reuses the process group the first run started
        MegatronPreTrainer(engine).train()
        gc.collect()  # the previous run's model, engine and optimizer state
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    exit_after(lambda: run_all(json.loads(Path(sys.argv[1]).read_text())))  # rapidtrain/core/process.py
