"""Test session settings: one demo-corpus cache per run (built once), small thread counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rapidtrain.parallel.op_build import use_environment_build_tools
from tests._cpu_time import register as register_cpu_time_report

CACHE = Path(os.environ.get("RAPIDTRAIN_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "tests"))
os.environ.setdefault("RAPIDTRAIN_CACHE", str(CACHE / "rapidtrain"))
# Under pytest-xdist (`-n 2`, what scripts/test.sh runs) each worker gets its share of the cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // WORKERS)))
# Idle OpenMP threads sleep instead of spinning (every process the tests start inherits it): where a process has more
# than one thread (`-n 0`, TEST_WORKERS=0, more cores per worker) on a host loaded by other processes, the spinning
# threads take the cores from the ones working. A 10-iteration tiny-GPT run in-process at 2 threads on the shared
# 2-core host: 6.8-18.6 CPU-s and 25-57 s by default, 0.5-0.6 CPU-s and 0.6-1.9 s passive (interleaved, 2 rounds).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# DeepSpeed's ops in the folder where scripts/setup.sh and rapidtrain's runs build them (this environment's own,
# parallel/op_build.py), for the tests and scripts that load one without an Engine (DeepSpeedCPUAdam, DeepSpeed's
# checkpoint writer): they find the ops built instead of compiling them again in the shared default folder.
use_environment_build_tools()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than ~20 s (multi-process or long training)")
    register_cpu_time_report(config)  # RAPIDTRAIN_TEST_CPU_REPORT=PATH: CPU seconds per test file (tests/_cpu_time.py)


@pytest.fixture(scope="session")
def demo_data():
    """The built-in demo corpus, prepared once per test session."""
    from rapidtrain.data.demo import prepare_demo_data

    return prepare_demo_data(progress=False)


# Under xdist a file is one unit of work (--dist loadfile), handed to whichever worker runs short of tests, in
# collection order; scripts/test.sh passes --no-loadscope-reorder so that xdist keeps this order. Starting the costliest
# files first (longest-first list scheduling) keeps one worker from running a long file alone at the end: in the last
# full run before this ordering was measured, the two workers' CPU seconds were 1,182 and 1,398. The costs are CPU
# seconds per file from a full run's RAPIDTRAIN_TEST_CPU_REPORT (tests/_cpu_time.py writes them; `python -m
# tests._cpu_time REPORT.gw0 REPORT.gw1 > tests/file_costs.txt` refreshes the table). A file the table does not know
# yet (a new one) goes first: its cost is unknown, and a short file run early costs the schedule nothing.
FILE_COSTS = Path(__file__).resolve().parent / "file_costs.txt"


def _file_costs() -> dict[str, float]:
    if not FILE_COSTS.exists():
        return {}
    costs = {}
    for line in FILE_COSTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, name = line.split()
            costs[name] = float(seconds)
    return costs


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    costs = _file_costs()
    # Stable sort: a file's tests keep their order (module fixtures are built once per file).
    items.sort(key=lambda item: -costs.get(item.nodeid.split("::")[0], float("inf")))
