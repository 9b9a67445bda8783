#!/bin/bash
# Rapidformer's ZeroCLUE fine-tuning launch script (EasyNLP's examples/rapidformer/zeroclue/
# run_finetune_gpt_moe.sh), run by rapidtrain. Changed only where a 2-core CPU forces it: 2 processes, the model
# sizes (4 layers with a pyramid of 2 and 4 experts), epochs and batch scaled down, local files (DATA_DIR; the
# task's files TRAIN_DATA / VALID_DATA, the checkpoint PRETRAIN_CHECKPOINT_PATH, the output
# SAVE_CHECKPOINT_PATH) and a local tokenizer: GPT-2 BPE instead of the downloaded ChineseBPETokenizer model.
# The training script is tests/compat/scripts/rapidformer/finetune_gpt_moe.py.
export LC_ALL=C.UTF-8
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6034}
GPUS_PER_NODE=2
NNODES=1
NODE_RANK=0

declare -A input_schema
input_schema['eprstmt']=sid,sent,label
input_schema['bustm']=sid,sent,sent2,label

declare -A pattern
pattern['eprstmt']=label,满意,sent
pattern['bustm']=sent,和,sent2,意思,label,同

declare -A label_desc
label_desc['eprstmt']=很,不
label_desc['bustm']=不,相

declare -A label_name
label_name['eprstmt']=Positive,Negative
label_name['bustm']=0,1

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

VOCAB_FILE=${DATA_DIR}/gpt2-vocab.json
TOKENIZER=GPT2BPETokenizer

SEQ_LEN=64
MAX_POSITION_EMBEDDINGS=64
NUM_LAYERS=4
HIDDEN_SIZE=64
NUM_ATTN_HEADS=4
LOG_INTERVAL=1
EVAL_ITERS=10
EVAL_INTERVAL=1000000
SAVE_INTERVAL=10000000
TASK=${TASK:-eprstmt}
NUM_EXPERTS="2 4"
rapidformer_options="  \
        --pretrained-model-name-or-path ${PRETRAIN_CHECKPOINT_PATH} \
        --save ${SAVE_CHECKPOINT_PATH} \
        --tokenizer-type ${TOKENIZER} \
        --vocab-file ${VOCAB_FILE} \
        --merge-file ${DATA_DIR}/gpt2-merges.txt \
        --tensor-model-parallel-size 1 \
        --train-data $TRAIN_DATA \
        --valid-data $VALID_DATA \
        --num-layers ${NUM_LAYERS} \
        --hidden-size ${HIDDEN_SIZE} \
        --num-attention-heads ${NUM_ATTN_HEADS} \
        --seq-length ${SEQ_LEN} \
        --max-position-embeddings ${MAX_POSITION_EMBEDDINGS} \
        --pattern ${pattern[$TASK]} \
        --label_desc ${label_desc[$TASK]} \
        --label_enumerate_values ${label_name[$TASK]} \
        --input_schema ${input_schema[$TASK]} \
        --keep-last \
        --micro-batch-size 4 \
        --epochs 2 \
        --lr 1e-4 \
        --lr-decay-style cosine \
        --lr-warmup-fraction 0.1 \
        --min-lr 1e-6 \
        --num-workers 0 \
        --weight-decay 0.1 \
        --clip-grad 1.0 \
        --adam-beta1 0.9 \
        --adam-beta2 0.95 \
        --init-method-std 0.014 \
        --override-lr-scheduler \
        --log-interval ${LOG_INTERVAL} \
        --eval-interval ${EVAL_INTERVAL} \
        --eval-iters ${EVAL_ITERS} \
        --save-interval ${SAVE_INTERVAL} \
        --DDP-impl local \
        --mixed-precision \
        --no-contiguous-buffers-in-local-ddp \
        --hysteresis 2 \
        --eod-mask-loss \
        --checkpoint-activations \
        --disable-moe-token-dropping \
        --top-k-linear-strategy normal \
        --num-experts ${NUM_EXPERTS} \
        --mlp-type residual \
		    --zero-2-memory-optimization \
        --moe-loss-coeff 0.01 \
        "
run_cmd="python -m torch.distributed.launch $DISTRIBUTED_ARGS ${RAPIDTRAIN_DIR}/tests/compat/scripts/rapidformer/finetune_gpt_moe.py ${rapidformer_options}"

echo ${run_cmd}
eval ${run_cmd}
set +x
