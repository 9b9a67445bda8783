"""--exit-signal (Megatron's) works: the plan names the signal and what it does (not "no effect"), a signal no run
can stop on is refused naming the ones it can, and a rank's stop handler catches it (and keeps an inherited
"ignore", as under nohup)."""

from __future__ import annotations

import os
import signal

import pytest

from rapidtrain.config import rules
from rapidtrain.config.arguments import build_parser, parse_args
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.flag_surface import classify, own_flags_help
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.core.shutdown import stop_signals
from rapidtrain.train.control import StopSignal

BASE = ["--train-iters", "10", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2"]


def described(flags: list[str]) -> str:
    args = parse_args(BASE + flags)
    rules.validate(args, RunContext())
    return describe_plan(from_args(args, RunContext()))


def test_the_plan_says_what_the_exit_signal_does():
    text = described(["--exit-signal-handler", "--exit-signal", "SIGUSR1"])
    line = next(line for line in text.splitlines() if "on SIGTERM" in line)
    assert "SIGUSR1 (--exit-signal)" in line and "stop at the end of the iteration" in line
    assert "SIGUSR1, --exit-signal, is caught only with --save or --exit-signal-handler" in described(
        ["--exit-signal", "SIGUSR1"])
    treatment = classify("--exit-signal", own_flags_help(build_parser()))
    assert treatment is not None and treatment.status == "works", treatment


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV"])
def test_a_signal_no_run_can_stop_on_is_refused_naming_the_ones_it_can(name):
    args = parse_args(BASE + ["--exit-signal", name])
    message = next(text for text in rules.violations(args, RunContext()) if "--exit-signal" in text)
    assert f"--exit-signal {name}" in message and "SIGUSR1" in message


def test_the_launcher_forwards_the_exit_signal_beside_the_usual_ones():
    assert signal.SIGALRM in stop_signals("SIGALRM")
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2} <= set(stop_signals(None))


def test_the_stop_handler_catches_the_exit_signal_and_keeps_an_inherited_ignore():
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        handler = StopSignal("SIGUSR1")
        ignoring = StopSignal("SIGUSR2")
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN  # nohup-style: left as the user set it
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received
        ignoring.restore()
        handler.restore()
    finally:
        signal.signal(signal.SIGUSR2, previous)
        from rapidtrain.core.stopped_run import RUN

        RUN.stop_signal = None
