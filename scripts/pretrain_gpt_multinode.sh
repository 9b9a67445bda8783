#!/usr/bin/env bash
# Multi-node GPT pretraining through the `rapidtrain` command with Rapidformer's environment. Run on every node:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=6000 bash scripts/pretrain_gpt_multinode.sh   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=6000 bash scripts/pretrain_gpt_multinode.sh   # node 1
# `rapidtrain` starts torchrun itself with --nnodes $NNODES --node-rank $NODE_RANK --master-addr/--master-port.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?}" "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${MASTER_PORT:?}"
export NNODES NODE_RANK MASTER_ADDR MASTER_PORT

exec .venv/bin/rapidtrain --task pretraining --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 32 --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 1 --global-batch-size "${GLOBAL:-64}" \
    --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-2}" --zero-1-memory-optimization \
    --mixed-precision --checkpoint-activations \
    --train-iters 100000 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --data-path "${DATA_PATH:?}" --tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB:?}" --merge-file "${MERGES:?}" \
    --split "969, 30, 1" --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save checkpoints/gpt-1.3b --save-interval 1000 --load checkpoints/gpt-1.3b --tensorboard-dir runs/gpt-1.3b
