#!/bin/bash

# Megatron-LM's examples/pretrain_gpt3_175B.sh (2021 form), run by rapidtrain. Changed only where a 2-core CPU
# forces it: torchrun with 2 processes stands in for srun (no Slurm here), tensor 2 × pipeline 1 instead of
# 8 × 16, model, batch and sample counts scaled down, local data. Kept: the weighted blend of three datasets,
# the batch-size ramp-up, sample-based training and schedule, --split 98,2,0, TensorBoard.


#SBATCH <SLURM OPTIONS> --nodes=128 --exclusive --ntasks-per-node=8 --job-name=megatron_gpt3_175b


DIR=`pwd`
DATETIME=`date +'date_%y-%m-%d_time_%H-%M-%S'`
mkdir -p $DIR/logs


DATASET_1=${DATASET_1:-"<PATH TO THE FIRST DATASET>"}
DATASET_2=${DATASET_2:-"<PATH TO THE SECOND DATASET>"}
DATASET_3=${DATASET_3:-"<PATH TO THE THIRD DATASET>"}
DATASET="0.2 ${DATASET_1} 0.3 ${DATASET_2} 0.5 ${DATASET_3}"


options=" \
	--tensor-model-parallel-size 2 \
	--pipeline-model-parallel-size 1 \
        --num-layers 2 \
        --hidden-size 64 \
        --num-attention-heads 4 \
        --seq-length 64 \
        --max-position-embeddings 64 \
	--micro-batch-size 1 \
	--global-batch-size 8 \
	--rampup-batch-size 2 2 24 \
	--train-samples 60 \
       	--lr-decay-samples 48 \
        --lr-warmup-samples 4 \
        --lr 6.0e-5 \
	--min-lr 6.0e-6 \
        --lr-decay-style cosine \
        --log-interval 1 \
        --eval-iters 1 \
        --eval-interval 5 \
	--data-path ${DATASET} \
	--vocab-file ${VOCAB_FILE} \
	--merge-file ${MERGE_FILE} \
	--save-interval 5 \
	--save ${CHECKPOINT_PATH} \
	--load ${CHECKPOINT_PATH} \
        --split 98,2,0 \
        --clip-grad 1.0 \
	--weight-decay 0.1 \
	--adam-beta1 0.9 \
	--adam-beta2 0.95 \
	--init-method-std 0.006 \
	--tensorboard-dir ${TENSORBOARD_DIR} \
        --fp16 \
	--checkpoint-activations "


run_cmd="torchrun --nproc_per_node 2 --master_port ${MASTER_PORT} ${RAPIDTRAIN_DIR}/rapidtrain/pretrain_gpt.py $@ ${options}"


sh -c "${run_cmd}" 2>&1 | tee $DIR/logs/gpt3_$DATETIME.log
exit ${PIPESTATUS[0]}


set +x
