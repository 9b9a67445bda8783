"""A DataLoader worker killed on a one-node run is told as that (which rank lost it, the likely causes, the fix),
by the rank and by the launcher, not as "a bug in rapidtrain" or "lost contact with a rank of another node". One real
launch of the `rapidtrain` command; only processes of this launch's own tree are signalled."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.e2e import test_stopped_run as stopped
from tests.e2e.test_signals import processes_under

pytestmark = [pytest.mark.slow]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _runs_pretrain(pid: int) -> bool:
    return b"pretrain.py" in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_killed_loader_worker_is_named_as_the_cause(tmp_path, monkeypatch, demo_data):
    flags = list(stopped.FLAGS)
    flags[flags.index("--num-workers") + 1] = "1"
    monkeypatch.setattr(stopped, "FLAGS", flags)
    process, log = stopped.launch(tmp_path, "--save", "ck", "--save-interval", "1000")
    try:
        stopped.wait_for(log, r"iteration\s+3/")
        tree = processes_under(process.pid)  # this launch only: the launcher, its torchrun, the ranks, their workers
        ranks = {pid for pid in tree if _runs_pretrain(pid) and not _runs_pretrain(_parent(pid))}
        workers = sorted(pid for pid in tree if _parent(pid) in ranks and _runs_pretrain(pid))
        assert workers, tree
        os.kill(workers[0], signal.SIGKILL)
        assert process.wait(stopped.WAIT) == 1
    finally:
        for pid in processes_under(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    told = [line for line in text.splitlines() if line.startswith("rapidtrain:") and "DataLoader worker" in line]
    assert any("a DataLoader worker of rank" in line and "--num-workers" in line for line in told), text[-4000:]
    story = [line for line in text.splitlines() if line.startswith("rapidtrain: the run stopped")]
    assert any("lost a DataLoader worker" in line for line in story), text[-4000:]
    assert "another node" not in text and "a bug" not in text and "Traceback" not in text, text[-4000:]
