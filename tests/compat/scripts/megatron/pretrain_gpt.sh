#! /bin/bash

# Megatron-LM's examples/pretrain_gpt.sh (2021 form), run by rapidtrain. Changed only where a 2-core CPU
# forces it: model and batch sizes, iteration counts, the data paths (DATA_PATH, CHECKPOINT_PATH) and
# --distributed-backend gloo; the entry point is rapidtrain/pretrain_gpt.py.

# Runs the "345M" parameter model (here a tiny one)

RANK=${RANK:-0}
WORLD_SIZE=${WORLD_SIZE:-1}

DATA_PATH=${DATA_PATH:-<Specify path and file prefix>_text_document}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-<Specify path>}


python ${RAPIDTRAIN_DIR}/rapidtrain/pretrain_gpt.py \
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
       --vocab-file gpt2-vocab.json \
       --merge-file gpt2-merges.txt \
       --data-impl mmap \
       --split 949,50,1 \
       --distributed-backend gloo \
       --lr 0.00015 \
       --min-lr 1.0e-5 \
       --lr-decay-style cosine \
       --weight-decay 1e-2 \
       --clip-grad 1.0 \
       --lr-warmup-fraction .01 \
       --checkpoint-activations \
       --log-interval 1 \
       --save-interval 3 \
       --eval-interval 3 \
       --eval-iters 2 \
       --fp16
