#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, multi-process gloo, end to end) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check rapidtrain tests scripts bench examples templates
# Types of the whole package (check_untyped_defs), the runner protocol every engine implements included
# (parallel.runner.Runner, checked where parallelize returns each runner); [tool.mypy] in pyproject.toml.
.venv/bin/python -m mypy rapidtrain
# Two pytest workers (TEST_WORKERS): a test file stays on one worker (its module fixtures are built once), and each
# worker's processes share the cores (tests/conftest.py); TEST_WORKERS=0 runs in one process.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
