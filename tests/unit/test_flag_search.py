"""Tests that search instead of list (issue 25 item 7): random flag sets drawn from the parser's own actions give
`rapidtrain plan` a plan, or exit 2 with a message naming flags — never a traceback; float flags refuse nan/inf."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapidtrain import cli
from rapidtrain.config import arguments
from rapidtrain.config.flag_parser import finite_float

ACTIONS = [a for a in arguments.build_parser()._actions
           if a.option_strings and a.option_strings[0].startswith("--") and a.dest != "help"
           and not isinstance(a, argparse._VersionAction)]
FLOATS = st.one_of(st.sampled_from(["nan", "inf", "-inf", "0", "-1", "1e308", "1e-3"]),
                   st.floats(-10, 10, allow_nan=False).map(repr))
INTS = st.one_of(st.sampled_from(["0", "-1", "1", "2", "3", "7", "64", "1000000000"]), st.integers(-3, 512).map(str))


def values_for(action: argparse.Action) -> st.SearchStrategy[list[str]]:
    if action.nargs == 0:
        return st.just([])
    if action.choices:
        one = st.sampled_from([str(c) for c in action.choices])
    elif action.type is int:
        one = INTS
    elif action.type in (float, finite_float):
        one = FLOATS
    else:
        one = st.sampled_from(["x", "1", "/nonexistent/path", ""])
    count = action.nargs if isinstance(action.nargs, int) else (1 if action.nargs in (None, "?") else 2)
    return st.lists(one, min_size=count, max_size=count)


FLAG = st.sampled_from(ACTIONS).flatmap(lambda a: values_for(a).map(lambda v: [a.option_strings[0], *v]))


def plan_status(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = cli.main(["plan", *argv])
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 2
    return status, err.getvalue()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.lists(FLAG, min_size=1, max_size=4), st.sampled_from(["1", "2", "8"]))
def test_random_flag_sets_plan_or_exit_2_naming_flags(flags, world):
    argv = ["--train-iters", "10", "--lr", "1e-3", *[word for flag in flags for word in flag], "--world-size", world]
    status, stderr = plan_status(argv)
    assert status in (0, 2), (argv, stderr[-2000:])
    if status == 2:
        assert "Traceback" not in stderr and stderr.strip(), argv
        assert "--" in stderr or "rapidtrain" in stderr, (argv, stderr)


@pytest.mark.parametrize("flag", [a.option_strings[0] for a in ACTIONS if a.type in (float, finite_float)])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_every_float_flag_refuses_nan_and_infinity(flag, value):
    status, stderr = plan_status(["--train-iters", "10", "--lr", "1e-3", flag, value])
    assert status == 2 and f"argument {flag}" in stderr and "not a finite number" in stderr


def test_plan_refuses_what_the_run_refuses():
    status, stderr = plan_status(["--train-iters", "10", "--lr", "5e-5", "--min-lr", "1e-4"])
    assert status == 2 and "--min-lr 0.0001 is above --lr 5e-05" in stderr
    # The demo's own --min-lr (1e-4) follows a smaller --lr (to lr / 10) instead of stopping the run.
    status, stderr = plan_status(["--train-iters", "10", "--lr", "5e-5"])
    assert status == 0, stderr
    status, stderr = plan_status(["--train-iters", "10", "--lr", "1e-3", "--hidden-size", "1000000000"])
    assert status == 2 and "--hidden-size 1000000000" in stderr and "Traceback" not in stderr
