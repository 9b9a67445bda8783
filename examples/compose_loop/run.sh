#!/usr/bin/env bash
# Your own loop with Engine.compose on a GLUE-style folder (made locally first).
# Extra flags go to rapidtrain, e.g. `--nproc-per-node 2 --oss-memory-optimization`.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/rapidtrain-glue}
python examples/glue_classification/make_data.py "$WORK"
rapidtrain --user-script examples/compose_loop/train_loop.py --data-dir "$WORK/glue" --data-name sst2 \
  --epochs "${EPOCHS:-3}" --micro-batch-size 16 --global-batch-size 32 --lr 1e-2 --lr-warmup-iters 2 \
  --num-workers 0 "$@"
