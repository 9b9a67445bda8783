#!/usr/bin/env bash
# Megatron-style GPT pretraining launch, every flag spelled out. Edit the values, or override them from the
# environment (e.g. `NPROC=2 TRAIN_ITERS=50 bash scripts/pretrain_gpt.sh`). Without DATA_PATH it uses the demo corpus.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-1}                  # processes (GPUs) on this node
DATA_PATH=${DATA_PATH:-}           # PREFIX of PREFIX.bin/.idx from scripts/preprocess_data.py (empty: demo corpus)
TOKENIZER_ARGS=${TOKENIZER_ARGS:-} # e.g. "--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt"
SAVE=${SAVE:-checkpoints/gpt}
NUM_LAYERS=${NUM_LAYERS:-4}; HIDDEN=${HIDDEN:-256}; HEADS=${HEADS:-4}; SEQ=${SEQ:-256}
MICRO=${MICRO:-4}; GLOBAL=${GLOBAL:-$((MICRO * NPROC))}; TRAIN_ITERS=${TRAIN_ITERS:-500}
TP=${TP:-1}; PP=${PP:-1}
EXTRA=${EXTRA:-}                   # e.g. "--zero-2-memory-optimization --bf16" or "--checkpoint-activations"

DATA_ARGS=""
if [ -n "$DATA_PATH" ]; then DATA_ARGS="--data-path $DATA_PATH $TOKENIZER_ARGS"; fi

exec .venv/bin/torchrun --nproc_per_node "$NPROC" rapidtrain/pretrain.py \
    --model-type gpt \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
    --micro-batch-size "$MICRO" --global-batch-size "$GLOBAL" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --train-iters "$TRAIN_ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.02 \
    --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 \
    --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234 \
    --split "969, 30, 1" --data-impl mmap --num-workers 2 $DATA_ARGS \
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-5}" \
    --save "$SAVE" --save-interval "${SAVE_INTERVAL:-200}" --load "$SAVE" \
    $EXTRA
