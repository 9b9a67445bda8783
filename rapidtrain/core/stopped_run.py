"""One story per stopped run: what stopped it, on which rank and node, the last complete checkpoint, and the
command that resumes — told once (by the first rank to report, or by the launcher), never as a traceback unless
rapidtrain itself has a bug (then one traceback, from one rank).

A rank under torchrun also writes its one-line account into torchrun's error file (TORCHELASTIC_ERROR_FILE),
so torchrun's own failure summary and the `rapidtrain` launcher read the cause instead of "<N/A>". Standard
library only: every layer may use it (torch is used only when the process already imported it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

EXIT_LOST_CONTACT = 3  # a rank that stopped because another rank or the network went away: a victim, not a cause
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
COMMAND_ENV = "RAPIDTRAIN_COMMAND"  # the launcher's own command line, for the resume line it and the ranks print
LATEST_FILE = "latest_checkpointed_iteration.txt"  # the checkpoint format's tracker (checkpoint/ is a layer above)

# What torch.distributed's transports say when the other end is gone; a DistError subclass says it by its type.
_LOST_CONTACT = re.compile(r"Connection (reset|closed|refused)|Broken pipe|connectFullMesh|Socket Timeout|"
                           r"Timed out waiting|timed out after|NCCL (error|communicator was aborted)|"
                           r"remote worker hanging|peer .*(closed|gone)", re.IGNORECASE)


@dataclass
class RunState:
    """Where the run is: set by the trainer as it goes, read when it stops."""

    save: str | None = None
    iteration: int | None = None
    stop_signal: int | None = None  # the signal that asked the loop to stop (SIGTERM, SIGINT)


RUN = RunState()


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def rank_and_node() -> str:
    """'rank 1 (local rank 1 of node 0, host h)' for this process."""
    rank = os.environ.get("RANK", "0")
    local = os.environ.get("LOCAL_RANK", "0")
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    return f"rank {rank} (local rank {local} of node {node}, host {socket.gethostname()})"


def last_checkpoint(save: str | None) -> str:
    """The last complete checkpoint in `save`, in words."""
    if not save:
        return "none (no --save)"
    tracker = Path(save) / LATEST_FILE
    try:
        text = tracker.read_text(encoding="utf-8").strip()
    except OSError:
        return f"none in {save}"
    except UnicodeDecodeError:
        text = ""
    if not (text.isascii() and text.isdigit()):
        return f"unknown ({tracker} is damaged)"
    return f"{Path(save) / f'iter_{int(text):07d}'} (iteration {int(text)})"


def with_load(argv: list[str], save: str | None) -> list[str]:
    """`argv` with --load pointing at `save` (the resume), replacing any --load it had."""
    if not save:
        return list(argv)
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--load":
            skip = True
            continue
        if not arg.startswith("--load="):
            kept.append(arg)
    return [*kept, "--load", save]


def resume_command(save: str | None, argv: list[str] | None = None) -> str:
    """The command that continues this run: the launcher's (when it started the run) or torchrun's."""
    launcher = os.environ.get(COMMAND_ENV)
    if launcher:
        words = shlex.split(launcher)
        return shlex.join([words[0], *with_load(words[1:], save)])
    argv = list(sys.argv if argv is None else argv)
    env = os.environ
    torchrun = ["torchrun", f"--nnodes={env.get('GROUP_WORLD_SIZE', '1')}",
                f"--nproc-per-node={env.get('LOCAL_WORLD_SIZE', '1')}"]
    if env.get("GROUP_WORLD_SIZE", "1") != "1":
        torchrun += [f"--node-rank={env.get('GROUP_RANK', '0')}", f"--master-addr={env.get('MASTER_ADDR', '')}",
                     f"--master-port={env.get('MASTER_PORT', '')}"]
    return shlex.join([*torchrun, *with_load(argv, save)])


def resume_line(save: str | None) -> str:
    if not save:
        return "Nothing was saved (no --save): a new run starts from scratch."
    return f"Last complete checkpoint: {last_checkpoint(save)}. Resume with: {resume_command(save)}"


def is_lost_contact(error: BaseException) -> bool:
    """Another rank, or the network between ranks, went away (not a fault of this rank's own work)."""
    seen: list[BaseException] = [error]
    while seen:
        current = seen.pop()
        if type(current).__name__ in ("DistNetworkError", "DistBackendError", "DistStoreError"):
            return True
        if _LOST_CONTACT.search(str(current)):
            return True
        seen += [e for e in (current.__cause__, current.__context__) if e is not None]
    return False


def _store():
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=10))
    return store


def already_reported(topic: str) -> bool:
    """Whether some rank told `topic` already (a cause: a victim's "lost contact" would only repeat it)."""
    try:
        store = _store()
        return store is not None and store.add(f"rapidtrain/reported/{topic}", 0) > 0
    except Exception:
        return False


def first_to_report(topic: str) -> bool:
    """True for exactly one rank of the run per topic: the first to claim it in the process group's store (which
    torchrun's agent serves, so it outlives a dead rank); rank 0 before the group exists, local rank 0 when the
    store is gone too."""
    try:
        store = _store()
    except Exception:
        store = None
    if store is None:
        return int(os.environ.get("RANK", "0") or 0) == 0
    try:
        return store.add(f"rapidtrain/reported/{topic}", 1) == 1
    except Exception:  # the store's host is gone as well: one report per node
        return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0


def write_error_file(kind: str, message: str) -> None:
    """This rank's account, where torchrun (and the launcher) read why a worker failed."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": message, "timestamp": int(time.time()),
              "rapidtrain": {"kind": kind, "rank": int(os.environ.get("RANK", "0") or 0),
                             "iteration": RUN.iteration}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record))
    except OSError:
        pass


def tell_once(kind: str, line: str) -> None:
    """This rank's account in its error file; printed by the one rank that claims the kind first."""
    write_error_file(kind, line)
    if first_to_report(kind):
        print(line, file=sys.stderr, flush=True)


def at_iteration() -> str:
    return f" at iteration {RUN.iteration}" if RUN.iteration is not None else " before its first iteration"


def report(topic: str, paragraph: str) -> None:
    """Print `paragraph` once for the run; a rank started by the launcher leaves the telling to it."""
    if os.environ.get(COMMAND_ENV) and topic != "signal":
        return
    if topic == "stopped" and (already_reported("user_error") or already_reported("bug")):
        return
    if first_to_report(topic):
        print(paragraph, file=sys.stderr, flush=True)


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = re.sub(r"\[/?[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # the transport's source location
    return text[:200] or type(error).__name__


# A DataLoader worker's death as torch reports it to the rank ("exited unexpectedly", "is killed by signal: Killed").
_WORKER_DIED = re.compile(r"DataLoader worker \(pids?\(?s?\)? ?([\d, ]+)\) (exited unexpectedly|is killed by signal: "
                          r"[\w ]+)")
_TIMED_OUT = re.compile(r"Timed out waiting|timed out after|Timeout waiting|operation timed out", re.IGNORECASE)
# Cache folders that libraries write under the home directory, and the variable that moves each.
CACHE_VARIABLES = (("torch_extensions", "TORCH_EXTENSIONS_DIR", "DeepSpeed's and torch's compiled ops"),
                   ("triton", "TRITON_CACHE_DIR", "Triton's compiled kernels"),
                   ("torchinductor", "TORCHINDUCTOR_CACHE_DIR", "torch.compile's kernels"),
                   ("huggingface", "HF_HOME", "Hugging Face's downloads and datasets"),
                   ("rapidtrain", "XDG_CACHE_HOME", "rapidtrain's demo corpus and index caches"))


def _chain(error: BaseException) -> list[BaseException]:
    seen, found = [error], []
    while seen:
        current = seen.pop()
        found.append(current)
        seen += [e for e in (current.__cause__, current.__context__) if e is not None and e not in found]
    return found


def worker_death(error: BaseException) -> str | None:
    """'pid 4482 exited unexpectedly' when a DataLoader worker of this rank died, else None."""
    for current in _chain(error):
        found = _WORKER_DIED.search(str(current))
        if found:
            return f"pid {found.group(1).strip()} {found.group(2)}"
    return None


def collective_timeout(error: BaseException) -> str | None:
    """The collective this rank timed out in and where rapidtrain called it ('all_reduce, called from
    rapidtrain/train/step.py:120 (agree)'), read from the traceback; None when the error is no timeout."""
    for current in _chain(error):
        if not (_TIMED_OUT.search(str(current)) or type(current).__name__ == "DistTimeoutError"):
            continue
        frames = traceback.extract_tb(current.__traceback__) if current.__traceback__ is not None else []
        collective = next((f.name for f in frames if f.filename.endswith("distributed_c10d.py")  # the one called
                           and not f.name.startswith("_")), None)
        if collective is None:
            continue
        caller = next((f for f in reversed(frames) if "/rapidtrain/" in f.filename.replace("\\", "/")), None)
        at = ""
        if caller is not None:
            path = caller.filename.replace("\\", "/")
            at = f", called from rapidtrain/{path.rsplit('/rapidtrain/', 1)[1]}:{caller.lineno} ({caller.name})"
        return f"{collective}{at}"
    return None


def unwritable_cache(error: BaseException) -> str | None:
    """The message for a cache folder this process may not write (a read-only home directory), naming the
    variable that moves it; None for any other error."""
    import errno

    for current in _chain(error):
        if not (isinstance(current, OSError) and current.errno in (errno.EACCES, errno.EROFS, errno.EPERM)):
            continue
        path = str(current.filename or "")
        home_cache = os.path.join(os.path.expanduser("~"), ".cache")
        segments = [segment.lstrip(".") for segment in path.split(os.sep)]  # ~/.triton, /tmp/torchinductor_user
        for part, variable, what in CACHE_VARIABLES:
            if any(segment.startswith(part) for segment in segments) or (
                    path.startswith(home_cache) and variable == "XDG_CACHE_HOME"):
                moved = f"{variable}=/a/writable/folder" + (
                    "" if variable == "XDG_CACHE_HOME" else " (or XDG_CACHE_HOME for everything under ~/.cache)")
                return (f"cannot write {path} ({current.strerror or current}): the cache folder of {what} is not "
                        f"writable here (a read-only or shared home directory). Set {moved} for the run.")
    return None


def rank_failed(error: BaseException) -> int:
    """A rank's exception under torchrun, told once; its exit status. Lost contact with another rank → exit 3
    (the launcher names the rank that died); Ctrl-C before training → 130; a DataLoader worker that died, a
    collective that timed out and a cache folder that cannot be written are told as what they are (the last a user
    error, exit 2); anything else is a bug: one traceback."""
    where, save = rank_and_node(), RUN.save
    if isinstance(error, KeyboardInterrupt):
        line = f"rapidtrain: stopped by Ctrl-C{at_iteration()} ({where}). {resume_line(save)}"
        write_error_file("interrupted", line)
        report("signal", line)
        return EXIT_INTERRUPTED
    cache = unwritable_cache(error)
    if cache is not None:
        line = f"rapidtrain: error: {where}: {cache}"
        tell_once("user_error", line)
        return 2
    worker = worker_death(error)
    if worker is not None:
        line = (f"rapidtrain: the run stopped{at_iteration()}: a DataLoader worker of {where} died ({worker}): it "
                "was killed from outside (the kernel's out-of-memory killer: see `dmesg`; a user) or crashed in the "
                "data pipeline. Give fewer --num-workers (or 0: the rank loads its data itself) if memory is short. "
                f"{resume_line(save)}")
        tell_once("loader_worker", line)
        return 1
    timeout = collective_timeout(error)
    if timeout is not None:
        line = (f"rapidtrain: the run stopped{at_iteration()}: {where} waited longer than the timeout "
                f"(--distributed-timeout-minutes) in {timeout} for a rank that never joined it: that rank is hung "
                "(stuck in I/O, a deadlock, or on another code path), not dead (a dead rank breaks the connection at "
                "once); the launcher's summary names the ranks that did not answer. If a long wait is expected (a "
                f"slow save or evaluation on one rank), raise --distributed-timeout-minutes. {resume_line(save)}")
        tell_once("collective_timeout", line)
        return EXIT_LOST_CONTACT
    if is_lost_contact(error):
        line = (f"rapidtrain: the run stopped{at_iteration()}: {where} lost contact with another rank "
                f"({_short(error)}); a rank died or the network between nodes failed, and torchrun's summary "
                f"names the rank that exited first. {resume_line(save)}")
        write_error_file("lost_contact", line)
        report("stopped", line)
        return EXIT_LOST_CONTACT
    line = (f"rapidtrain: {where} stopped on an error in rapidtrain{at_iteration()}: {type(error).__name__}: "
            f"{_short(error)} (a bug: please report it with the traceback). {resume_line(save)}")
    write_error_file("bug", line)
    if first_to_report("bug"):
        traceback.print_exception(error)
        print(line, file=sys.stderr, flush=True)
    return 1


def signal_stop_status() -> int | None:
    """After a loop stopped by a signal and saved: its resume line (once) and the exit status (Ctrl-C: 130;
    SIGTERM: 0, as schedulers expect of a clean preemption); None when no signal stopped the run."""
    import signal

    if RUN.stop_signal is None:
        return None
    stopped_by, RUN.stop_signal = RUN.stop_signal, None  # told once, however many entry points wrap the run
    name = "Ctrl-C" if stopped_by == signal.SIGINT else signal.Signals(stopped_by).name
    report("signal", f"rapidtrain: stopped by {name}{at_iteration()}. {resume_line(RUN.save)}")
    return EXIT_INTERRUPTED if stopped_by == signal.SIGINT else 0


def _failure_text(rank: int, failure: object, node: str) -> str:
    code, pid = getattr(failure, "exitcode", 1), getattr(failure, "pid", "?")
    who = f"rank {rank} (local rank {getattr(failure, 'local_rank', '?')} of node {node}, pid {pid})"
    if code < 0:
        import signal

        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        hint = " (by a user, a scheduler or the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"{who} was killed by {name}{hint}"
    told = (getattr(failure, "error_file_data", None) or {}).get("rapidtrain")
    if told and told.get("kind") == "bug":
        return f"{who} stopped on an error in rapidtrain (its traceback is above)"
    if told and told.get("kind") == "loader_worker":
        return f"{who} lost a DataLoader worker (said above)"
    return f"{who} exited with status {code}"


def _timed_out(failures: dict) -> list[int]:
    """The ranks that stopped because a collective timed out (their error files say so)."""
    return sorted(rank for rank, f in failures.items()
                  if ((getattr(f, "error_file_data", None) or {}).get("rapidtrain") or {}).get("kind")
                  == "collective_timeout")


def launcher_story(failures: dict, save: str | None, node: str) -> str:
    """The launcher's paragraph for a launch whose ranks failed (`failures`: torchrun's, by global rank)."""
    import signal

    causes = {rank: f for rank, f in failures.items() if f.exitcode not in (EXIT_LOST_CONTACT, -signal.SIGTERM)}
    victims = sorted(rank for rank in failures if rank not in causes)
    iterations = [((getattr(f, "error_file_data", None) or {}).get("rapidtrain") or {}).get("iteration")
                  for f in failures.values()]
    reached = max((i for i in iterations if i is not None), default=None)
    at = f" at iteration {reached}" if reached is not None else ""
    waited = _timed_out(failures)
    hung = sorted(rank for rank, f in failures.items() if f.exitcode in (-signal.SIGKILL, -signal.SIGTERM))
    if waited and hung:  # torchrun ended the ranks that never joined the collective: they hung, nothing killed them
        what = (f"rank{'s' if len(waited) > 1 else ''} {', '.join(map(str, waited))} timed out in a collective "
                f"(said above) waiting for rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} of node "
                f"{node}, which never joined it (hung, not dead) and which torchrun then stopped")
    elif causes:
        what = "; ".join(_failure_text(rank, f, node) for rank, f in sorted(causes.items()))
        if victims:
            what += f"; the other ranks of this node ({', '.join(map(str, victims))}) stopped when they lost it"
    else:
        what = (f"the ranks of node {node} ({', '.join(map(str, victims))}) lost contact with a rank of another node "
                "or the network failed: that node's launcher names the rank")
    return f"rapidtrain: the run stopped{at}: {what}. {resume_line(save)}"


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value of `flag` in a command line (`--flag V` or `--flag=V`)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
