#!/bin/bash
# Rapidformer's EasyNLP fine-tuning launch script (EasyNLP's examples/rapidformer/run_finetune_easynlp_bert.sh),
# run by rapidtrain. Changed only where a 2-core CPU forces it: a tiny local BERT (PRETRAINED_CHECKPOINT, whose
# sizes the shape flags now give) and local data (DATA_DIR, DATA_NAME) instead of the hub's bert-base-uncased and
# GLUE, sequence length, batch and log interval scaled down. The training script is tests/compat/scripts/
# rapidformer/rf_finetune_easynlp_bert.py.
export LC_ALL=C.UTF-8
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6011}
GPUS_PER_NODE=1
NNODES=1
NODE_RANK=0

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

common_cmd="--task sequence_classification \
            --app-name=text_classify \
            --user-defined-parameters='pretrain_model_name_or_path=${PRETRAINED_CHECKPOINT}' \
            --pretrained-model-name-or-path $PRETRAINED_CHECKPOINT \
            --data-dir ${DATA_DIR} \
            --data-name ${DATA_NAME} \
            --micro-batch-size 8 \
            --global-batch-size 8 \
            --epochs 3 \
            --num-layers 2 \
            --hidden-size 32 \
            --num-attention-heads 2 \
            --max-position-embeddings 128 \
            --seq-length 128 \
            --lr 2e-5 \
            --lr-decay-style linear \
            --lr-warmup-iters 100 \
            --weight-decay 1e-2 \
            --clip-grad 1.0 \
            --seed 42 \
            --log-interval 2 \
            --eval-interval 1000 \

"

python -m torch.distributed.launch $DISTRIBUTED_ARGS ${RAPIDTRAIN_DIR}/tests/compat/scripts/rapidformer/rf_finetune_easynlp_bert.py \
       $common_cmd \
       --mixed-precision
