"""Test session settings: one demo-corpus cache per run (built once), small thread counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("RAPIDTRAIN_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "tests"))
os.environ.setdefault("RAPIDTRAIN_CACHE", str(CACHE / "rapidtrain"))
# Under pytest-xdist (`-n 2`, what scripts/test.sh runs) each worker gets its share of the cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // WORKERS)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than ~20 s (multi-process or long training)")


@pytest.fixture(scope="session")
def demo_data():
    """The built-in demo corpus, prepared once per test session."""
    from rapidtrain.data.demo import prepare_demo_data

    return prepare_demo_data(progress=False)
