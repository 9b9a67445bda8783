#!/bin/bash
# Rapidformer's GPT-MoE pretraining launch script (EasyNLP's examples/rapidformer/gpt_moe/
# run_pretrain_megatron_gpt.sh), run by rapidtrain. Changed only where a 2-core CPU forces it: 2 processes, the
# model sizes and token counts scaled down, the data and tokenizer files local (DATA_DIR) and the output under
# OUTPUT_BASEPATH; the training script is tests/compat/scripts/rapidformer/pretrain_megatron_gpt.py.
# Arguments as the original's: MODE TOKENIZER MODEL_SIZE MOE RT BATCH_SIZE TP AC ZERO SAVE_INTERVAL.
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6012}
GPUS_PER_NODE=2
NNODES=1
NODE_RANK=0

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

MODE=$1
TOKENIZER=$2
MODEL_SIZE=$3
MOE=$4
RT=$5
BATCH_SIZE=$6
TP=$7
AC=$8
ZERO=$9
SAVE_INTERVAL=${10}
SEQ_LEN=64

if [ $TOKENIZER = gpt2bpe ]; then

  TRAIN_TOKENS=2048
  WARMUP_TOKENS=256
  DATASET=pile

  dataset_options=" \
		    --tokenizer-type GPT2BPETokenizer \
		    --vocab-file ${DATA_DIR}/gpt2-vocab.json \
		    --merge-file ${DATA_DIR}/gpt2-merges.txt \
		    --data-path ${DATA_DIR}/my-gpt2_text_document
		    "
fi

if [ $MODEL_SIZE = tiny ]; then

NUM_LAYERS=2
HIDDEN_SIZE=64
NUM_ATTN_HEADS=4
LR=6e-4
MIN_LR=6e-5
GLOBAL_BATCH_SIZE=$(( 512 / ${SEQ_LEN} ))

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

TRAIN_ITERS=$(( ${TRAIN_TOKENS} / ${GLOBAL_BATCH_SIZE} / ${SEQ_LEN} ))
LR_WARMUP_ITERS=$(( ${WARMUP_TOKENS}  / ${GLOBAL_BATCH_SIZE} / ${SEQ_LEN} ))
LR_DECAY_ITERS=$(( ${TRAIN_TOKENS} /  ${GLOBAL_BATCH_SIZE} / ${SEQ_LEN} ))

NAME="${MODE}-${DATASET}-${TOKENIZER}-megatron-gpt-${model_type}-${MODEL_SIZE}-lr-${LR}-bs-${BATCH_SIZE}-gbs-${GLOBAL_BATCH_SIZE}-tp-${TP}-ac-${AC}-zero-${ZERO}"
mkdir -p "${OUTPUT_BASEPATH}/tensorboard/"
mkdir -p "${OUTPUT_BASEPATH}/checkpoint/"
mkdir -p "${OUTPUT_BASEPATH}/log/"
current_time=$(date "+%Y.%m.%d-%H.%M.%S")
TENSORBOARD_DIR="${OUTPUT_BASEPATH}/tensorboard/${NAME}_${current_time}"
mkdir -p ${TENSORBOARD_DIR}
CHECKPOINT_PATH="${OUTPUT_BASEPATH}/checkpoint/${NAME}"
LOGGING_PATH="${OUTPUT_BASEPATH}/log/${NAME}_${current_time}"

rapidformer_options=" \
        --pretrained-model-name-or-path ${CHECKPOINT_PATH} \
        --save ${CHECKPOINT_PATH} \
        --split 98,2,0 \
        --data-impl mmap \
        --lr ${LR} \
        --min-lr ${MIN_LR} \
        --lr-decay-style linear \
        --adam-beta1 0.9 \
        --adam-beta2 0.95 \
        --weight-decay 0.1 \
        --clip-grad 1.0 \
        --init-method-std 0.006 \
        --lr-decay-iters ${LR_DECAY_ITERS} \
        --lr-warmup-iters ${LR_WARMUP_ITERS} \
        --train-iters ${TRAIN_ITERS} \
        --micro-batch-size ${BATCH_SIZE} \
        --global-batch-size ${GLOBAL_BATCH_SIZE} \
        --num-layers ${NUM_LAYERS} \
        --hidden-size ${HIDDEN_SIZE} \
        --num-attention-heads ${NUM_ATTN_HEADS} \
        --seq-length ${SEQ_LEN} \
        --max-position-embeddings ${SEQ_LEN} \
        --log-interval 1 \
        --eval-interval 2 \
        --eval-iters 1 \
        --save-interval ${SAVE_INTERVAL} \
        --tensorboard-queue-size 1 \
        --logging-path $LOGGING_PATH \
        --tensorboard-dir ${TENSORBOARD_DIR} \
        --log-timers-to-tensorboard \
        --log-batch-size-to-tensorboard \
        --log-validation-ppl-to-tensorboard \
        --tensor-model-parallel-size ${TP} \
        --sequence-parallel \
        --moe-linear-layer-type standard \
        --use-expert-residual-network \
        --fp16\
        "

run_cmd="python -m torch.distributed.launch $DISTRIBUTED_ARGS ${RAPIDTRAIN_DIR}/tests/compat/scripts/rapidformer/pretrain_megatron_gpt.py ${dataset_options}
 ${rapidformer_options} ${activation_checkpoint_options} ${zero_options} ${moe_options}"


echo ${run_cmd}
eval ${run_cmd}
set +x
