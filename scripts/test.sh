#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, multi-process gloo, end to end) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check rapidtrain tests scripts bench examples templates
# Types: the pure layers (config, data) and the runner protocol every engine implements (parallel.runner.Runner,
# checked where parallelize returns each runner); [tool.mypy] in pyproject.toml.
.venv/bin/python -m mypy rapidtrain/config rapidtrain/data rapidtrain/parallel/runner.py rapidtrain/parallel/apply.py rapidtrain/train/engine.py
exec .venv/bin/python -m pytest "$@"
