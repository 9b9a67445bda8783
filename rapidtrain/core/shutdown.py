"""How a stop request reaches the process that acts on it: the `rapidtrain` launcher forwards signals to torchrun,
torchrun (as the launcher starts it) passes SIGTERM to the ranks and waits for them, DataLoader workers leave
SIGTERM to their rank, and a process whose parent dies is told so by the kernel (Linux's parent-death signal).

The chain, and why each link is there:
- launcher → torchrun: torchrun runs in its own session, so a signal to the launcher's process group (a
  terminal's Ctrl-C, `kill -- -PGID`, a scheduler) reaches the launcher only, which forwards it exactly once.
- torchrun → ranks: torchrun's own handler would send SIGTERM to each rank's whole process group (the rank and
  its DataLoader workers), then SIGKILL after --shutdown-timeout (30 s), then exit 1 with a traceback; a
  second signal during that wait aborts it. The launcher's torchrun instead forwards SIGTERM to the ranks
  alone and keeps monitoring them, so a rank that saves and exits 0 ends the launch with status 0, however
  long the save takes and however often SIGTERM arrives.
- rank → DataLoader workers: workers ignore SIGTERM (the rank decides; it stops them when it exits), so a
  signal to the rank's group cannot kill them under the rank's feet ("DataLoader worker ... is killed by
  signal: Terminated").
- parent death: torchrun asks for SIGTERM when the launcher dies and each rank when torchrun dies, so a
  SIGKILLed launcher or torchrun leaves no rank training on as an orphan: the ranks save and exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import NoReturn

# The process that started this one, exported by the launcher (for torchrun) and by the launcher's torchrun
# (for the ranks), so a child can tell whether its parent died before it asked to be told.
PARENT_PID_ENV = "RAPIDTRAIN_PARENT_PID"
# What a scheduler or a shell sends to stop or warn a job. SIGUSR1/2 are forwarded too, so that the launcher never
# dies of one before its ranks (Slurm's --signal=B:USR1@N reaches the launcher only): a rank saves on it when it is
# the run's --exit-signal, and otherwise ends of it, which the launcher then tells.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def stop_signals(exit_signal: str | None) -> tuple[int, ...]:
    """The signals a launcher forwards: the usual ones and the run's --exit-signal (SIGALRM, SIGXCPU, ...)."""
    extra = getattr(signal, exit_signal, None) if exit_signal else None
    return FORWARDED_SIGNALS + ((extra,) if extra is not None and extra not in FORWARDED_SIGNALS else ())
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent(expected_parent: int | None = None, signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent ends (Linux only; False elsewhere or
    when refused). If the parent is already gone (`expected_parent` is no longer it), the signal is sent now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), signum)
    return True


def parent_pid_from_env() -> int | None:
    value = os.environ.get(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


def stop_rank_with_torchrun() -> bool:
    """A rank started by torchrun: SIGTERM when torchrun ends (SIGKILL included), so the rank saves and exits
    instead of training on as an orphan. Only under torchrun: a `python script.py` run started from a shell
    that later exits (nohup) must keep training."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return stop_with_parent(parent_pid_from_env())


def ignore_sigterm_in_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: SIGTERM and Ctrl-C are the rank's to handle (save, then stop its workers
    itself); a worker that died of them would stop the rank with "DataLoader worker is killed by signal". And a
    rank that ends at once (SIGTERM without --save, SIGKILL) while fetching a batch's shared memory from a worker
    leaves that worker's descriptor-sharing thread with a broken handshake: it would print a traceback on its way
    out; now it stays quiet (`quiet_descriptor_sharing_errors`)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    quiet_descriptor_sharing_errors()


_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


def quiet_descriptor_sharing_errors() -> None:
    """In a DataLoader worker: an error of multiprocessing's descriptor-sharing thread that reaches
    `sys.excepthook` (a peer gone mid-handshake: EOFError, a connection or OS error) prints nothing. The process
    that asked for the descriptor reports its own failure if it lives on; every other error prints as before."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        frames = traceback.extract_tb(tb) if tb is not None else []
        if issubclass(kind, (EOFError, OSError)) and frames and frames[0].filename.endswith(_SHARER):
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a child ended by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_forwarding_signals(command: Sequence[str], env: dict[str, str] | None = None,
                           fork_main: Callable[[], int] | None = None,
                           signals: Sequence[int] = FORWARDED_SIGNALS) -> int:
    """Run `command` in its own session, forward every stop signal this process receives to it, and wait for
    it however long it takes; its exit status. The child learns this process's pid (PARENT_PID_ENV).

    `fork_main`, when given, is what `command` would run, as a call in this process: the child is then a fork
    of this one running it, not a new interpreter (the launcher's torchrun skips importing torch again: about
    1 s of a 2-rank launch's wall time on 2 cores), provided this process runs no other thread (a fork copies
    only the calling one).

    Each signal is forwarded once: the child was told, and a repeat (a scheduler's SIGTERM loop, an impatient
    `kill`) reaching it while its interpreter finalizes, when Python handlers no longer run, would turn the
    child's clean exit after its save into a death by signal. A signal that was forwarded stays ignored here
    afterwards too: this process is about to exit with the child's status, and a repeat arriving in between
    must not replace that status with its own death. SIGKILL remains the way to end a run at once.

    A signal this process was started ignoring (`nohup`'s SIGHUP, a shell's `trap '' USR1`) stays ignored, here and
    in the child: the person who started it asked for that."""
    env = dict(os.environ if env is None else env, **{PARENT_PID_ENV: str(os.getpid())})
    process: subprocess.Popen | ForkedChild | None = None
    received: list[int] = []
    aborted: list[bool] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and signum in received and process is not None and not aborted:
            aborted.append(True)
            abort_tree(process.pid)
            return
        if signum in received:
            return
        received.append(signum)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in signals
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        if fork_main is not None and single_threaded():
            process = ForkedChild(fork_main, env, tuple(previous))
        else:
            process = subprocess.Popen(list(command), env=env, start_new_session=True)
        for signum in list(received):  # arrived while it was being started
            process.send_signal(signum)
        status = exit_status(process.wait())
        return 128 + signal.SIGINT if aborted else status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if signum in received else handler)


def single_threaded() -> bool:
    """This process runs one thread, native ones included (/proc); False where that cannot be told."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class ForkedChild:
    """A child that is a fork of this process calling `main` in a session of its own, with `env` as its
    environment; its status is main's return value (or its SystemExit's). Offers what run_forwarding_signals uses
    of a Popen. The child gets the signal dispositions a new interpreter would: handlers back to the defaults
    (Ctrl-C raising KeyboardInterrupt), ignored signals still ignored."""

    def __init__(self, main: Callable[[], int], env: dict[str, str],
                 handled: Sequence[int] = FORWARDED_SIGNALS) -> None:
        from rapidtrain.core.process import flush_standard_streams

        flush_standard_streams()
        self.pid = os.fork()
        if self.pid == 0:
            self._run_child(main, env, handled)

    @staticmethod
    def _run_child(main: Callable[[], int], env: dict[str, str], handled: Sequence[int]) -> NoReturn:
        from rapidtrain.core.process import end_process, exit_code

        status = 1
        try:
            os.setsid()
            for signum in handled:  # the parent's forwarding handlers: back to what a new interpreter has
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(env)
            status = main()
        except SystemExit as stop:
            status = exit_code(stop.code)
        except BaseException:  # noqa: BLE001 - reported as a new interpreter would, then the status it would give
            traceback.print_exc()
        finally:
            end_process(status)

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)  # retried after a signal's handler has run (PEP 475)
        return os.waitstatus_to_exitcode(status)


def abort_tree(pid: int) -> None:
    """A second Ctrl-C: SIGKILL `pid` and every process under it (each rank is in a session of its own), at once."""
    print("rapidtrain: second Ctrl-C: stopping every rank now, without saving", file=sys.stderr, flush=True)
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        tree.append(current)
        frontier += child_pids(current)
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def child_pids(parent: int | None = None) -> list[int]:
    """The live children of `parent` (this process by default), from /proc."""
    parent = os.getpid() if parent is None else parent
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            children.append(int(entry.name))
    return children


class RankSignalForwarder:
    """In the launcher's torchrun: SIGTERM goes to the ranks (never their DataLoader workers) and torchrun
    keeps waiting for them. Before any rank exists, torchrun's own handling shuts the launch down."""

    def __init__(self) -> None:
        self.forwarded: set[int] = set()

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux") and Path("/proc/self/stat").exists()

    def install(self, exit_signal: str | None = None) -> tuple[int, ...]:
        """Forward SIGTERM, Ctrl-C (the ranks save, status 130), SIGUSR1/2 and the run's --exit-signal to the
        ranks; the signals now handled here (torchrun must leave them alone). An ignored one stays ignored."""
        wanted = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2]
        extra = getattr(signal, exit_signal, None) if exit_signal else None
        if extra is not None and extra not in wanted:
            wanted.append(extra)
        handled = tuple(signum for signum in wanted if signal.getsignal(signum) is not signal.SIG_IGN)
        for signum in handled:
            signal.signal(signum, self._forward)
        return handled

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        ranks = child_pids()
        if not ranks and not self.forwarded:  # none started yet: torchrun's own shutdown
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        self.forwarded.add(signum)  # a repeat after the ranks have gone changes nothing: they were told
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def settle(self) -> None:
        """torchrun is done: after a forwarded stop, a repeat must not kill it on its way out (the interpreter
        drops Python handlers while it finalizes), or its status would be the signal's, not the ranks'."""
        for signum in self.forwarded:
            signal.signal(signum, signal.SIG_IGN)
