"""Test session settings: one demo-corpus cache per run (built once), small thread counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than ~20 s (multi-process or long training)")
    register_cpu_time_report(config)  # RAPIDTRAIN_TEST_CPU_REPORT=PATH: CPU seconds per test file (tests/_cpu_time.py)


@pytest.fixture(scope="session")
def demo_data():
    """The built-in demo corpus, prepared once per test session."""
    from rapidtrain.data.demo import prepare_demo_data

    return prepare_demo_data(progress=False)


# The test files that take longest (a full run's --durations, summed per file, on the 2-core machine). Under xdist
# a file is one unit of work (--dist loadfile) handed out in collection order; starting the longest first keeps
# one worker from running a long file alone at the end (longest-first list scheduling). scripts/test.sh passes
# --no-loadscope-reorder so that xdist keeps this order instead of sorting files by their number of tests.
LONGEST_FIRST = (
    "tests/e2e/test_pretrain.py",
    "tests/e2e/test_readme.py",
    "tests/distributed/test_zero.py",
    "tests/compat/test_launch_runs.py",
    "tests/e2e/test_signals.py",
    "tests/e2e/test_finetune_tasks.py",
    "tests/distributed/test_expert_parallel.py",
    "tests/distributed/test_data_parallel.py",
    "tests/distributed/test_zero_infinity.py",
    "tests/e2e/test_plan_matches_run.py",
    "tests/distributed/test_per_token_loss.py",
    "tests/e2e/test_examples.py",
    "tests/e2e/test_benches.py",
    "tests/distributed/test_memory_estimate.py",
    "tests/distributed/test_pipeline_parallel.py",
    "tests/distributed/test_resume_search_layouts.py",
    "tests/e2e/test_resume_search.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
