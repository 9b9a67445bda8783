#!/bin/bash

# Megatron-LM's examples/pretrain_bert.sh (2021 form), run by rapidtrain. Changed only where a 2-core CPU
# forces it: model and batch sizes, iteration counts and the data paths; the entry point is
# rapidtrain/pretrain_bert.py (BERT's binary head is on, as in Megatron: the data is sentence-split).

RANK=${RANK:-0}
WORLD_SIZE=${WORLD_SIZE:-1}
DATA_PATH=${DATA_PATH:-<Specify path and file prefix>_text_sentence}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-<Specify path>}
VOCAB_FILE=${VOCAB_FILE:-bert-vocab.txt}

python ${RAPIDTRAIN_DIR}/rapidtrain/pretrain_bert.py \
       --num-layers 2 \
       --hidden-size 64 \
       --num-attention-heads 4 \
       --micro-batch-size 2 \
       --global-batch-size 4 \
       --seq-length 64 \
       --max-position-embeddings 64 \
       --train-iters 6 \
       --lr-decay-iters 5 \
       --save $CHECKPOINT_PATH \
       --load $CHECKPOINT_PATH \
       --data-path $DATA_PATH \
       --vocab-file $VOCAB_FILE \
       --data-impl mmap \
       --split 949,50,1 \
       --lr 0.0001 \
       --min-lr 0.00001 \
       --lr-decay-style linear \
       --lr-warmup-fraction .01 \
       --weight-decay 1e-2 \
       --clip-grad 1.0 \
       --log-interval 1 \
       --save-interval 3 \
       --eval-interval 3 \
       --eval-iters 2 \
       --fp16
