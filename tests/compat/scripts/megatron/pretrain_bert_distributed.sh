#!/bin/bash

# Megatron-LM's examples/pretrain_bert_distributed.sh (2021 form), run by rapidtrain. Changed only where a
# 2-core CPU forces it: 2 processes, model and batch sizes, iteration counts, data paths and gloo.

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

DATA_PATH=${DATA_PATH:-<Specify path and file prefix>_text_sentence}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-<Specify path>}
VOCAB_FILE=${VOCAB_FILE:-bert-vocab.txt}

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

python -m torch.distributed.launch $DISTRIBUTED_ARGS \
       ${RAPIDTRAIN_DIR}/rapidtrain/pretrain_bert.py \
       --num-layers 2 \
       --hidden-size 64 \
       --num-attention-heads 4 \
       --micro-batch-size 2 \
       --global-batch-size 8 \
       --seq-length 64 \
       --max-position-embeddings 64 \
       --train-iters 4 \
       --save $CHECKPOINT_PATH \
       --load $CHECKPOINT_PATH \
       --data-path $DATA_PATH \
       --vocab-file $VOCAB_FILE \
       --data-impl mmap \
       --split 949,50,1 \
       --distributed-backend gloo \
       --lr 0.0001 \
       --lr-decay-style linear \
       --min-lr 1.0e-5 \
       --lr-decay-iters 4 \
       --weight-decay 1e-2 \
       --clip-grad 1.0 \
       --lr-warmup-fraction .01 \
       --log-interval 1 \
       --save-interval 2 \
       --eval-interval 2 \
       --eval-iters 1 \
       --fp16
