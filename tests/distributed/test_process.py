"""A rank that finished its run ends with its status, whatever native threads are still doing (core/process.py).

The failure it prevents: gloo's worker threads outlive `destroy_process_group` while Python holds the group, and
a thread that drops a finished collective whose tensor Python let go of takes the GIL; once the interpreter
finalizes, CPython ends that thread inside a C++ destructor and the rank dies of SIGABRT ("terminate called
without an active exception") after a run that finished. The script below makes the window wide (collectives
still in flight when its main returns): with a plain exit 9 ranks-pairs in 10 died that way on this machine, with
`exit_after` none. What a normal exit does must still happen: atexit handlers, files left open flushed."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from rapidtrain.core.process import exit_after, exit_code
from tests.launch import torchrun

IN_FLIGHT_AT_EXIT = textwrap.dedent("""
    import atexit, os, sys
    import torch
    import torch.distributed as dist
    from rapidtrain.core.process import exit_after

    def main():
        dist.init_process_group("gloo")
        group = dist.new_group([0, 1])  # held by Python, as DistributedDataParallel or an optimizer holds one
        # Both ranks connected: else one rank could end (its collectives are async) while the other still builds
        # the group's mesh, which then fails with "Connection closed by peer" (seen once in a full run).
        dist.barrier(group=group)
        log = open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.txt"), "w")  # left open, as scripts do
        log.write("written, never closed\\n")
        atexit.register(lambda: print(f"atexit ran on rank {dist.get_rank()}", flush=True))
        for _ in range(8):  # still in flight when main returns; Python has dropped each tensor
            dist.all_reduce(torch.ones(1 << 18), group=group, async_op=True)
        return 0

    exit_after(main, returns_status=True)
""")


# How torchrun starts a rank: a new Python (`python -u script`, its default, twice: the failure was a race), or the
# script run as a function in a process forked or spawned from the agent (`--run-path`), where the agent waits for
# the function to return: a rank that ended itself there left the agent waiting forever after a finished run.
STARTS = {"python": [], "python again": [], "run-path fork": ["--run-path", "--start-method", "fork"],
          "run-path spawn": ["--run-path", "--start-method", "spawn"]}


@pytest.mark.parametrize("start", STARTS)
def test_a_rank_ends_with_its_status_while_collectives_are_in_flight(tmp_path: Path, start: str):
    script = tmp_path / "in_flight.py"
    script.write_text(IN_FLIGHT_AT_EXIT)
    run = torchrun(2, script, [str(tmp_path)], check=False, timeout=300, extra_torchrun=STARTS[start])
    output = run.stdout + run.stderr
    assert "terminate called" not in output, output[-3000:]
    assert run.returncode == 0, output[-3000:]
    assert sorted(re.findall(r"atexit ran on rank \d", run.stdout)) == ["atexit ran on rank 0", "atexit ran on rank 1"]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "written, never closed\n"


@pytest.mark.parametrize("start", ["python", "run-path fork", "run-path spawn"])
def test_a_rank_that_fails_fails_the_launch(tmp_path: Path, start: str):
    """A status other than 0 reaches torchrun however the rank was started, and the launch ends."""
    script = tmp_path / "fails.py"
    script.write_text("from rapidtrain.core.process import exit_after\nexit_after(lambda: 3, returns_status=True)\n")
    run = torchrun(2, script, [], check=False, timeout=120, extra_torchrun=STARTS[start])
    assert run.returncode != 0
    assert "exitcode  : 3" in run.stderr, run.stderr[-3000:]


def test_outside_a_launch_it_exits_as_python_does(monkeypatch):
    """Not a rank (no torchrun variables): a SystemExit with the status, so the interpreter's own exit runs."""
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stopped:
        exit_after(lambda: 4, returns_status=True)
    assert stopped.value.code == 4
    with pytest.raises(SystemExit) as stopped:
        exit_after(lambda: {"loss": 1.0})  # an entry point's results are not a status
    assert stopped.value.code == 0

    def fails():
        raise SystemExit(2)

    with pytest.raises(SystemExit) as stopped:
        exit_after(fails)
    assert stopped.value.code == 2


def test_exit_codes_are_the_interpreters(capsys):
    assert exit_code(None) == 0
    assert exit_code(7) == 7
    assert exit_code("rapidtrain: stopped") == 1
    assert capsys.readouterr().err == "rapidtrain: stopped\n"
