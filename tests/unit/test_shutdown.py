"""The links of the stop chain, each in real processes: DataLoader workers survive a SIGTERM meant for their
rank, the trainer's SIGTERM handler stays out of forked children, a child learns of its parent's SIGKILL,
and the launcher forwards signals to its child and reports how it ended."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from rapidtrain.config.describe import ON_SIGTERM, describe_plan
from rapidtrain.config.settings import TrainingSettings
from rapidtrain.core.shutdown import (
    child_pids,
    exit_status,
    ignore_sigterm_in_worker,
    run_forwarding_signals,
)
from rapidtrain.train.control import StopConditions, StopSignal

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")
WAIT = 120  # bound on every wait; never a timing assertion


class SlowNumbers(Dataset):
    """Items that take a moment, so the workers are alive and busy when the signal comes."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.tensor(index)


def test_dataloader_workers_outlive_a_sigterm_to_the_group():
    """The group's SIGTERM reaches the workers too (torchrun's killpg); they ignore it, and every batch comes."""
    loader = DataLoader(SlowNumbers(), batch_size=4, num_workers=2, worker_init_fn=ignore_sigterm_in_worker)
    iterator = iter(loader)
    seen = [next(iterator)]
    workers = [w.pid for w in iterator._workers]
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    seen += list(iterator)
    assert torch.cat(seen).tolist() == list(range(32))


def test_without_it_a_worker_dies_of_the_groups_sigterm():
    """The failure the worker_init_fn prevents: torch's worker handler lets SIGTERM kill a worker unless its own
    rank sent it, and the loader then fails."""
    loader = DataLoader(SlowNumbers(), batch_size=4, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    os.kill(iterator._workers[0].pid, signal.SIGTERM)
    with pytest.raises(RuntimeError, match="killed by signal: Terminated|exited unexpectedly"):
        list(iterator)


def test_stop_signal_sets_the_flag_and_survives_a_repeat():
    stop = StopSignal()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one, as during the final save
        assert stop.received
    finally:
        stop.restore()
    # the run ended on a signal: the handler stays (a late repeat must not kill the exit)
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_stopped_process_exits_0_under_repeated_sigterm():
    """After a stop by signal the process exits; SIGTERMs keep coming (a scheduler's repeats, a parent-death
    signal) until it is gone. Python puts back the default action for its handlers while it finalizes, so
    without the atexit hook every one of these exits would be a death by SIGTERM after a good save."""
    child = textwrap.dedent("""
        import os, sys
        from rapidtrain.train.control import StopSignal
        stop = StopSignal()
        os.kill(os.getpid(), 15)
        while not stop.received:
            pass
        stop.restore()
        sys.stdout.write("stopped")
        sys.stdout.flush()
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for _ in range(3):
        process = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, env=env)
        assert process.stdout.read(7) == b"stopped"
        deadline = time.monotonic() + WAIT
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            time.sleep(0.001)
        assert process.wait(WAIT) == 0


def test_stop_signal_is_removed_after_a_run_without_signal():
    previous = signal.getsignal(signal.SIGTERM)
    StopSignal().restore()
    assert signal.getsignal(signal.SIGTERM) == previous


def _child_waits(ready) -> None:
    ready.set()
    time.sleep(WAIT)


def test_a_forked_child_still_ends_on_sigterm():
    """A pool forked while the trainer's handler is installed: its terminate() (SIGTERM) must end the child,
    not set the parent's flag in a copy and leave the pool's join waiting for ever."""
    stop = StopSignal()
    try:
        context = multiprocessing.get_context("fork")
        ready = context.Event()
        child = context.Process(target=_child_waits, args=(ready,))
        child.start()
        assert ready.wait(WAIT)  # (a signal in the instant after fork is dropped by Python itself)
        child.terminate()
        child.join(WAIT)
        assert child.exitcode == -signal.SIGTERM
        assert not stop.received
    finally:
        stop.restore()


@pytest.mark.parametrize("on_sigterm, handled", [("save", True), ("stop", True), ("default", False)])
def test_sigterm_is_handled_with_save_or_exit_signal_handler(on_sigterm, handled):
    previous = signal.getsignal(signal.SIGTERM)
    conditions = StopConditions(TrainingSettings(on_sigterm=on_sigterm))
    try:
        assert (signal.getsignal(signal.SIGTERM) != previous) == handled
    finally:
        conditions.close()
    assert signal.getsignal(signal.SIGTERM) == previous


@pytest.mark.parametrize("flags, on_sigterm", [(["--save", "ck"], "save"), (["--exit-signal-handler"], "stop"),
                                               ([], "default")])
def test_plan_says_what_sigterm_does(flags, on_sigterm):
    from rapidtrain.config import arguments, plan

    args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-3", *flags], entry="pretrain")
    resolved = plan.from_args(args, plan.RunContext(1, "cpu"))
    assert resolved.training.on_sigterm == on_sigterm
    assert "  on SIGTERM: " + ON_SIGTERM[on_sigterm] in describe_plan(resolved)


def test_exit_status_reports_signals_as_a_shell_does():
    assert exit_status(0) == 0 and exit_status(2) == 2 and exit_status(-15) == 143


def written(path: Path, deadline: float) -> str:
    """The text another process writes to `path`, once there is some: write_text creates the file before it
    writes, so a file that exists may still be empty."""
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.read_text()


def start_launcher(tmp_path: Path, forked: bool = False) -> subprocess.Popen:
    """A launcher (run_forwarding_signals) whose child exits 0 once it got SIGTERM, after writing how many; the
    child is a new interpreter, or (`forked`) a fork of the launcher running the same code, as the launcher's
    torchrun is."""
    marker = tmp_path / "got"
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        Path({str(tmp_path / 'ready')!r}).write_text(str(os.getsid(0)) + " " + os.environ["RAPIDTRAIN_PARENT_PID"])
        deadline = time.monotonic() + {WAIT}
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        Path({str(marker)!r}).write_text(str(len(got)))
        sys.exit(0 if got else 3)
    """)
    launcher = textwrap.dedent(f"""
        import sys
        from rapidtrain.core.shutdown import run_forwarding_signals
        child = {child!r}
        fork_main = (lambda: exec(child, {{"__name__": "__main__"}})) if {forked!r} else None
        sys.exit(run_forwarding_signals([sys.executable, "-c", child], fork_main=fork_main))
    """)
    process = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True,
                               env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    deadline = time.monotonic() + WAIT
    session, parent = written(tmp_path / "ready", deadline).split()
    assert int(parent) == process.pid and int(session) != os.getsid(process.pid)  # its own session
    return process


@linux_only
@pytest.mark.parametrize("forked", [False, True], ids=["exec", "fork"])
def test_launcher_forwards_sigterm_once_and_waits(tmp_path, forked):
    """The child (in its own session) gets the launcher's SIGTERM, finishes its work, and its status is the
    launcher's: a child that handles SIGTERM and exits 0 makes the launch exit 0."""
    process = start_launcher(tmp_path, forked)
    os.killpg(process.pid, signal.SIGTERM)  # the launcher's group: the child is not in it
    assert process.wait(WAIT) == 0
    assert (tmp_path / "got").read_text() == "1"  # forwarded exactly once


@linux_only
@pytest.mark.parametrize("forked", [False, True], ids=["exec", "fork"])
def test_launcher_keeps_its_childs_status_under_repeated_sigterm(tmp_path, forked):
    """SIGTERM after SIGTERM until the launcher is gone: the repeats after its child ended must not turn the
    child's 0 into the launcher's own death by signal."""
    process = start_launcher(tmp_path, forked)
    deadline = time.monotonic() + WAIT
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        time.sleep(0.001)
    assert process.wait(WAIT) == 0


@linux_only
def test_child_of_a_sigkilled_parent_gets_sigterm(tmp_path):
    """stop_with_parent: the parent's SIGKILL becomes SIGTERM in the child (which then saves, in a rank)."""
    marker = tmp_path / "got"
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from rapidtrain.core.shutdown import parent_pid_from_env, stop_with_parent
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        assert stop_with_parent(parent_pid_from_env())
        Path({str(tmp_path / 'ready')!r}).write_text("ready")
        deadline = time.monotonic() + {WAIT}
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        Path({str(marker)!r}).write_text(str(got))
    """)
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        os.environ["RAPIDTRAIN_PARENT_PID"] = str(os.getpid())
        subprocess.Popen([sys.executable, "-c", {child!r}])
        time.sleep({WAIT})
    """)
    process = subprocess.Popen([sys.executable, "-c", parent],
                               env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    deadline = time.monotonic() + WAIT
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child_pids(process.pid)
    process.kill()
    process.wait(WAIT)
    assert written(marker, deadline) == f"[{int(signal.SIGTERM)}]"


def test_run_forwarding_signals_returns_the_childs_status():
    assert run_forwarding_signals([sys.executable, "-c", "raise SystemExit(5)"]) == 5
    assert run_forwarding_signals([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]) \
        == 128 + signal.SIGTERM


FORKED_CHILDREN = textwrap.dedent("""
    import os, signal, sys
    from rapidtrain.core.shutdown import run_forwarding_signals, single_threaded

    def kill_self():
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    def fails():
        raise ValueError("a bug in the child")

    assert single_threaded()  # a fresh interpreter: the fork path is taken
    command = [sys.executable, "-c", "unused: the child is a fork"]
    session = os.getsid(0)
    env = os.environ
    own = lambda: 9 if os.getsid(0) != session and env.get("ONLY") == "this" and "RAPIDTRAIN_PARENT_PID" in env else 0
    print("statuses", run_forwarding_signals(command, fork_main=lambda: 6),
          run_forwarding_signals(command, fork_main=lambda: sys.exit(4)),
          run_forwarding_signals(command, fork_main=kill_self),
          run_forwarding_signals(command, fork_main=fails),
          run_forwarding_signals(command, env={"ONLY": "this"}, fork_main=own), flush=True)
""")


@linux_only
def test_a_forked_child_gives_its_status_as_a_new_interpreter_would():
    """ForkedChild (run in a fresh interpreter: pytest's workers run threads, which rule the fork out): main's
    return value, its SystemExit's code, death by a signal (128 + N), an exception's traceback and 1; the child in
    its own session with the environment it was given."""
    run = subprocess.run([sys.executable, "-c", FORKED_CHILDREN], capture_output=True, text=True, timeout=WAIT,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert run.returncode == 0, run.stderr
    assert f"statuses 6 4 {128 + signal.SIGTERM} 1 9" in run.stdout
    assert "ValueError: a bug in the child" in run.stderr


def test_a_workers_descriptor_sharing_errors_print_nothing_and_other_errors_still_do(capsys, monkeypatch):
    """A rank that ends at once mid-handshake breaks its worker's descriptor-sharing thread: the worker prints no
    traceback for that (the run's log stays the rank's). Raised from code compiled as multiprocessing's
    resource_sharer.py, as that thread raises it; any other error reaches the previous hook."""
    from rapidtrain.core.shutdown import quiet_descriptor_sharing_errors

    printed: list[type] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(kind))
    quiet_descriptor_sharing_errors()
    sharer = os.path.join(os.path.dirname(os.__file__), "multiprocessing", "resource_sharer.py")
    for error, path in ((EOFError, sharer), (ConnectionResetError, sharer), (EOFError, "elsewhere.py"),
                        (ValueError, sharer)):
        try:
            exec(compile(f"raise {error.__name__}()", path, "exec"))
        except BaseException as raised:  # noqa: BLE001 - handed to the hook as an uncaught one would be
            sys.excepthook(type(raised), raised, raised.__traceback__.tb_next)
    assert printed == [EOFError, ValueError]
