#!/usr/bin/env bash
# Pretrain a custom (LSTM) model with the PreTrainer template on the built-in demo corpus.
# Extra flags go to rapidtrain, e.g. `--nproc-per-node 2 --bf16 --save /tmp/lstm`.
set -euo pipefail
cd "$(dirname "$0")/../.."
rapidtrain --user-script examples/custom_pretrainer/pretrainer.py \
  --train-iters "${ITERS:-100}" --micro-batch-size 8 --global-batch-size 16 --seq-length 64 \
  --hidden-size 128 --num-layers 1 --lr 3e-3 --lr-warmup-iters 5 --lr-decay-style cosine \
  --log-interval 10 --eval-interval "${ITERS:-100}" --eval-iters 2 --num-workers 0 "$@"
