"""Rank 1 hangs (sleeps) while rank 0 waits for it in rapidtrain's start-up collective under a 3-second timeout: rank 0
must tell a collective timeout, naming the collective and where rapidtrain called it, not a lost contact or a bug.

Usage: `torchrun --nproc-per-node 2 tests/distributed/timed_out_collective.py`.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from rapidtrain.config.arguments import parse_args  # noqa: E402
from rapidtrain.config.plan import from_args  # noqa: E402
from rapidtrain.config.settings import RunContext  # noqa: E402
from rapidtrain.core.stopped_run import rank_failed  # noqa: E402
from rapidtrain.train.agreement import agree_on_configuration  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(12)  # hung: alive, connected, never joining
        os._exit(0)
    plan = from_args(parse_args(["--train-iters", "1", "--lr", "1e-3", "--num-layers", "1", "--hidden-size", "32",
                                 "--num-attention-heads", "2", "--seq-length", "16"]), RunContext(world_size=2))
    try:
        agree_on_configuration(plan)
    except Exception as error:  # noqa: BLE001 - what an entry point's wrapper does with it
        os._exit(rank_failed(error))
    os._exit(0)
