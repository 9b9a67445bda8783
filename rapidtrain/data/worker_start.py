"""How a rank starts its DataLoader workers: never by forking itself once its process group's threads run.

CPython up to 3.11.9 (gh-112275; fixed in 3.11.10 and 3.12; this project's interpreter has it) resets the lock of
its thread-state list in a forked child only after taking it: a child forked while another thread held that lock
waits on it forever, before running a line of Python. A rank's gloo threads take it each time they release a tensor
that Python also holds (they create a thread state to drop the Python reference), so a DataLoader worker forked
from a rank now and then never starts and the rank waits on it for ever (a 2-rank run hung before iteration 1; gdb
on the worker: PyOS_AfterFork_Child → _PyEval_ReInitThreads → _PyThreadState_DeleteExcept, in a lock wait).

So once a process group exists, workers are forked from multiprocessing's forkserver instead: a process with no
thread but its own, which forks each worker on request. The Engine forks that server from the rank itself just
before the process group starts (`start_worker_server`: no gloo thread yet, so the fork is safe), so the server
already holds torch and rapidtrain and costs a fork, not a second interpreter importing torch (1–2 s of CPU per rank
on a 2-core test machine); where it did not (no Engine, other threads running), multiprocessing starts its own
server, torch preloaded. Its workers get the dataset and collate function pickled; a read-only memory map (the index
cache, the .bin files) travels as its path and is mapped again in the worker, not copied. Where something cannot
travel that way (a class defined in a user's script, a lambda), or where no process group runs (one process: no
threads), workers are forked from the rank as before.
"""

from __future__ import annotations

import io
import mmap
import multiprocessing
import os
import signal
import socket
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import BaseContext
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

from rapidtrain.core.process import flush_standard_streams
from rapidtrain.core.shutdown import stop_with_parent

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


def start_worker_server() -> bool:
    """Fork the forkserver that will start this rank's DataLoader workers from the rank itself, now: before its
    process group exists and while no other thread runs (both make the fork safe). True when started here; False
    where it is not needed (an interpreter that forks safely, not Linux) or not safe (other threads), or already
    running. The server ignores SIGTERM and dies with the rank (data/forkserver_preload.py's rules, applied here)."""
    from multiprocessing import connection, forkserver, resource_tracker, util

    server: Any = forkserver._forkserver  # the module's server, which multiprocessing's "forkserver" context uses
    if not FORK_DEADLOCKS or sys.platform != "linux" or server._forkserver_pid is not None:
        return False
    if threading.active_count() > 1 or (dist.is_available() and dist.is_initialized()):
        return False
    resource_tracker.ensure_running()  # its descriptor goes to every worker, as with multiprocessing's own server
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the rank keeps the write end: end of file tells the server to stop
    rank = os.getpid()
    flush_standard_streams()
    pid = os.fork()
    if pid == 0:  # the server: it serves until the rank closes its pipe, and never returns into the rank's code
        try:
            os.close(alive_w)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stop_with_parent(rank, signal.SIGKILL)
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


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
