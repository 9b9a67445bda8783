#!/usr/bin/env bash
# Black-box fine-tuning: a (tiny, locally made) BERT on a GLUE-style SST-2 folder, with mixed precision.
# Extra flags go to rapidtrain, e.g. `bash examples/glue_classification/run.sh --nproc-per-node 2
# --zero-2-memory-optimization`. The best and last models land in $WORK/out/{best,last}.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/rapidtrain-glue}
python examples/glue_classification/make_data.py "$WORK"
rapidtrain --task sequence_classification \
  --pretrained-model-name-or-path "$WORK/tiny-bert" --data-dir "$WORK/glue" --data-name sst2 \
  --epochs "${EPOCHS:-3}" --micro-batch-size 16 --global-batch-size 32 --seq-length 32 \
  --lr 3e-3 --lr-warmup-fraction 0.1 --lr-decay-style linear --weight-decay 0.01 --clip-grad 1.0 \
  --seed 42 --num-workers 0 --log-interval 10 --mixed-precision --save "$WORK/out" --load "$WORK/out" "$@"
