"""Two nodes on one host (issue 25 items 5 and 7): two `torchrun --nnodes 2` launches, each in its own working
folder. A relative --save is then node-local and refused naming --save; with a shared --save a rank killed at a
random moment (seeded) ends in one story naming it, and the last checkpoint loads."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rapidtrain.checkpoint.checkpointer import latest_iteration, verify_checkpoint
from tests.launch import PRETRAIN, TINY_GPT_SHAPE, child_env, free_port

pytestmark = [pytest.mark.slow]

FLAGS = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-5",
         "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"]
WAIT = 300


def start_nodes(tmp_path: Path, args: list[str]) -> list[tuple[subprocess.Popen, Path]]:
    port, nodes = free_port(), []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        log = folder / "out.log"
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), str(PRETRAIN),
                   *FLAGS, *args]
        nodes.append((subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=folder,
                                       env=child_env({"PYTHONUNBUFFERED": "1"}, 2), start_new_session=True), log))
    return nodes


def test_a_node_local_save_folder_is_refused_naming_save(tmp_path):
    nodes = start_nodes(tmp_path, ["--train-iters", "8", "--save", "checkpoints", "--save-interval", "4"])
    codes = [process.wait(WAIT) for process, _ in nodes]
    text = "".join(log.read_text() for _, log in nodes)
    assert codes == [1, 1], text[-3000:]  # bare torchrun's status for a failed worker
    assert "rapidtrain: error: --save checkpoints is not one folder for every node: node 1" in text
    assert "does not exist" not in text and only_torchruns_traceback([log.read_text() for _, log in nodes])


def only_torchruns_traceback(texts: list[str]) -> bool:
    """No rank printed a traceback: each log holds at most bare torchrun's own (its ChildFailedError summary)."""
    return all(text.count("Traceback (most recent call last)") <= text.count("raise ChildFailedError(")
               and "]: Traceback" not in text for text in texts)


def rank_pids(nodes) -> dict[int, int]:
    """Each node's rank (one per node here): global rank → pid, from the children of each torchrun."""
    from rapidtrain.core.shutdown import child_pids

    found = {}
    for rank, (process, _) in enumerate(nodes):
        children = child_pids(process.pid)
        assert children, f"node {rank} has no rank"
        found[rank] = children[0]
    return found


def test_chaos_a_rank_killed_at_a_random_moment_is_named_and_the_checkpoint_loads(tmp_path):
    chance = random.Random(25)  # seeded: the same victim and moment on every run of the suite
    victim, moment = chance.choice([0, 1]), chance.uniform(0.5, 3.0)
    save = tmp_path / "shared"
    nodes = start_nodes(tmp_path, ["--train-iters", "5000", "--save", str(save), "--save-interval", "3"])
    logs = [log for _, log in nodes]
    deadline = time.time() + WAIT
    while not re.search(r"saved checkpoint at iteration\s+3 ", "".join(log.read_text() for log in logs)):
        assert time.time() < deadline and all(p.poll() is None for p, _ in nodes), logs[0].read_text()[-3000:]
        time.sleep(0.3)
    time.sleep(moment)
    os.kill(rank_pids(nodes)[victim], signal.SIGKILL)
    codes = [process.wait(WAIT) for process, _ in nodes]
    texts = [log.read_text() for log in logs]
    assert codes == [1, 1], texts
    assert "exitcode  : -9" in texts[victim] and only_torchruns_traceback(texts), texts
    survivor = 1 - victim
    story = [line for line in texts[survivor].splitlines() if line.startswith("rapidtrain: the run stopped")]
    assert len(story) == 1 and f"rank {survivor} (local rank 0 of node {survivor}" in story[0], texts[survivor]
    saved = latest_iteration(save)
    assert saved is not None and saved % 3 == 0 and f"iter_{saved:07d} (iteration {saved})" in story[0]
    assert f"--load {save}" in story[0]
    assert verify_checkpoint(save / f"iter_{saved:07d}")
    resumed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                              f"--master-port={free_port()}", str(PRETRAIN), *FLAGS, "--train-iters", "5000",
                              "--exit-interval", str(saved + 1),
                              "--save", str(save), "--load", str(save)],
                             capture_output=True, text=True, timeout=WAIT, env=child_env(None, 1))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {save} at iteration {saved}" in resumed.stdout
