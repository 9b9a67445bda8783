#!/usr/bin/env bash
# The main job, from a fresh machine: set up, then pretrain the demo GPT on the built-in demo corpus (about five
# minutes on 2 CPU cores); it ends with the loss against a frequencies-only baseline, two samples and the loss curve.
# The run's files go to runs/demo-DATE-TIME (RUN=DIR to choose). Extra flags are passed to pretrain.py, e.g.
# `bash scripts/demo.sh --train-iters 1000`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RUN=${RUN:-runs/demo-$(date +%Y%m%d-%H%M%S)}
exec .venv/bin/torchrun --nproc_per_node "${NPROC:-1}" rapidtrain/pretrain.py --mixed-precision --save "$RUN/checkpoint" \
    --tensorboard-dir "$RUN/logs" "$@"
