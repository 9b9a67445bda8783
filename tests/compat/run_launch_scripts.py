"""`python tests/compat/run_launch_scripts.py RUNS.json`: many launch scripts' runs in this one process, one after
another, each in a fresh single-rank process group, as if each were `torchrun --nproc-per-node 1 ENTRY FLAGS`.

RUNS.json holds [{"id": ..., "entry": "pretrain_gpt" | "pretrain_bert" | "tasks_main", "argv": [...]}, ...]. Each
run's output sits between `@@ start ID` and `@@ end ID status=N seconds=S`; status 0 is a finished run, 2 a user
error, 1 an exception (its traceback printed before the end marker).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a file: the repository importable
    sys.path[0] = str(REPO)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _main_of(entry: str):
    if entry == "tasks_main":
        from rapidtrain.tasks_main import main

        return main
    from rapidtrain.pretrain import main

    return lambda argv: main(argv, entry=entry)


def run_one(entry: str, argv: list[str]) -> int:
    """One run as torchrun's single rank would start it: its own rendezvous port, so no group meets the last's."""
    import __main__

    # What `torchrun rapidtrain/ENTRY.py` shows the run: its entry file as __main__, not this runner (a user script).
    __main__.__file__ = sys.argv[0] = str(REPO / "rapidtrain" / f"{entry}.py")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    try:
        _main_of(entry)(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except Exception:  # noqa: BLE001 - the next run goes on; the test reads this one's traceback
        traceback.print_exc(file=sys.stdout)
        return 1
    finally:
        sys.stdout.flush()
        _leave_no_group()
    return 0


def _leave_no_group() -> None:
    """A run that failed before its shutdown leaves its group behind; a process of its own would have exited."""
    import torch.distributed as dist

    from rapidtrain.parallel.deepspeed import forget_process_groups

    if dist.is_initialized():
        dist.destroy_process_group()
        forget_process_groups()


def main(path: str) -> None:
    for run in json.loads(Path(path).read_text()):
        print(f"@@ start {run['id']}", flush=True)
        started = time.perf_counter()
        status = run_one(run["entry"], run["argv"])
        print(f"@@ end {run['id']} status={status} seconds={time.perf_counter() - started:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
