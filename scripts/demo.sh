#!/usr/bin/env bash
# The main job, from a fresh machine: set up, then pretrain the demo GPT on the built-in demo corpus.
# Extra flags are passed to pretrain.py, e.g. `bash scripts/demo.sh --train-iters 500 --bf16`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchrun --nproc_per_node "${NPROC:-1}" rapidtrain/pretrain.py --train-iters 200 "$@"
