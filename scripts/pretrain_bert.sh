#!/usr/bin/env bash
# Megatron-style BERT pretraining launch. BERT needs a WordPiece vocabulary and data preprocessed with it, split
# into sentences for its binary (sentence-order) head, which is on as in Megatron (EXTRA=--bert-no-binary-head
# turns it off and then takes any data):
#   python scripts/preprocess_data.py --input corpus.jsonl --output-prefix bert --tokenizer-type BertWordPieceLowerCase \
#       --vocab-file vocab.txt --split-sentences --workers 2
#   DATA_PATH=bert_text_sentence VOCAB=vocab.txt bash scripts/pretrain_bert.sh
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-1}
DATA_PATH=${DATA_PATH:?set DATA_PATH to the PREFIX of a BERT-tokenized .bin/.idx}
VOCAB=${VOCAB:?set VOCAB to the WordPiece vocab.txt used for preprocessing}
SAVE=${SAVE:-checkpoints/bert}
NUM_LAYERS=${NUM_LAYERS:-4}; HIDDEN=${HIDDEN:-256}; HEADS=${HEADS:-4}; SEQ=${SEQ:-128}
MICRO=${MICRO:-8}; GLOBAL=${GLOBAL:-$((MICRO * NPROC))}; TRAIN_ITERS=${TRAIN_ITERS:-500}
EXTRA=${EXTRA:-}

exec .venv/bin/torchrun --nproc_per_node "$NPROC" rapidtrain/pretrain_bert.py \
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
    --micro-batch-size "$MICRO" --global-batch-size "$GLOBAL" \
    --train-iters "$TRAIN_ITERS" --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear --lr-warmup-fraction 0.01 \
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234 \
    --data-path "$DATA_PATH" --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" \
    --split "949, 50, 1" --data-impl mmap --mask-prob 0.15 --short-seq-prob 0.1 --num-workers 2 \
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}" --eval-iters "${EVAL_ITERS:-5}" \
    --save "$SAVE" --save-interval "${SAVE_INTERVAL:-200}" --load "$SAVE" \
    $EXTRA
