"""How a rank starts its DataLoader workers: never by forking itself once its process group's threads run.

CPython up to 3.11.9 (gh-112275; fixed in 3.11.10 and 3.12; this project's interpreter has it) resets the lock of
its thread-state list in a forked child only after taking it: a child forked while another thread held that lock
waits on it forever, before running a line of Python. A rank's gloo threads take it each time they release a tensor
that Python also holds (they create a thread state to drop the Python reference), so a DataLoader worker forked
from a rank now and then never starts and the rank waits on it for ever (a 2-rank run hung before iteration 1; gdb
on the worker: PyOS_AfterFork_Child → _PyEval_ReInitThreads → _PyThreadState_DeleteExcept, in a lock wait).

So once a process group exists, workers are forked from multiprocessing's forkserver instead: a process started
fresh (torch preloaded), with no thread but its own, which forks each worker on request. Its workers get the
dataset and collate function pickled; a read-only memory map (the index cache, the .bin files) travels as its
path and is mapped again in the worker, not copied. Where something cannot travel that way (a class defined in
a user's script, a lambda), or where no process group runs (one process: no threads), workers are forked from
the rank as before.
"""

from __future__ import annotations

import io
import mmap
import multiprocessing
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import BaseContext
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

# Imported by the forkserver before it forks any worker: the module that ties the server's life to its rank's and
# makes it ignore SIGTERM (first, at once), and torch (each worker would import it otherwise).
# The interpreters with the after-fork deadlock: 3.12 resets the lock first, 3.11.10 got the fix (gh-112275).
FORK_DEADLOCKS = sys.version_info < (3, 11, 10)
RANK_PID_ENV = "RAPIDTRAIN_RANK_PID"  # read by forkserver_preload
PRELOAD = ["rapidtrain.data.forkserver_preload", "torch"]


def worker_context(dataset: Any, collate_fn: Any, num_workers: int) -> BaseContext | None:
    """The multiprocessing context a DataLoader's workers start from: the forkserver when this rank's process
    group runs (its threads make a fork unsafe) and the workers' inputs can be sent there; None (fork) else."""
    if num_workers == 0 or not FORK_DEADLOCKS or not dist.is_available() or not dist.is_initialized():
        return None
    if sys.platform != "linux":
        return None
    reason = _unsendable((dataset, collate_fn))
    if reason is not None:
        _note_fork(reason)
        return None
    context = multiprocessing.get_context("forkserver")
    os.environ[RANK_PID_ENV] = str(os.getpid())  # the server's parent, for its parent-death check (inherited)
    # Read when the server starts (the first worker), ignored after: the dataset's module too, imported once there
    # rather than in every worker.
    context.set_forkserver_preload([*PRELOAD, type(dataset).__module__])
    return context


_told: list[str] = []


def _note_fork(reason: str) -> None:
    """Once per process, on rank 0: the workers are forked from the rank after all, and why."""
    if not _told and dist.get_rank() == 0:
        print(f"rapidtrain: note: DataLoader workers are forked from the rank: its dataset or collate function "
              f"cannot be sent to a forkserver ({reason}); on this interpreter (CPython before 3.11.10) such a fork "
              "now and then deadlocks the worker. Define them at the top level of an importable module to avoid it.",
              file=sys.stderr, flush=True)
    _told.append(reason)


class _MainReference(Exception):
    pass


class _CheckingPickler(ForkingPickler):
    """ForkingPickler that stops at the first reference to `__main__`: a worker started by the forkserver would
    have to run the user's script again to find it (and would run its training, unguarded)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and getattr(obj, "__module__", None) == "__main__":
            raise _MainReference
        return NotImplemented


def sends_to_forkserver(payload: Any) -> bool:
    """Whether `payload` pickles as the forkserver's workers receive it, referring to nothing in `__main__`."""
    return _unsendable(payload) is None


def _unsendable(payload: Any) -> str | None:
    """Why `payload` cannot be sent to the forkserver's workers; None when it can."""
    try:
        _CheckingPickler(io.BytesIO()).dump(payload)
    except _MainReference:
        return "it refers to a class or function of the script being run (__main__)"
    except Exception as error:  # noqa: BLE001 - whatever stops pickling (a lambda, an open file) means fork
        return f"it does not pickle ({type(error).__name__}: {error})"
    return None


def _mapped_again(path: str, dtype: str, shape: tuple[int, ...], offset: int) -> np.ndarray:
    return np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=shape, offset=offset)


def _reduce_memmap(array: np.memmap) -> tuple[Any, tuple]:
    """A whole read-only file map goes by path (mapped again on arrival); anything else is copied as an array."""
    if isinstance(array.base, mmap.mmap) and array.mode == "r" and array.filename and array.flags.c_contiguous:
        return _mapped_again, (array.filename, array.dtype.str, array.shape, array.offset)
    return np.array, (np.asarray(array),)


ForkingPickler.register(np.memmap, _reduce_memmap)


@contextmanager
def _no_main_for_workers() -> Iterator[None]:
    """While workers start: multiprocessing would have each forkserver worker import the rank's `__main__` (a
    user's script, run again); nothing the worker receives refers to it (`sends_to_forkserver`)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class WorkerLoader(DataLoader):
    """A DataLoader whose workers, when they come from the forkserver, start without the rank's `__main__`."""

    def _get_iterator(self) -> Any:
        context = self.multiprocessing_context
        if self.num_workers == 0 or context is None or context.get_start_method() == "fork":
            return super()._get_iterator()
        with _no_main_for_workers():
            return super()._get_iterator()
