"""Every signal a scheduler or a shell sends has a tested outcome through the `rapidtrain` launcher, table-driven:
the signal, the flags, what is sent to whom, and the outcome (exit status, what is saved, what is said). SIGTERM
and Ctrl-C (SIGINT) at every target and moment are tests/e2e/test_signals.py's and test_stopped_run.py's (SIGTERM
beside another --exit-signal is the same handler: tests/unit/test_exit_signal.py); this table adds the rest.

One tiny model, 2 ranks, 0 loader workers, one launch per row (a row may send several signals, one after
another). Each launch runs in its own session, is signalled after its first log line, and every process it had
must be gone at its end (test_signals.Launch)."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rapidtrain.checkpoint.checkpointer import latest_iteration, verify_checkpoint
from tests.e2e.test_signals import Launch, launches  # noqa: F401 - the fixture
from tests.launch import TINY_GPT_SHAPE

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

FLAGS = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"]
LONG, SHORT = 60, 6  # iterations: a run that a signal must stop, and one that must reach its end


@dataclass(frozen=True)
class Case:
    name: str
    signals: tuple[int, ...]  # sent to the launcher one after another (a pause after a SIGSTOP)
    flags: tuple[str, ...]
    iterations: int
    status: int
    saved: bool  # a complete checkpoint before the end
    said: str  # in the launch's output
    ignore_hangup: bool = False  # started under nohup


CASES = [
    Case("exit-signal SIGUSR1 saves through the launcher", (signal.SIGUSR1,),
         ("--exit-signal-handler", "--exit-signal", "SIGUSR1"), LONG, 0, True, "stopped by SIGUSR1"),
    Case("SIGUSR2 that is not the exit signal is told", (signal.SIGUSR2,), (), LONG, 128 + signal.SIGUSR2, False,
         "SIGUSR2 is not this run's --exit-signal: give --exit-signal SIGUSR2"),
    # Two signals that leave the run to reach its end, sent to one launch: either one stopping or breaking the run
    # fails the case as it failed each alone (a SIGHUP that ended it, ranks killed while the launcher was stopped).
    Case("SIGHUP under nohup is ignored; SIGSTOP then SIGCONT pauses the launcher only",
         (signal.SIGHUP, signal.SIGSTOP, signal.SIGCONT), (), SHORT, 0, False, f"iteration        {SHORT}/",
         ignore_hangup=True),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_signal_sent_to_the_launcher_has_its_outcome(case, tmp_path, launches, demo_data):  # noqa: F811
    save = tmp_path / "ck"
    command = [sys.executable, "-m", "rapidtrain.cli", "--nproc-per-node", "2", *FLAGS, *case.flags,
               "--train-iters", str(case.iterations), "--save", str(save), "--save-interval", "1000"]
    launch = Launch(["nohup", *command] if case.ignore_hangup else command, tmp_path / "log.txt")
    launches.append(launch)
    launch.started()
    for number, signum in enumerate(case.signals):
        if number and case.signals[number - 1] == signal.SIGSTOP:
            time.sleep(1)  # the launcher stays stopped a moment while its ranks train on
        launch.process.send_signal(signum)
    status = launch.finish()
    output = launch.text()
    assert status == case.status, output[-4000:]
    assert case.said in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    iteration = latest_iteration(save)
    if case.saved:
        assert iteration is not None and iteration < case.iterations, output[-4000:]
        assert verify_checkpoint(save / f"iter_{iteration:07d}")
    elif case.status == 0:
        assert iteration == case.iterations  # the final save of a run that went to its end
    assert not list(Path(save).glob("*.tmp"))
