"""A rank with a process group never forks its DataLoader workers itself (its gloo threads make a fork deadlock
now and then on CPython 3.11.7): they come from the forkserver, with memory maps sent by path; what cannot be
sent there (a lambda, a class of the user's `__main__`) keeps the fork, as does a process without a group."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rapidtrain.core.shutdown import ignore_sigterm_in_worker
from rapidtrain.data.loaders import shutdown_workers
from rapidtrain.data.worker_start import FORK_DEADLOCKS, WorkerLoader, sends_to_forkserver, worker_context
from tests.launch import REPO, child_env

# Only interpreters with the after-fork deadlock (gh-112275) start a rank's workers from the forkserver.
FORKSERVER = pytest.mark.skipif(not FORK_DEADLOCKS, reason="this interpreter forks safely: workers are forked")


class MappedRows(torch.utils.data.Dataset):
    """Rows of a read-only .npy memory map, as the index cache serves them."""

    def __init__(self, path: Path) -> None:
        self.rows = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.rows[index]))


@pytest.fixture
def rows(tmp_path) -> Path:
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(64 * 1024, dtype=np.int64).reshape(-1, 16))
    return path


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo group, as a rank has: its threads are what makes a fork unsafe."""
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_without_a_process_group_workers_are_forked(rows):
    assert worker_context(MappedRows(rows), None, 2) is None
    assert worker_context(MappedRows(rows), None, 0) is None


@FORKSERVER
def test_a_rank_starts_its_workers_from_the_forkserver(rows, process_group):
    dataset = MappedRows(rows)
    context = worker_context(dataset, None, 2)
    assert context is not None and context.get_start_method() == "forkserver"
    loader = WorkerLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True,
                          worker_init_fn=ignore_sigterm_in_worker, multiprocessing_context=context)
    iterator = iter(loader)
    try:
        batches = [next(iterator) for _ in range(3)]
        workers = [worker.pid for worker in iterator._workers]
        assert all(_parent(pid) != os.getpid() for pid in workers)  # forked by the server, not by this rank
    finally:
        shutdown_workers(loader)
    assert torch.equal(torch.cat(batches), torch.from_numpy(np.array(dataset.rows[:12])))


@FORKSERVER
def test_what_the_forkserver_cannot_receive_keeps_the_fork(rows, process_group, capsys):
    def collate(batch):
        return batch

    collate.__module__ = "__main__"  # defined in the user's script: a worker would have to run it again
    assert not sends_to_forkserver(collate)
    assert worker_context(MappedRows(rows), collate, 2) is None
    assert worker_context(MappedRows(rows), lambda batch: batch, 2) is None  # lambdas do not pickle
    assert worker_context(MappedRows(rows), torch.stack, 2) is not None
    told = capsys.readouterr().err
    assert told.count("DataLoader workers are forked from the rank") == 1 and "(__main__)" in told


def test_a_file_map_travels_by_path_and_a_view_as_a_copy(rows):
    mapped = np.load(rows, mmap_mode="r")
    sent = bytes(ForkingPickler.dumps(mapped))
    assert len(sent) < 1024 < mapped.nbytes
    received = pickle.loads(sent)
    assert isinstance(received, np.memmap) and received.filename == mapped.filename
    assert np.array_equal(received, mapped)
    view = pickle.loads(bytes(ForkingPickler.dumps(mapped[3:7, 2:5])))
    assert np.array_equal(view, mapped[3:7, 2:5])


FORKED_SERVER = """
import os, sys
from pathlib import Path
import numpy as np, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from rapidtrain.data.loaders import shutdown_workers
from rapidtrain.data.worker_start import WorkerLoader, start_worker_server, worker_context
from tests.unit.test_worker_start import MappedRows, _parent

assert start_worker_server()
assert not start_worker_server()  # one per rank
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
dataset = MappedRows(Path(sys.argv[1]))
loader = WorkerLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=worker_context(dataset, None, 2))
iterator = iter(loader)
batches = [next(iterator) for _ in range(3)]
servers = {_parent(worker.pid) for worker in iterator._workers}
shutdown_workers(loader)
assert torch.equal(torch.cat(batches), torch.from_numpy(np.array(dataset.rows[:12])))
(server,) = servers
assert server != os.getpid() and _parent(server) == os.getpid()  # forked by a server this rank forked
print("server command:", Path(f"/proc/{server}/cmdline").read_bytes().replace(b"\\0", b" ").decode())
dist.destroy_process_group()
"""


@FORKSERVER
def test_the_engines_server_is_forked_from_the_rank_before_its_process_group(rows, tmp_path):
    """start_worker_server (called by the Engine before init_distributed): the workers' server is a fork of the
    rank (the rank's own command line, torch already imported), not a second interpreter importing torch."""
    script = tmp_path / "forked_server.py"
    script.write_text(FORKED_SERVER)
    run = subprocess.run([sys.executable, str(script), str(rows), str(REPO)], capture_output=True, text=True,
                         timeout=120, env=child_env())
    assert run.returncode == 0, run.stdout + run.stderr
    command = run.stdout.split("server command:", 1)[1].strip()
    assert command.endswith(f"forked_server.py {rows} {REPO}") and "multiprocessing.forkserver" not in command
