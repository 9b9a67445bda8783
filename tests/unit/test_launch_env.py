"""The launcher's environment checked before the first collective (issue 25 item 3): RANK/WORLD_SIZE/LOCAL_RANK
consistent, the master address resolvable, the master port free; stale variables do not make a launch."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from rapidtrain.core.launch_env import (
    LaunchEnvironmentError,
    check_rank_environment,
    drop_stale_rank_variables,
    launched_rank,
)
from tests.launch import PRETRAIN, REPO, TINY_GPT_SHAPE, child_env, free_port

TINY = [*TINY_GPT_SHAPE, "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0"]


@pytest.mark.parametrize("env, named", [
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 with WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such-host.invalid"),
])
def test_inconsistent_rank_variables_are_named(env, named):
    with pytest.raises(LaunchEnvironmentError, match=named.replace("(", r"\(")):
        check_rank_environment(env)


def test_consistent_variables_pass():
    check_rank_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_stale_variables_are_not_a_launch_and_are_dropped():
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "PATH": "/bin"}
    assert not launched_rank(env)
    assert drop_stale_rank_variables(env) == ["WORLD_SIZE=2", "LOCAL_RANK=0"] and env == {"PATH": "/bin"}
    full = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launched_rank(full) and drop_stale_rank_variables(dict(full)) == []


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env(env))


@pytest.mark.slow
def test_a_rank_beyond_the_world_exits_2_instead_of_hanging():
    env = {"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    result = run([sys.executable, str(PRETRAIN), *TINY], env)
    assert result.returncode == 2 and "RANK=3 with WORLD_SIZE=2" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_busy_master_port_is_refused_by_the_launcher():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run([sys.executable, "-m", "rapidtrain.cli", *TINY],
                     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NNODES": "1", "NODE_RANK": "0"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"MASTER_PORT={port} is in use" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_stale_world_size_does_not_make_the_launcher_run_in_place():
    result = run([sys.executable, "-m", "rapidtrain.cli", "--nproc-per-node", "1", *TINY],
                 {"WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ignoring WORLD_SIZE=2, LOCAL_RANK=0" in result.stderr
    assert re.search(r"iteration\s+1/\s+1 ", result.stdout)
