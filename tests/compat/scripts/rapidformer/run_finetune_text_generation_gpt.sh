#!/bin/bash
# Rapidformer's GPT-MoE fine-tuning launch script (EasyNLP's examples/rapidformer/gpt_moe/
# run_finetune_text_generation_gpt.sh), run by rapidtrain. Changed only where a 2-core CPU forces it: 2
# processes, the model sizes scaled down, the output under OUTPUT_BASEPATH, and the tokenizer local: GPT-2 BPE
# files (DATA_DIR) instead of the downloaded JiebaBPETokenizer tokenizer.json (its Chinese pre-segmentation needs
# jieba, which rapidtrain does not ship). The training script is tests/compat/scripts/rapidformer/
# finetune_megatron_gpt.py. Arguments as the original's: TASK_NAME TRAIN_DATASET_PATH VALID_DATASET_PATH
# PRETRAIN_CHECKPOINT_PATH MODEL_SIZE MOE RT BATCH_SIZE EPOCH TP AC ZERO SEQ_LEN.
export LC_ALL=C.UTF-8
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6034}
GPUS_PER_NODE=2
NNODES=1
NODE_RANK=0

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

TASK_NAME=$1
TRAIN_DATASET_PATH=$2
VALID_DATASET_PATH=$3
PRETRAIN_CHECKPOINT_PATH=$4
MODEL_SIZE=$5
MOE=$6
RT=$7
BATCH_SIZE=$8
EPOCH=$9
TP=${10}
AC=${11}
ZERO=${12}
SEQ_LEN=${13}

tokenizer_options=" \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file ${DATA_DIR}/gpt2-vocab.json \
    --merge-file ${DATA_DIR}/gpt2-merges.txt
    "

if [ $MODEL_SIZE = tiny ]; then

NUM_LAYERS=2
HIDDEN_SIZE=64
NUM_ATTN_HEADS=4
LR=6e-4
MIN_LR=6e-5

fi

if [ $AC = full ]; then
    activation_checkpoint_options=" \
		    --recompute-method uniform \
		    --recompute-granularity full"
elif [ $AC = sel ]; then
    activation_checkpoint_options=" \
        --recompute-activations"
elif [ $AC = none ]; then
    activation_checkpoint_options=" \
                    "
fi

if [ $ZERO = do ]; then
    zero_options=" \
		    --use-distributed-optimizer"

elif [ $ZERO = none ]; then
    zero_options=" \
                    "
fi

if [ $MOE = none ]; then
    moe_options=" \
		               "
		model_type="dense"

else
    moe_options=" \
        --router-type ${RT} \
        --num-experts ${MOE}
                    "
    model_type="moe-${MOE}-rt-${RT}"

fi

FT_NAME="finetune-${TASK_NAME}-megatron-gpt-${model_type}-${MODEL_SIZE}-lr-${LR}-epo-${EPOCH}-bs-${BATCH_SIZE}-tp-${TP}-ac-${AC}-zero-${ZERO}"
mkdir -p "${OUTPUT_BASEPATH}/tensorboard/"
mkdir -p "${OUTPUT_BASEPATH}/checkpoint/"
mkdir -p "${OUTPUT_BASEPATH}/log/"
current_time=$(date "+%Y.%m.%d-%H.%M.%S")
TENSORBOARD_DIR="${OUTPUT_BASEPATH}/tensorboard/${FT_NAME}_${current_time}"
mkdir -p ${TENSORBOARD_DIR}

FINETUNE_CHECKPOINT_PATH="${OUTPUT_BASEPATH}/checkpoint/${FT_NAME}"
LOGGING_PATH="${OUTPUT_BASEPATH}/log/${FT_NAME}_${current_time}"


rapidformer_options="  \
        --pretrained-model-name-or-path ${PRETRAIN_CHECKPOINT_PATH} \
        --save ${FINETUNE_CHECKPOINT_PATH} \
        --train-data ${TRAIN_DATASET_PATH} \
        --valid-data ${VALID_DATASET_PATH} \
        --num-layers ${NUM_LAYERS} \
        --hidden-size ${HIDDEN_SIZE} \
        --num-attention-heads ${NUM_ATTN_HEADS} \
        --seq-length ${SEQ_LEN} \
        --max-position-embeddings ${SEQ_LEN} \
        --keep-last \
        --micro-batch-size ${BATCH_SIZE} \
        --epochs ${EPOCH} \
        --lr ${LR} \
        --min-lr ${MIN_LR} \
        --lr-decay-style cosine \
        --lr-warmup-fraction 0.01 \
        --weight-decay 0.1 \
        --clip-grad 1.0 \
        --adam-beta1 0.9 \
        --adam-beta2 0.95 \
        --init-method-std 0.006 \
        --num-workers 0\
        --log-interval 1 \
        --eval-interval 100 \
        --eval-iters 10 \
        --save-interval 100000000 \
        --tensorboard-queue-size 1 \
        --logging-path $LOGGING_PATH \
        --tensorboard-dir ${TENSORBOARD_DIR} \
        --log-timers-to-tensorboard \
        --log-batch-size-to-tensorboard \
        --log-validation-ppl-to-tensorboard \
        --finetune \
        --no-load-optim\
        --DDP-impl local\
        --tensor-model-parallel-size ${TP} \
        --fp16
        "

run_cmd="python -m torch.distributed.launch $DISTRIBUTED_ARGS ${RAPIDTRAIN_DIR}/tests/compat/scripts/rapidformer/finetune_megatron_gpt.py ${tokenizer_options}
 ${rapidformer_options} ${activation_checkpoint_options} ${zero_options} ${moe_options}"


echo ${run_cmd}
eval ${run_cmd}
set +x
