"""An entry point's process: how it starts (its imports without the cyclic garbage collector) and how it ends (its
status, without the interpreter's finalization, which races with native threads that are still running).

Starting. Importing torch and rapidtrain builds some 300,000 objects that live as long as the process; the cyclic
collector, triggered by every 700 new objects, walks that growing heap again and again for nothing (0.4 s of CPU
of a 2.7 s start on this project's CPU, in every rank, launcher and torchrun process). An entry point pauses it
before its imports (`pause_collection`); `exit_after` resumes it when main starts, first freezing what the
imports built out of every later collection (gc.freeze), which also shortens the collections during training.

Ending. A gloo process group's worker threads ("pt_gloo_runloop") outlive `destroy_process_group` whenever Python
still holds the group (DistributedDataParallel, an optimizer, a device mesh do): destroying it only unregisters
it. Such a thread drops each finished collective after the rank has seen it complete, and dropping one whose
tensor Python let go of takes the GIL. If the interpreter has begun finalizing by then, CPython ends that
thread with `pthread_exit`, whose unwinding reaches a C++ destructor and calls `std::terminate`: the rank dies
of SIGABRT ("terminate called without an active exception") after a run that finished. Arrow's thread pools
(Hugging Face `datasets`) fail the same way at exit. A process that never finalizes cannot hit it.

What is kept of a normal exit: non-daemon threads are waited for (with the callbacks that tell executors'
workers to stop), atexit handlers run (logging, multiprocessing's children, trackers), and every open file
is flushed (the standard streams, and files a user's script left open, which finalization would have
flushed). Only the finalization itself is skipped: freeing the modules' objects, which the OS does faster.
A rank that `torchrun --run-path` runs as a function returns to torchrun instead (`return_to_launcher`).
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from rapidtrain.core.launch_env import launched_rank

_paused: list[bool] = []  # whether pause_collection stopped the collector (and it was running)


def pause_collection(entry: bool) -> None:
    """At the top of an entry point's file, before its imports: `entry` is `__name__ == "__main__"` (imported as a
    module, as tests and pretrain_gpt.py import pretrain.py, nothing changes)."""
    if entry and not _paused:
        _paused.append(gc.isenabled())
        gc.disable()


def resume_collection() -> None:
    """The imports are done: freeze what they built out of later collections, and collect again."""
    if _paused:
        gc.freeze()
        if _paused.pop():
            gc.enable()


def exit_after(main: Callable[[], object], returns_status: bool = False) -> NoReturn:
    """Run an entry point's `main()` as this process's program and exit with its status (`main`'s return value
    when `returns_status`, else 0; a SystemExit's code). A rank of a launch ends without finalization
    (`end_process`); any other process exits as Python does. An exception other than SystemExit propagates."""
    try:
        result = main()
        code: object = result if returns_status else 0
    except SystemExit as stop:
        code = stop.code
    if not launched_rank(os.environ):
        raise SystemExit(code)
    if multiprocessing.parent_process() is not None:
        return_to_launcher(exit_code(code))
    end_process(exit_code(code))


def exit_code(code: object) -> int:
    """A SystemExit code as the interpreter turns it into a status: None is 0, an int is itself, anything else
    is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


_ending: list[bool] = []  # end_process runs the atexit handlers itself, then skips finalization


def settle_collective_threads(seconds: float = 0.05) -> None:
    """An atexit handler (the Engine registers it) for a process that ends with Python's normal exit, such as a
    script run with a bare `torchrun my_script.py`: atexit runs before finalization begins, so a gloo worker thread
    that has yet to drop a finished collective can still take the GIL. Sleeping `seconds` with the GIL free gives
    it that moment: this narrows the window (the thread must now be held off the CPU that long), where
    `exit_after` closes it."""
    if _ending or sys.platform != "linux":
        return
    try:
        names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    except OSError:
        return
    if "pt_gloo_runloop" in names:
        time.sleep(seconds)


def end_process(status: int) -> NoReturn:
    """Do what Python does at exit up to its finalization, then end the process with `status`."""
    exit_steps()
    os._exit(status)


def return_to_launcher(status: int) -> NoReturn:
    """End a rank that `torchrun --run-path` started as a function in a forked or spawned process: its agent waits
    for the function to return (a rank that ends itself hangs the agent), then multiprocessing ends the process,
    with `os._exit` after a fork and with a normal exit after a spawn. The exit steps run here; an atexit handler
    registered after them ends a spawned process before its finalization, as `end_process` does."""
    exit_steps()
    atexit.register(os._exit, status)
    raise SystemExit(status)  # torchrun's `record` turns 0 into the function's return; another status fails the rank


def exit_steps() -> None:
    """What Python does at exit before finalization: wait for non-daemon threads, run atexit, flush open files."""
    _ending.append(True)
    shutdown_threads = getattr(threading, "_shutdown", None)  # CPython: executors' stop callbacks, then joins
    if shutdown_threads is not None:
        shutdown_threads()
    else:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    flush_open_files()


FILE_TYPES = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def flush_standard_streams() -> None:
    """Before a fork too: or the child would print again what this process had buffered."""
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)


def flush_open_files() -> None:
    """Flush the standard streams, then every buffered file still open (finalization would have closed them)."""
    flush_standard_streams()
    for obj in gc.get_objects():
        # type(), not isinstance: some objects answer `__class__` with a warning (torch's deprecated aliases)
        if issubclass(type(obj), FILE_TYPES):
            _flush(obj)


def _flush(stream: object) -> None:
    try:
        if stream is not None and not stream.closed:  # type: ignore[attr-defined]
            stream.flush()  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):
        pass  # a closed pipe or a detached stream: nothing left to write there
