"""The story of a stopped run names the cause (issue 44 item 5): a collective that timed out (which rank waited in
which collective, called from where), a DataLoader worker that died, and a cache folder that cannot be written (a
user error naming the variable that moves it), each instead of "lost contact", "killed by SIGKILL (by a user...)"
or "a bug in rapidtrain"."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from rapidtrain.core import stopped_run
from tests.launch import torchrun

TIMED_OUT = Path(__file__).resolve().parents[1] / "distributed" / "timed_out_collective.py"


def test_a_rank_that_times_out_in_a_collective_names_it_and_where_rapidtrain_called_it():
    result = torchrun(2, TIMED_OUT, [], check=False, timeout=120)
    output = result.stdout + result.stderr
    line = next((text for text in output.splitlines() if "waited longer than the timeout" in text), "")
    assert "rank 0 " in line and "in all_gather_object, called from rapidtrain/train/agreement.py:" in line, output
    assert "(agree_on_configuration)" in line and "never joined it" in line
    assert "lost contact" not in output and "a bug" not in output


def failure(tmp_path: Path, rank: int, exitcode: int, kind: str | None) -> ProcessFailure:
    path = tmp_path / f"error_{rank}.json"
    if kind is not None:
        path.write_text(json.dumps({"message": "told", "timestamp": 0, "rapidtrain": {"kind": kind, "rank": rank,
                                                                                       "iteration": 7}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_the_launcher_tells_a_rank_stopped_after_others_timed_out_as_hung_not_as_killed_by_a_user(tmp_path):
    failures = {0: failure(tmp_path, 0, stopped_run.EXIT_LOST_CONTACT, "collective_timeout"),
                1: failure(tmp_path, 1, -signal.SIGKILL, None)}
    story = stopped_run.launcher_story(failures, None, "0")
    assert "rank 0 timed out in a collective (said above) waiting for rank 1 of node 0" in story
    assert "hung, not dead" in story and "by a user" not in story and "out-of-memory" not in story


def test_the_launcher_tells_a_lost_loader_worker(tmp_path):
    failures = {1: failure(tmp_path, 1, 1, "loader_worker"), 0: failure(tmp_path, 0, stopped_run.EXIT_LOST_CONTACT,
                                                                          "lost_contact")}
    story = stopped_run.launcher_story(failures, None, "0")
    assert "rank 1 (local rank 1 of node 0, pid 101) lost a DataLoader worker" in story
    assert "another node" not in story


@pytest.mark.parametrize("message", ["DataLoader worker (pid(s) 4482) exited unexpectedly",
                                     "DataLoader worker (pid 4482) is killed by signal: Killed."])
def test_a_rank_whose_loader_worker_died_says_so_without_a_traceback(message, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    try:
        raise RuntimeError(message)
    except RuntimeError as error:
        status = stopped_run.rank_failed(error)
    told = capsys.readouterr().err
    assert status == 1 and "a DataLoader worker of rank 0" in told and "pid 4482" in told
    assert "--num-workers" in told and "Traceback" not in told and "a bug" not in told


@pytest.mark.parametrize(("folder", "variable"), [
    (".cache/torch_extensions/py311_cpu/cpu_adam", "TORCH_EXTENSIONS_DIR"), (".triton/cache", "TRITON_CACHE_DIR"),
    (".cache/rapidtrain/demo-v3", "XDG_CACHE_HOME")])
def test_an_unwritable_cache_is_a_user_error_naming_the_variable_that_moves_it(folder, variable, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    path = os.path.join(os.path.expanduser("~"), folder)
    try:
        try:
            raise PermissionError(errno.EROFS, "Read-only file system", path)
        except PermissionError as cause:
            raise RuntimeError("Error building extension 'cpu_adam'") from cause
    except RuntimeError as error:
        status = stopped_run.rank_failed(error)
    told = capsys.readouterr().err
    assert status == 2 and f"cannot write {path} (Read-only file system)" in told
    assert f"Set {variable}=" in told and "Traceback" not in told and "a bug" not in told
