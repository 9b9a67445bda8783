"""`python tests/compat/run_launch_scripts.py RUNS.json`: many launch scripts' runs in this one process, one after
another, each in a fresh single-rank process group, as if each were `torchrun --nproc-per-node 1 ENTRY FLAGS` (or
`python SCRIPT FLAGS` for a user script of its own).

Under torchrun with more than one rank (`torchrun --nproc-per-node N run_launch_scripts.py RUNS.json`) every rank
runs each run in turn, as its entry point's `main` runs under torchrun (a process group of its own on the launch's
rendezvous), and a run that fails ends the launch.

RUNS.json holds [{"id": ..., "entry": ENTRY, "argv": [...]}, ...], ENTRY one of "pretrain", "pretrain_gpt",
"pretrain_bert", "tasks_main", "finetune" (rapidtrain's programs of those names), "rapidtrain" (what the command's
ranks run: `python -m rapidtrain.cli FLAGS` under torchrun, so a --user-script runs in place) or a user script's
path (a .py file, run as `python PATH.py FLAGS` runs it: as `__main__`, its flags in sys.argv; one process only).
Each run's output sits between `@@ start ID` and `@@ end ID status=N seconds=S cpu=C` (this process's CPU
seconds); status 0 is a finished run, 2 a user error, 1 an exception (its traceback printed before the end marker).
"""

from __future__ import annotations

import gc
import json
import os
import re
import runpy
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a file: the repository importable
    sys.path[0] = str(REPO)


def results(output: str) -> dict[str, tuple[int, str]]:
    """Each run's exit status and its output, from the markers in a runner's stdout."""
    found = re.finditer(r"^@@ start (\S+)\n(.*?)^@@ end \1 status=(-?\d+)", output, flags=re.S | re.M)
    return {match.group(1): (int(match.group(3)), match.group(2)) for match in found}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _program_of(entry: str) -> str:
    """The file `torchrun` or `python` is given for this entry: what the run sees as its `__main__`."""
    if entry == "rapidtrain":
        return str(REPO / "rapidtrain" / "cli.py")  # the command's ranks run `python -m rapidtrain.cli FLAGS`
    return entry if entry.endswith(".py") else str(REPO / "rapidtrain" / f"{entry}.py")


def _main_of(entry: str) -> Callable[[list[str]], object]:
    if entry.endswith(".py"):
        return lambda argv: _run_user_script(entry, argv)
    if entry == "tasks_main":
        from rapidtrain.tasks_main import main

        return main
    if entry == "finetune":  # the black-box fine-tuning command's program (`rapidtrain --task ...`)
        from rapidtrain.finetune import main as finetune

        return finetune
    if entry == "rapidtrain":  # what the `rapidtrain` command's ranks run: a --user-script runs in place
        from rapidtrain.cli import main as command

        return lambda argv: _exit_unless_0(command(argv))
    from rapidtrain.pretrain import main

    return lambda argv: main(argv, entry=entry)


def _exit_unless_0(status: int) -> None:
    if status != 0:
        raise SystemExit(status)


def _run_user_script(script: str, argv: list[str]) -> None:
    """`python SCRIPT FLAGS` in this process: the script's folder first on sys.path, its flags in sys.argv, and the
    file run as `__main__` (its main block trains)."""
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.path.remove(str(Path(script).parent))


def run_one(entry: str, argv: list[str]) -> int:
    """One run as torchrun's single rank would start it: its own rendezvous port, so no group meets the last's."""
    import __main__

    # What `torchrun rapidtrain/ENTRY.py` (or `python SCRIPT`) shows the run: its entry file as __main__, not this
    # runner.
    __main__.__file__ = sys.argv[0] = _program_of(entry)
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


def _end_marker(run_id: str, status: int, started: float, cpu: float) -> str:
    return (f"@@ end {run_id} status={status} seconds={time.perf_counter() - started:.1f} "
            f"cpu={time.process_time() - cpu:.1f}")


def main(path: str) -> None:
    for run in json.loads(Path(path).read_text()):
        print(f"@@ start {run['id']}", flush=True)
        started, cpu = time.perf_counter(), time.process_time()
        status = run_one(run["entry"], run["argv"])
        print(_end_marker(run["id"], status, started, cpu), flush=True)


def main_on_ranks(path: str) -> None:
    """Every run on this launch's ranks, one after another, each as its entry's `main` runs under torchrun: its
    own process group on the launch's rendezvous, shut down at its end. Rank 0 prints the markers; every rank's
    lines of a run come before its end marker (the run's shutdown waits for every rank, stdout unbuffered)."""
    import __main__

    rank0 = os.environ.get("RANK") == "0"
    for run in json.loads(Path(path).read_text()):
        assert not run["entry"].endswith(".py"), run["entry"]  # the entry points' own runs only
        if rank0:
            print(f"@@ start {run['id']}", flush=True)
        started, cpu = time.perf_counter(), time.process_time()
        __main__.__file__ = sys.argv[0] = _program_of(run["entry"])  # the entry's plan (meta-device layouts)
        try:
            _main_of(run["entry"])(run["argv"])
        except SystemExit as stop:  # a run that ends by exiting 0 (--exit-interval) lets the next one start
            if stop.code not in (0, None):
                raise
        gc.collect()  # the run's model, engine and optimizer state
        sys.stdout.flush()
        if rank0:
            print(_end_marker(run["id"], 0, started, cpu), flush=True)


if __name__ == "__main__":
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        from rapidtrain.core.process import exit_after

        exit_after(lambda: main_on_ranks(sys.argv[1]))  # a rank ends as the entry points' do (core/process.py)
    else:
        main(sys.argv[1])
