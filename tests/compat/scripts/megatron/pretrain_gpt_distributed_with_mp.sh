#!/bin/bash

# Megatron-LM's examples/pretrain_gpt_distributed_with_mp.sh (2023 form), run by rapidtrain. Changed only where
# a 2-core CPU forces it: 2 processes (pipeline 2 × tensor 1 instead of 2 × 2, so --sequence-parallel is turned
# off as Megatron does at tensor-parallel size 1), model and batch sizes, iteration counts, data paths, gloo.

# Runs the "345M" parameter model (here a tiny one)

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=2
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=${CHECKPOINT_PATH}
VOCAB_FILE=${VOCAB_FILE}
MERGE_FILE=${MERGE_FILE}
DATA_PATH=${DATA_PATH}

DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

GPT_ARGS="
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 2 \
    --sequence-parallel \
    --num-layers 2 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 64 \
    --max-position-embeddings 64 \
    --micro-batch-size 2 \
    --global-batch-size 8 \
    --lr 0.00015 \
    --train-iters 4 \
    --lr-decay-iters 3 \
    --lr-decay-style cosine \
    --min-lr 1.0e-5 \
    --weight-decay 1e-2 \
    --lr-warmup-fraction .01 \
    --clip-grad 1.0 \
    --fp16
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --split 949,50,1
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 2 \
    --eval-interval 2 \
    --eval-iters 1
"

torchrun $DISTRIBUTED_ARGS ${RAPIDTRAIN_DIR}/rapidtrain/pretrain_gpt.py \
    $GPT_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend gloo \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH
