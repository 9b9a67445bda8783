"""One story per stopped run (issue 25): a rank SIGKILLed, or Ctrl-C, ends in one paragraph that names what
happened, where, the last complete checkpoint and the command that resumes; no traceback; the checkpoint loads.

Real launches of the `rapidtrain` command (2 ranks, tiny GPT, fp32, gloo), each in its own session so the test can
send Ctrl-C to its process group as a terminal does; every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rapidtrain.checkpoint.checkpointer import latest_iteration, verify_checkpoint
from tests.launch import REPO, TINY_GPT_SHAPE, child_env

pytestmark = [pytest.mark.slow]

FLAGS = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-5",
         "--train-iters", "5000", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"]
WAIT = 300


def launch(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "run.log"
    command = [sys.executable, "-m", "rapidtrain.cli", "--nproc-per-node", "2", *FLAGS, *extra]
    # As a terminal's Ctrl-C finds a run: SIGINT at its default. A run started with SIGINT ignored (a background job
    # of a non-interactive shell: a suite started with `cmd &` passes it down to every child) stays deaf to it, by
    # design; this suite ran once that way and both Ctrl-C tests saw the run go on to its end.
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path,
                               env=child_env({"PYTHONUNBUFFERED": "1"}, 2), start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return process, log


def wait_for(log: Path, pattern: str) -> None:
    deadline = time.time() + WAIT
    while not re.search(pattern, log.read_text(errors="replace")):
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def rank_pid(rank: int, marker: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "pretrain.py" in command and marker in command and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} found")


def test_a_killed_rank_is_named_with_the_checkpoint_and_the_resume_command(tmp_path):
    process, log = launch(tmp_path, "--save", "killed", "--save-interval", "5")
    wait_for(log, r"saved checkpoint at iteration\s+10 ")
    os.kill(rank_pid(1, "killed"), signal.SIGKILL)
    assert process.wait(WAIT) == 1
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
    story = [line for line in text.splitlines() if line.startswith("rapidtrain: the run stopped")]
    assert len(story) == 1, text[-4000:]
    assert "rank 1 (local rank 1 of node 0" in story[0] and "killed by SIGKILL" in story[0]
    saved = latest_iteration(tmp_path / "killed")
    assert f"Last complete checkpoint: killed/iter_{saved:07d} (iteration {saved})" in story[0]
    assert story[0].rstrip().endswith("--save killed --save-interval 5 --load killed")
    assert verify_checkpoint(tmp_path / "killed" / f"iter_{saved:07d}")


def test_ctrl_c_saves_and_exits_130_with_the_resume_line(tmp_path):
    process, log = launch(tmp_path, "--save", "interrupted", "--save-interval", "1000", "--num-workers", "2")
    wait_for(log, r"iteration\s+3/")
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
    assert process.wait(WAIT) == 130
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    saved = latest_iteration(tmp_path / "interrupted")
    assert saved is not None and verify_checkpoint(tmp_path / "interrupted" / f"iter_{saved:07d}")
    lines = [line for line in text.splitlines() if line.startswith("rapidtrain: stopped by Ctrl-C")]
    assert len(lines) == 1 and f"iter_{saved:07d}" in lines[0] and "--load interrupted" in lines[0], text[-3000:]
    assert not list((tmp_path / "interrupted").glob("iter_*.tmp"))


def test_a_second_ctrl_c_aborts_at_once_with_one_line(tmp_path):
    process, log = launch(tmp_path, "--save", "aborted", "--save-interval", "1000")
    wait_for(log, r"iteration\s+3/")
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(1.5)  # a person's second press, not the echo of the first
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(WAIT) == 130
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
    assert ("second Ctrl-C" in text) or ("stopped by Ctrl-C" in text)  # the save may have finished before it


def test_the_story_names_the_cause_and_the_resume_command():
    from rapidtrain.core import stopped_run

    assert stopped_run.with_load(["--save", "a", "--load", "b", "--x"], "a") == ["--save", "a", "--x", "--load", "a"]
    assert stopped_run.with_load(["--load=b"], "a") == ["--load", "a"]
    assert stopped_run.flag_value(["--save", "x", "--save=y"], "--save") == "y"
    assert stopped_run.is_lost_contact(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    assert not stopped_run.is_lost_contact(ValueError("shape mismatch"))
    assert stopped_run.last_checkpoint(None) == "none (no --save)"
    assert str(REPO) not in stopped_run.last_checkpoint("nowhere")
