#!/usr/bin/env bash
# The same fine-tuning, white-box: templates/finetuner_template.py (a Finetuner subclass) as --user-script.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/rapidtrain-glue}
python examples/glue_classification/make_data.py "$WORK"
rapidtrain --user-script templates/finetuner_template.py \
  --pretrained-model-name-or-path "$WORK/tiny-bert" --data-dir "$WORK/glue" --data-name sst2 \
  --epochs "${EPOCHS:-3}" --micro-batch-size 16 --global-batch-size 32 --seq-length 32 \
  --lr 3e-3 --lr-warmup-fraction 0.1 --num-workers 0 --log-interval 10 --save "$WORK/out-white-box" --load "$WORK/out-white-box" "$@"
