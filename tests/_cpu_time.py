"""CPU seconds per test and per test file (RAPIDTRAIN_TEST_CPU_REPORT=PATH): what the suite costs on a loaded host.

Wall time on a shared 2-core machine moves with everyone else's load; the CPU time a test spends (this process's
plus every child it waited for: torchrun, its ranks, `python -m rapidtrain ...`) moves far less, and it is what the
suite's 20-minute budget on 2 cores is made of. Each phase (setup, where module fixtures run their shared launches;
call; teardown) is measured as a getrusage(RUSAGE_SELF) + getrusage(RUSAGE_CHILDREN) delta, user + system. Under
xdist each worker writes PATH.gwN. Run a slice with `-n 0` and read the per-file table at the top of PATH; with
PYTEST_XDIST_WORKER_COUNT=2 set, the slice's processes get the thread counts they get under CI's two workers
(tests/conftest.py, tests/launch.py): on a loaded host, idle OpenMP threads spin, and a 2-thread in-process run of the
tiny GPT took 25 CPU-s against 1.7 at one thread.
"""

from __future__ import annotations

import os
import resource
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

ENV = "RAPIDTRAIN_TEST_CPU_REPORT"


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its terminated, waited-for descendants."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


class CpuTimeReport:
    """Collects each phase's CPU seconds and writes the per-file and per-item tables at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: dict[str, dict[str, float]] = defaultdict(dict)
        self.started = cpu_seconds()
        self.collection = 0.0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection(self) -> Generator[None, None, None]:
        before = cpu_seconds()
        yield
        self.collection = cpu_seconds() - before

    def _phase(self, item: pytest.Item, phase: str) -> Generator[None, None, None]:
        before = cpu_seconds()
        yield
        self.items[item.nodeid][phase] = cpu_seconds() - before

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        yield from self._phase(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        yield from self._phase(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        yield from self._phase(item, "teardown")

    def pytest_sessionfinish(self) -> None:
        files: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for nodeid, phases in self.items.items():
            files[nodeid.split("::")[0]] += sum(phases.values())
            counts[nodeid.split("::")[0]] += 1
        measured = sum(files.values())
        session = cpu_seconds() - self.started
        lines = [f"# CPU seconds (user+sys, this process + waited-for children); session {session:.1f}, "
                 f"collection {self.collection:.1f}, tests {measured:.1f}",
                 "# per file: cpu_s  tests  file"]
        lines += [f"{seconds:9.1f} {counts[name]:6d}  {name}"
                  for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])]
        lines.append("# per item and phase: cpu_s  phase  nodeid")
        rows = [(seconds, phase, nodeid) for nodeid, phases in self.items.items() for phase, seconds in phases.items()]
        lines += [f"{seconds:9.2f} {phase:8s}  {nodeid}" for seconds, phase, nodeid in sorted(rows, reverse=True)
                  if seconds >= 0.05]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(lines) + "\n")


def register(config: pytest.Config) -> None:
    """Turn the report on when RAPIDTRAIN_TEST_CPU_REPORT names a file (tests/conftest.py calls this)."""
    target = os.environ.get(ENV)
    if not target:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = Path(target + (f".{worker}" if worker else ""))
    config.pluginmanager.register(CpuTimeReport(path), "rapidtrain-cpu-time")


def merge(reports: list[Path]) -> str:
    """The per-file table of one or more reports (a full run's PATH.gw0, PATH.gw1) as tests/file_costs.txt lines."""
    files: dict[str, float] = defaultdict(float)
    for report in reports:
        lines = report.read_text().splitlines()
        for line in lines[2:lines.index("# per item and phase: cpu_s  phase  nodeid")]:
            seconds, _count, name = line.split()
            files[name] += float(seconds)
    header = ("# CPU seconds per test file in a full run (tests/_cpu_time.py); tests/conftest.py starts the costliest "
              "first.\n")
    ranked = sorted(files.items(), key=lambda kv: -kv[1])
    return header + "".join(f"{seconds:8.1f} {name}\n" for name, seconds in ranked)


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m tests._cpu_time REPORT [REPORT ...] > tests/file_costs.txt\n"
              "Merges the per-file CPU tables of a full run's reports (RAPIDTRAIN_TEST_CPU_REPORT=REPORT: REPORT.gw0, "
              "REPORT.gw1) into the table tests/conftest.py orders test files by.")
        sys.exit(0 if len(sys.argv) > 1 else 2)
    sys.stdout.write(merge([Path(name) for name in sys.argv[1:]]))
