"""How rapidtrain treats each flag of the Megatron family (config/megatron_flags.json): the classification as data.

Three statuses. `works`: the same meaning here (a flag rapidtrain defines, an old or fork name of one, or a flag
whose meaning config/flag_surface.py applies). `no_effect`: accepted, and the plan says why it changes nothing
(a fusion or overlap switch with nothing to switch, a tool rapidtrain does not have). `refused`: a feature rapidtrain
lacks; the run stops with exit status 2 naming the flag, why and what to use, unless the value given is the
origin's default (which asks for nothing). Lookup order: RENAMED, SETS, HANDLED, FLAGS, then the first PATTERN whose
regular expression matches the whole flag; `docs/megatron-compat.md` is generated from the result.
"""

from __future__ import annotations

WORKS, NO_EFFECT, REFUSED = "works", "no_effect", "refused"

# Another origin's name for a rapidtrain flag: the value lands on that flag's destination.
RENAMED: dict[str, tuple[str, str]] = {
    "--model-parallel-size": ("tensor_model_parallel_size", "Megatron 2020's name of --tensor-model-parallel-size"),
    "--intra-layer-model-parallel-size": ("tensor_model_parallel_size", "a fork's name of "
                                          "--tensor-model-parallel-size"),
    "--pipe-parallel-size": ("pipeline_model_parallel_size", "DeepSpeed's name of --pipeline-model-parallel-size"),
    "--batch-size": ("micro_batch_size", "Megatron 2020's name of --micro-batch-size (samples per rank per step)"),
    "--warmup": ("lr_warmup_fraction", "Megatron 2020's name of --lr-warmup-fraction"),
    "--warmup-iters": ("lr_warmup_iters", "an older name of --lr-warmup-iters"),
    "--encoder-seq-length": ("seq_length", "Megatron's name of --seq-length for encoder models"),
    "--vocab": ("vocab_file", "Megatron 2019's name of --vocab-file"),
    "--tokenizer-name-or-path": ("tokenizer_model", "BigScience's PretrainedFromHF folder: --tokenizer-model (a local "
                                 "Hugging Face tokenizer folder; never the hub)"),
    "--tokenizer-path": ("tokenizer_model", "Megatron 2019's tokenizer file: --tokenizer-model"),
    "--deepscale": ("deepspeed", "DeepSpeed's old name of --deepspeed"),
    "--deepscale_config": ("deepspeed_config", "DeepSpeed's old name of --deepspeed_config"),
    "--rotary-position-embeddings-theta": ("rotary_base", "a fork's name of --rotary-base"),
    "--intermediate-size": ("ffn_hidden_size", "a fork's name of --ffn-hidden-size"),
    "--moe-expert-parallel-size": ("expert_model_parallel_size", "Megatron-DeepSpeed's name of "
                                   "--expert-model-parallel-size"),
    "--moe-train-capacity-factor": ("moe_capacity_factor", "Megatron-DeepSpeed's name of --moe-capacity-factor"),
    "--moe-expert-capacity-factor": ("moe_capacity_factor", "Megatron-Core's name of --moe-capacity-factor"),
    "--moe-input-jitter-eps": ("moe_jitter_eps", "Megatron-Core's name of --moe-jitter-eps"),
    "--topk": ("moe_router_topk", "Megatron-DeepSpeed's name of --moe-router-topk"),
    "--moe-topk": ("moe_router_topk", "a fork's name of --moe-router-topk"),
    "--expert-interval": ("moe_layer_freq", "Megatron-DeepSpeed's every Nth layer MoE, counted from layer 1 (0-based "
                          "N-1, 2N-1, ...; Megatron-Core's --moe-layer-freq N counts from layer 0)"),
    "--add-bias-linear": ("add_bias_linear", "biases in the linear layers (rapidtrain's default)"),
    "--zero-contigious-gradients": ("zero_contiguous_gradients", "Megatron-DeepSpeed's spelling of "
                                    "--zero-contiguous-gradients"),
    "--cpu-optimizer": ("cpu_offload", "Megatron-DeepSpeed's ZeRO-Offload switch: --cpu-offload"),
    "--cpu-torch-adam": ("cpu_offload", "Megatron-DeepSpeed's ZeRO-Offload switch: --cpu-offload"),
    "--cpu_torch_adam": ("cpu_offload", "Megatron-DeepSpeed's ZeRO-Offload switch: --cpu-offload"),
    "--optimizer-cpu-offload": ("cpu_offload", "Megatron-Core's optimizer offload: --cpu-offload (DeepSpeed "
                                "offload_optimizer under ZeRO)"),
    "--use-pytorch-profiler": ("profile", "rapidtrain's --profile is the PyTorch profiler"),
    "--eval-iters-per-eval": ("eval_iters", "a fork's name of --eval-iters"),
    "--use-torch-fsdp2": ("fsdp_memory_optimization", "Megatron-Core's torch FSDP2: --fsdp-memory-optimization"),
    "--use-megatron-fsdp": ("fsdp_memory_optimization", "Megatron's FSDP: served by torch FSDP2 "
                            "(--fsdp-memory-optimization)"),
    "--use-custom-fsdp": ("fsdp_memory_optimization", "Megatron's FSDP by its 2025 name (--use-megatron-fsdp since): "
                          "served by torch FSDP2 (--fsdp-memory-optimization)"),
    "--torch-fsdp2-no-reshard-after-forward": ("oss_sdp_memory_optimization", "FSDP2 keeping parameters gathered "
                                               "between forward and backward: --oss-sdp-memory-optimization"),
    "--deepspeed-activation-checkpointing": ("checkpoint_activations", "DeepSpeed's activation checkpointing: each "
                                             "transformer layer recomputed in backward by torch.utils.checkpoint"),
    "--recompute": ("checkpoint_activations", "a fork's name of --checkpoint-activations"),
    "--qk-nope-head-dim": ("qk_head_dim", "Pai-Megatron-Patch's name of --qk-head-dim (MLA's unrotated head part)"),
    "--qk-rope-head-dim": ("qk_pos_emb_head_dim", "Pai-Megatron-Patch's name of --qk-pos-emb-head-dim (MLA's rotary "
                           "head part)"),
}

# A switch of another origin that sets a rapidtrain flag to a value.
SETS: dict[str, tuple[str, object, str]] = {
    "--use-rotary-position-embeddings": ("position_embedding_type", "rope",
                                         "Megatron-DeepSpeed's rotary switch: --position-embedding-type rope"),
    "--use-llama2-rotary-position-embeddings": ("position_embedding_type", "rope", "rotary embeddings (Llama 2's)"),
    "--use-mistral-rotary-position-embeddings": ("position_embedding_type", "rope", "rotary embeddings (Mistral's)"),
    "--RMSNorm": ("normalization", "RMSNorm", "a fork's switch for --normalization RMSNorm"),
    "--use-alibi-mask": ("position_embedding_type", "alibi", "Pai-Megatron-Patch's ALiBi switch: "
                         "--position-embedding-type alibi"),
    "--disable-bias-linear-fc": ("add_bias_linear", False, "a fork's switch: no biases in the MLP "
                                 "(with --disable-bias-attn-fc, --disable-bias-linear)"),
    "--disable-bias-attn-fc": ("add_bias_linear", False, "a fork's switch: no biases in attention "
                               "(with --disable-bias-linear-fc, --disable-bias-linear)"),
    "--causal-lm": ("model_type", "gpt", "a fork's switch: the causal (GPT) model"),
    "--no-load-lr-state": ("override_opt_param_scheduler", True, "Megatron-DeepSpeed's switch: the learning-rate "
                           "schedule from the flags, not the checkpoint's: --override-opt_param-scheduler"),
    "--use-flash-attn-v2": ("attention_backend", "auto", "torch scaled_dot_product_attention, which runs a flash "
                            "kernel on CUDA where the shapes allow (--attention-backend flash pins it)"),
}

# Flags whose meaning config/flag_surface.py applies after parsing (each leaves a plan line).
HANDLED: dict[str, str] = {
    "--train-tokens": "token-based training: iterations = tokens / (--seq-length × global batch), as "
                      "Megatron-DeepSpeed (it becomes --train-samples = tokens / --seq-length)",
    "--lr-decay-tokens": "the decay horizon in tokens: --lr-decay-samples = tokens / --seq-length",
    "--lr-warmup-tokens": "the warm-up in tokens: --lr-warmup-samples = tokens / --seq-length",
    "--zero-stage": "DeepSpeed's ZeRO stage: 1, 2, 3 select --zero-N-memory-optimization (DeepSpeed ZeRO; FSDP2 over "
                    "the data-parallel dimension with tensor/pipeline parallelism); 0 shards nothing",
    "--num-key-value-heads": "Megatron-DeepSpeed's key/value heads: --num-query-groups N with --group-query-attention",
    "--n-head-kv": "a fork's key/value heads: --num-query-groups N with --group-query-attention",
    "--gas": "DeepSpeed's gradient accumulation steps: --global-batch-size = micro × gas × data-parallel size",
    "--mock-data": "synthetic data: the built-in demo corpus (a real tokenised text) instead of Megatron's random "
                   "tokens; no data files needed",
    "--ckpt-format": "torch_dist is rapidtrain's own format (torch.distributed.checkpoint, resharding on load); "
                     "another format is written as torch_dist too, and the plan says so",
    "--apply-layernorm-1p": "Megatron's zero-centred norm weight (1 + w): the same function as a plain LayerNorm "
                            "weight, and since norms get no weight decay here, the same training",
    "--no-position-embedding": "no learned position table: with rotary embeddings or ALiBi that is already so; "
                               "without them refused (rapidtrain's models need a position encoding)",
    "--pretrained-checkpoint": "Megatron tasks' starting weights: with --task MNLI / RACE (rapidtrain/tasks_main.py) "
                               "the BERT checkpoint whose encoder and pooler the task's model starts from; "
                               "otherwise --load FOLDER --finetune (model only, from iteration 0)",
    "--patch-tokenizer-type": "Pai-Megatron-Patch's Hugging Face tokenizers (LLamaTokenizer, Qwen2Tokenizer, ...): "
                              "--tokenizer-type HuggingFaceTokenizer from --tokenizer-model, else the --load folder",
    "--dataset": "Pai-Megatron-Patch's dataset kind: the *-Idxmap kinds (and MMAP) are Megatron indexed data; "
                 "LLama-Pretrain-Raw and LLama-SFT read JSON instruction/output records from --train-data-path, "
                 "tokenized at start with the prompt masked out of the loss; JSON-SFT renders each record "
                 "(messages, conversations, instruction/input/output) with the tokenizer's chat template, the "
                 "assistant turns carrying loss (packed with --reset-position-ids / --reset-attention-mask); "
                 "other raw kinds are refused",
    "--max-padding-length": "with a raw JSON --dataset, the tokens of each sample (padded; Pai's pretraining kind "
                            "adds one for the shift); pretraining samples are --seq-length tokens otherwise",
    "--optimizer-offload-fraction": "Megatron-Core's share of the optimizer state kept on the CPU with "
                                    "--optimizer-cpu-offload: 1.0 is --cpu-offload's whole state; a part is "
                                    "refused; without the offload it has no effect",
    "--optimizer-offload-policy": "Pai-Megatron-Patch's HybridAdam policy: static (a fixed "
                                  "--optimizer-offload-fraction) is what --cpu-offload does at 1.0; auto (moved by "
                                  "free memory at run time) is refused",
    "--train-mode": "Pai-Megatron-Patch's mode: pretrain; finetune with --dataset JSON-SFT (chat-template JSON), "
                    "LLama-SFT, or MMAP (Pai's SFT idxmap: each document the tokens and then their labels, the loss "
                    "a mean over rows, or over conversations when packed with --reset-position-ids)",
    "--transformer-impl": "rapidtrain's layers are its own torch modules (SDPA attention); local or "
                          "transformer_engine, the numbers are those of the same architecture",
    "--no-pipeline-parallel": "Megatron-DeepSpeed's non-pipelined DeepSpeed engine: pipelining runs only with "
                              "--pipeline-model-parallel-size > 1",
    "--moe-router-load-balancing-type": "aux_loss (Switch/GShard load-balancing loss over the micro-batch), "
                                        "seq_aux_loss (DeepSeek-V3's, per sequence) and sinkhorn (the experts chosen "
                                        "by Sinkhorn-balanced logits, no loss) are the built-in router's; none turns "
                                        "the loss off; other types are refused",
    "--padded-vocab-size": "the embedding's rows (Pai-Megatron-Patch): --make-vocab-size-divisible-by N / TP, so "
                           "the vocabulary pads to exactly N",
    "--pad-vocab-size-to": "BigScience's embedding rows: exactly N (--make-vocab-size-divisible-by N / TP); refused "
                           "when N is smaller than the tokenizer's vocabulary or not divisible by the tensor-parallel "
                           "size",
    "--dataloader-type": "single and cyclic: rapidtrain's samplers (Megatron's order within an epoch, reshuffled per "
                         "epoch); external is refused",
    "--use-flash-attn": "torch scaled_dot_product_attention runs a flash kernel on CUDA where the shapes allow "
                        "(--attention-backend flash pins it); on a CPU its own kernel",
}
HANDLED["--window-size"] = ("Megatron-Core's attention window 'LEFT,RIGHT' (flash-attention's convention: keys "
                           "LEFT back to RIGHT ahead): LEFT,0 is --sliding-window LEFT + 1; -1 is no limit")
HANDLED["--window-attn-skip-freq"] = ("with a sliding window, every Nth layer (1-based) attends to the whole "
                                      "sequence, as Megatron-Core")
HANDLED["--decoupled-lr"] = ("Megatron-Core's own rate for the word embedding and the output layer: their parameter "
                             "groups follow the schedule's warm-up and decay from this peak (to --decoupled-min-lr, "
                             "else --min-lr); every engine (DDP, FSDP2, OSS, DeepSpeed ZeRO, pipeline stages)")
HANDLED["--decoupled-min-lr"] = ("the floor of --decoupled-lr's groups (default --min-lr); no effect without "
                                 "--decoupled-lr")
HANDLED["--enable-gpt-oss"] = (
    "Megatron's gpt-oss switch sets YaRN rope (--rope-type yarn, factor 32, original positions 131072, beta fast 32, "
    "beta slow 1, mscale 1, mscale-all-dim 0, correction range not rounded) and nothing else; gpt-oss's architecture "
    "is its other flags (--softmax-type learnable --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7 "
    "--window-size 127,0 --window-attn-skip-freq 2)")
HANDLED["--calculate-per-token-loss"] = (
    "the loss summed over the tokens of every micro-batch and data-parallel rank, over their count: rapidtrain's "
    "reduction whenever the forward step returns (loss sum, token count), as the built-in models and tasks do; with "
    "this flag a mean loss from a user's forward step stops the run instead")
HYBRID_LAYERS = "Mamba, hybrid, linear-attention and sparse-attention layers are not in rapidtrain's models"
HANDLED["--spec"] = ("Megatron's layer spec: local (the layers without Transformer Engine, as pretrain_bert.py reads "
                     "it) is what rapidtrain's own torch layers are; a spec by module path names Megatron-Core code "
                     "(the hybrid Mamba stack) and is refused")
_WEIGHTED = ("BigScience's per-split weighted data, \"NAME: W1 START:END PREFIX1, W2 START:END PREFIX2\": each "
             "group a blend of its prefixes' documents between those fractions; one training group, each validation "
             "or test group evaluated and logged on its own")
for _split in ("train", "valid", "test"):
    HANDLED[f"--{_split}-weighted-split-paths"] = _WEIGHTED
    HANDLED[f"--{_split}-weighted-split-paths-path"] = ("a file with one line of quoted groups, read as "
                                                        f"--{_split}-weighted-split-paths")
HANDLED["--use-flash-attn-v1"] = HANDLED["--use-flash-attn-triton"] = HANDLED["--use-flash-attn"]

_FUSION = ("one of Megatron's fused CUDA kernels; rapidtrain's layers are torch ops (SDPA attention, torch.compile "
           "with --torch-compile), which compute the same numbers")
_OVERLAP = ("communication scheduling: torch DDP overlaps the gradient all-reduce with backward and FSDP2 prefetches "
            "parameters; the numbers are the same")
_PRECISION = ("rapidtrain keeps fp32 master weights, optimizer state and gradient reduction, and computes softmax, "
              "norms and the loss in fp32 under autocast")
_CKPT = ("rapidtrain writes torch.distributed.checkpoint (Megatron's torch_dist): every rank writes its own shards, "
         "published atomically, resharded on load")
_CLUSTER = "NVIDIA's cluster tooling (fault tolerance, loggers, tracing): not in rapidtrain; SIGTERM saves and ends"
_LOGGING = "a Megatron logging/profiling detail; rapidtrain's log line, --tensorboard-dir and --profile cover it"
_INFERENCE = "read by Megatron's text-generation, inference and evaluation tools, not by training"
_MEMORY = "a memory housekeeping knob of Megatron's; torch's caching allocator and rapidtrain's meta-device init " \
          "serve it"
_DS_AC = "a DeepSpeed activation-checkpointing option; rapidtrain recomputes with torch.utils.checkpoint per layer"
_CUDA_GRAPH = "CUDA graphs: use --torch-compile --torch-compile-mode reduce-overhead"
_TE = "Transformer Engine is not used: rapidtrain's layers are its own torch modules"

FLAGS: dict[str, tuple[str, str]] = {
    "--transformer-timers": (NO_EFFECT, _LOGGING),
    "--log-throughput": (NO_EFFECT, "the log line always shows throughput (TFLOP/s per device) when the model's FLOPs "
                                    "are known, and MFU with --peak-tflops"),
    "--log-optimizer-states-to-tensorboard": (NO_EFFECT, _LOGGING),
    "--no-save-optim": (NO_EFFECT, "checkpoints always hold the optimizer state (--no-load-optim skips loading it)"),
    "--no-save-rng": (NO_EFFECT, "checkpoints always hold the RNG states (--no-load-rng skips loading them)"),
    "--use-checkpoint-args": (NO_EFFECT, "rapidtrain takes the model shape from a Megatron-format folder named by "
                                         "--pretrained-model-name-or-path; with --load the flags must match"),
    "--use-mp-args-from-checkpoint-args": (NO_EFFECT, "the layout comes from the flags; checkpoints reshard on load"),
    "--partition-activations": (NO_EFFECT, _DS_AC),
    "--contigious-checkpointing": (NO_EFFECT, _DS_AC),
    "--checkpoint-in-cpu": (NO_EFFECT, _DS_AC),
    "--synchronize-each-layer": (NO_EFFECT, _DS_AC),
    "--profile-backward": (NO_EFFECT, _DS_AC),
    "--distribute-checkpointed-activations": (NO_EFFECT, _DS_AC),
    "--distribute-saved-activations": (NO_EFFECT, _DS_AC),
    "--zero-reduce-scatter": (NO_EFFECT, "DeepSpeed ZeRO reduces gradients by reduce-scatter already"),
    "--deepspeed_mpi": (NO_EFFECT, "rapidtrain starts processes with torchrun (or Slurm's srun)"),
    "--use-contiguous-buffers-in-ddp": (NO_EFFECT, "torch DDP keeps gradients in its own contiguous buckets"),
    "--no-async-tensor-model-parallel-allreduce": (NO_EFFECT, _OVERLAP),
    "--moe-grouped-gemm": (NO_EFFECT, "dropless experts always run as grouped matrix products (torch's grouped_mm; "
                                      "16-bit on a CPU over each expert's rows padded to bucketed sizes, bitwise the "
                                      "same), with a capacity as batched ones over the capacity buffers: the same "
                                      "numbers"),
    "--moe-token-dispatcher-type": (NO_EFFECT, "tokens reach experts by rapidtrain's all-to-all (expert parallelism) "
                                               "or locally; allgather/alltoall/flex give the same numbers"),
    "--moe-eval-capacity-factor": (NO_EFFECT, "evaluation routes with the training capacity factor"),
    "--create-moe-param-group": (NO_EFFECT, "expert parameters share the optimizer's parameter groups"),
    "--disable-moe-top2-2nd-expert-sampling": (NO_EFFECT, "the router takes the top-k experts by score (no sampling "
                                                          "of the second expert)"),
    "--moe-token-dropping": (NO_EFFECT, "tokens over capacity are dropped unless --disable-moe-token-dropping"),
    "--use-tutel": (NO_EFFECT, "the built-in MoE layer serves it (Tutel's kernels are not used)"),
    "--moe-per-layer-logging": (NO_EFFECT, _LOGGING),
    "--no-mmap-bin-files": (NO_EFFECT, "indexed data is always memory-mapped"),
    "--no-create-attention-mask-in-dataloader": (NO_EFFECT, "the causal mask is made by the attention kernel, not the "
                                                            "data loader"),
    "--extra-vocab-size": (NO_EFFECT, "the embedding is sized from the tokenizer's vocabulary (padded to "
                                      "--make-vocab-size-divisible-by); Pai's extra rows are never indexed"),
    "--expert-tensor-parallel-size": (REFUSED, "experts are not split by tensor parallelism; shard them over ranks "
                                               "with --expert-model-parallel-size"),
    "--apply-residual-connection-post-layernorm": (REFUSED, "that residual order is not in rapidtrain's models; "
                                                            "--post-layernorm gives BERT's post-norm order"),
    "--fp8-format": (REFUSED, "FP8 training needs Transformer Engine and FP8 hardware; not in rapidtrain: use --bf16"),
    "--fp8-recipe": (REFUSED, "FP8 training is not in rapidtrain: use --bf16"),
    "--fp8-param-gather": (REFUSED, "FP8 training is not in rapidtrain: use --bf16"),
    "--fp8-e4m3": (REFUSED, "FP8 training is not in rapidtrain: use --bf16"),
    "--fp8-hybrid": (REFUSED, "FP8 training is not in rapidtrain: use --bf16"),
    "--fp4-format": (REFUSED, "FP4 training is not in rapidtrain: use --bf16"),
    "--fp4-recipe": (REFUSED, "FP4 training is not in rapidtrain: use --bf16"),
    "--fp4-param-gather": (REFUSED, "FP4 training is not in rapidtrain: use --bf16"),
    "--start-weight-decay": (REFUSED, "weight decay is constant (--weight-decay); a schedule for it is not in "
                                      "rapidtrain"),
    "--end-weight-decay": (REFUSED, "weight decay is constant (--weight-decay)"),
    "--weight-decay-incr-style": (REFUSED, "weight decay is constant (--weight-decay)"),
    "--head-lr-mult": (REFUSED, "per-layer learning-rate multipliers are not in rapidtrain"),
    "--lr-mult-router": (REFUSED, "per-layer learning-rate multipliers are not in rapidtrain"),
    "--moe-router-dtype": (NO_EFFECT, "the router computes its scores in fp32"),
    "--moe-shared-expert-overlap": (NO_EFFECT, _OVERLAP),
    "--moe-permute-fusion": (NO_EFFECT, _FUSION),
    "--abort-on-unmet-fused-kernel-constraints": (NO_EFFECT, _FUSION),
    "--lazy-mpu-init": (REFUSED, "the process group starts when training starts; a user script of Megatron's "
                                 "external-initialisation kind is not served"),
    "--use-cpu-initialization": (NO_EFFECT, "sharded layouts are built on the meta device and initialised per shard"),
    "--use-gpu-initialization": (NO_EFFECT, "sharded layouts are built on the meta device and initialised per shard"),
    "--init-model-with-meta-device": (NO_EFFECT, "sharded layouts are built on the meta device already"),
    "--kill-switch-path": (NO_EFFECT, _CLUSTER),
    "--kill-switch-file": (NO_EFFECT, _CLUSTER),
    "--codecarbon-dir": (NO_EFFECT, _LOGGING),
    "--logging-level": (NO_EFFECT, _LOGGING),
    "--job-name": (NO_EFFECT, "a label for the fork's logs; rapidtrain's runs are named by --wandb-exp-name"),
    "--split-transformers": (NO_EFFECT, "DeepSpeed ZeRO-3's layer partitioning; ZeRO-3 shards every parameter here"),
    "--scattered-embeddings": (NO_EFFECT, "DeepSpeed ZeRO-3's embedding partitioning; ZeRO-3 shards every parameter"),
    "--memory-centric-tiled-linear": (NO_EFFECT, "DeepSpeed ZeRO-3's tiled linear layers; not used"),
    "--overlapped-distributed-optimizer": (NO_EFFECT, _OVERLAP),
    "--reduce-bucket-size": (NO_EFFECT, "the bucket size of Megatron-LLaMA's overlapped optimizer; " + _OVERLAP),
    "--num-microbatches-in-minibatch": (NO_EFFECT, "micro-batches per step follow from --global-batch-size"),
    "--sync-tp-duplicated-parameters": (NO_EFFECT, "parameters replicated over tensor-parallel ranks are DTensors kept "
                                                   "equal by construction"),
    "--valid-num-workers": (NO_EFFECT, "validation uses --num-workers"),
    "--lazy-loader": (NO_EFFECT, "indexed data is memory-mapped"),
    "--resume-dataloader": (NO_EFFECT, "resuming always continues the data where the checkpoint stopped"),
    "--repeated-dataloader": (NO_EFFECT, "the data repeats by epochs as needed"),
    "--input_schema": (WORKS, "EasyNLP's data schema, for the user script (get_args())"),
    "--label_desc": (WORKS, "EasyNLP's labels, for the user script (get_args())"),
    "--label_enumerate_values": (WORKS, "EasyNLP's label values, for the user script (get_args())"),
    "--pattern": (WORKS, "EasyNLP's PET pattern, for the user script (get_args())"),
    "--trust-remote-code": (NO_EFFECT, "rapidtrain never runs code from a model or tokenizer folder"),
    "--vocab-extra-ids": (REFUSED, "T5's sentinel tokens: T5 is not in rapidtrain"),
    "--glu-activation": (REFUSED, "BigScience's GLU variants: rapidtrain has --swiglu"),
    "--attention-output-gate": (REFUSED, "gated attention output is not in rapidtrain's models"),
    "--position-encoding-2d": (REFUSED, "2D position encoding is not in rapidtrain's models"),
    "--use-normhead": (REFUSED, "a normalised output head is not in rapidtrain's models"),
    "--rotary-scale-factor": (REFUSED, "RoPE scaling is not in rapidtrain's models"),
    "--init-method-xavier-uniform": (REFUSED, "weights are initialised normal(0, --init-method-std)"),
    "--embedding-init-method-std": (REFUSED, "one --init-method-std for every weight"),
    "--deep-init": (REFUSED, "weights are initialised normal(0, --init-method-std), scaled by depth on the output "
                             "projections as Megatron"),
    "--export-force-local-attention": (NO_EFFECT, _INFERENCE),
    "--no-query-key-layer-scaling": (NO_EFFECT, "attention scores are 1/sqrt(d) scaled in fp32-accumulating kernels; "
                                                "Megatron's layer-number scaling is an fp16 overflow guard"),
    "--apply-query-key-layer-scaling": (NO_EFFECT, "attention scores are 1/sqrt(d) scaled in fp32-accumulating "
                                                   "kernels; Megatron's layer-number scaling is an fp16 overflow "
                                                   "guard"),
    "--ckpt-step": (REFUSED, "rapidtrain loads the folder's latest checkpoint; leave this out"),
    "--skip-train": (REFUSED, "evaluation without training: run `rapidtrain` with --train-iters 0 is not served; "
                              "leave this out"),
    "--eval-micro-batch-size": (NO_EFFECT, "evaluation uses --micro-batch-size"),
    "--eval-global-batch-size": (NO_EFFECT, "evaluation uses --micro-batch-size per rank"),
    "--data-efficiency-curriculum-learning": (REFUSED, "DeepSpeed's data efficiency library is not in rapidtrain"),
    "--random-ltd": (REFUSED, "DeepSpeed's random layer-token drop is not in rapidtrain"),
    "--ds-inference": (NO_EFFECT, _INFERENCE),
    "--moe": (REFUSED, "give --num-experts N for MoE layers"),
    "--num-experts-switch": (REFUSED, "give --num-experts N"),
    "--enable-expert-tensor-parallelism": (REFUSED, "experts are not split by tensor parallelism; use "
                                                    "--expert-model-parallel-size"),
    "--moe-extended-tp": (REFUSED, "experts are not split by tensor parallelism; use --expert-model-parallel-size"),
    "--expert-tensor-parallelism": (REFUSED, "experts are not split by tensor parallelism"),
    "--data-parallel-sharding-strategy": (REFUSED, "choose the sharding with rapidtrain's switches: "
                                                   "--oss-memory-optimization, --oss-sdp-memory-optimization, "
                                                   "--fsdp-memory-optimization"),
    "--loss-on-targets-only": (REFUSED, "prefix-LM fine-tuning is not in rapidtrain"),
    "--reweight-loss-based-on-position-frequency": (REFUSED, "prefix-LM fine-tuning is not in rapidtrain"),
    "--allow-ambiguous-pad-tokens": (NO_EFFECT, "a detail of Megatron's tokenizer wrappers; rapidtrain's tokenizers "
                                                "read the files as given"),
    "--attention-head-type": (REFUSED, "multi-query attention by this name: use --group-query-attention "
                                       "--num-query-groups 1"),
    "--decrease-batch-size-if-needed": (REFUSED, "the global batch is fixed by the flags; leave this out"),
    "--disable-parallel-output": (NO_EFFECT, "the loss is computed on vocab-parallel logits either way"),
    "--flash-attention-version": (NO_EFFECT, "torch scaled_dot_product_attention picks its flash kernel itself"),
    "--generation-length": (NO_EFFECT, _INFERENCE),
    "--output-bert-embeddings": (NO_EFFECT, _INFERENCE),
    "--no-pad-vocab-size": (REFUSED, "the vocabulary is always padded to --make-vocab-size-divisible-by × "
                                     "tensor-parallel size; give --make-vocab-size-divisible-by 1 to keep it as is"),
    "--relative-attention-max-distance": (REFUSED, "relative position buckets (T5) are not in rapidtrain's models"),
    "--relative-attention-num-buckets": (REFUSED, "relative position buckets (T5) are not in rapidtrain's models"),
    "--skip-mmap-warmup": (NO_EFFECT, "rapidtrain does not warm the memory map unless --mmap-warmup"),
    "--z-loss-weight": (REFUSED, "a z-loss on the output logits is not in rapidtrain (the router's is "
                                 "--moe-z-loss-coeff)"),
    "--muon-coefficient-type": (REFUSED, "torch.optim.Muon iterates Newton–Schulz with the quintic coefficients "
                                         "only; leave it at quintic"),
    "--muon-fp32-matmul-prec": (REFUSED, "torch.optim.Muon runs Newton–Schulz in bfloat16, which is Megatron's "
                                         "medium; leave it at medium"),
    "--muon-no-split-qkv": (REFUSED, "the built-in models keep Q, K and V as separate matrices, so Muon "
                                     "orthogonalizes each on its own (Megatron's default); a fused QKV orthogonalized "
                                     "whole is not in rapidtrain"),
    "--muon-scalar-optimizer": (REFUSED, "AdamW steps the parameters Muon does not take; Lion is not in rapidtrain"),
    "--muon-tp-mode": (REFUSED, "rapidtrain gathers each sharded matrix whole and orthogonalizes it on every rank "
                                "(Megatron's duplicated, the default); blockwise (each shard on its own) and "
                                "distributed (Newton–Schulz across ranks) are not in rapidtrain"),
    "--muon-use-syrk": (REFUSED, "torch.optim.Muon has no symmetric rank-k (SYRK) kernel for its Newton–Schulz "
                                 "products"),
}

# Values of refused flags that ask for nothing (besides each flag's default, which never does).
NEUTRAL: dict[str, tuple] = {
    "--expert-tensor-parallel-size": (1,),
"--weight-decay-incr-style": ("constant",),
    "--attention-head-type": ("multihead",),
}

# (regular expression over the whole flag, status, note), first match wins.
PATTERNS: list[tuple[str, str, str]] = [
    (r"--(no-)?(bias-(gelu|dropout|swiglu)|masked-softmax|scaled-masked-softmax|scaled-upper-triang-masked-softmax|"
     r"rope|gradient-accumulation|gradient-reduce-div|moe-router|cross-entropy-loss|moe-permute)-fusion.*", NO_EFFECT,
     _FUSION),
    (r"--(no-persist-layer-norm|disable-jit-fuser|use-flashinfer-fused-rope|fused-residual-rmsnorm|"
     r"disable-mem-efficient-ln|use-transformer-engine-op-fuser|cross-entropy-fusion-impl|ds_fused_adam|"
     r"moe-permute-fusion-into-hybridep|use-fused-weighted-squared-relu|mla-down-proj-fusion|attention-softmax-in-fp32|"
     r"use-flash-attn-builder|onnx-safe|batch-invariant-mode|deterministic-mode)", NO_EFFECT, _FUSION),
    (r"--(fp8|fp4)-.*|--first-last-layers-bf16|--num-layers-at-(start|end)-in-bf16|--keep-fp8-transpose-cache|"
     r"--reuse-grad-buf-for-mxfp8-param-ag|--te-precision-config-file|--kitchen-.*|--use-kitchen-attention|"
     r"--no-fp8-wgrad|--moe-router-padding-for-(fp8|quantization)", NO_EFFECT,
     "tunes FP8/FP4 training (Transformer Engine), which rapidtrain does not do (--fp8-format is refused)"),
    (r"--(no-)?overlap-.*|--(disable|no)-tp-comm-.*|--tp-comm-.*|--ddp-.*|--no-align-(grad-reduce|param-gather)|"
     r"--(no-)?delay-(grad-reduce|param-gather|wgrad-compute)|--defer-embedding-wgrad-compute|--wgrad-deferral-limit|"
     r"--use-ring-exchange-p2p|--no-scatter-gather-tensors-in-pipeline|--high-priority-.*|--use-nccl-ub|"
     r"--use-sharp|--sharp-enabled-group|--nccl-communicator-config-path|--create-all-gather-group|"
     r"--disable-gloo-process-groups|--symmetric-ar-type|--disable-symmetric-registration|"
     r"--suggested-communication-unit-size|--use-tp-pp-dp-mapping|--pipeline-model-parallel-comm-backend|"
     r"--moe-(enable-)?deepep.*|--moe-flex-dispatcher-.*|--moe-hybridep.*|--moe-ncclep-zero-copy|"
     r"--ep-overlap-early-attn-memory-release|--gtp-.*|--microbatch-group-size-per-virtual-pipeline-stage|"
     r"--megatron-fsdp-.*|--fsdp-(double-buffer|manual-registration|db-use-persist-buf-on-alloc-fail)|"
     r"--num-distributed-optimizer-instances|--distrib-optim-fully-reshardable-mem-efficient|"
     r"--moe-(combine-bwd|dispatch-fwd)-dtype|--tensor-parallel-num-weight-shards|"
     r"--expert-tensor-parallel-num-weight-shards|--delta-offload-bytes-across-pp-ranks|--no-data-sharding",
     NO_EFFECT, _OVERLAP),
    (r"--accumulate-allreduce-grads-in-fp32|--grad-reduce-in-bf16|--fp32-(residual-connection|allreduce|layernorm|"
     r"embedding|tokentypes)|--fp16-lm-cross-entropy|--embedding-weights-in-fp32|--main-(grads|params)-dtype|"
     r"--exp-avg(-sq)?-dtype|--use-precision-aware-optimizer|--disable-bf16-reduced-precision-matmul|--eval-fp32|"
     r"--output-logit-dtype|--min-scale", NO_EFFECT, _PRECISION),
    (r"--(no-)?ckpt-.*|--dist-ckpt-.*|--auto-detect-ckpt-format|--use-dist-ckpt|--async-ckpt-.*|--async-strategy|"
     r"--non-persistent-.*|--use-persistent-ckpt-worker|--load-main-params-from-ckpt|"
     r"--no-strict-fsdp-dtensor-load|--verify-integrity|"
     r"--save-retain-interval|--dist-ckpt-save-pre-mcore-014|--no-use-layer-wise-param-layout", NO_EFFECT, _CKPT),
    (r"--inprocess-.*|--fault-injector-.*|--straggler-.*|--log-straggler|--disable-straggler-on-startup|"
     r"--enable-ft-package|--calc-ft-timeouts|--ft-num-warmup-iters|--one-logger-.*|--enable-one-logger|"
     r"--no-one-logger|--app-tag-run-.*|--otel-.*|--(no-)?flight-recorder-.*|--error-injection-.*|--rerun-mode|"
     r"--check-for-.*|--result-rejected-tracker-filename|--adlr-autoresume.*|--gpu-sniff-test-interval|"
     r"--run-workload-inspector-server|--exit-signal-handler-for-.*|--no-check-for-nan-in-loss-and-grad|"
     r"--check-weight-hash-across-dp-replicas-interval|--train-sync-interval|--aml-data-download-path|"
     r"--distributed-timeout-seconds-after-init|--fake-process-group|--enable-experimental|--yaml-cfg|"
     r"--config-logger-dir|--version|--verbosity", NO_EFFECT, _CLUSTER),
    (r"--log-.*|--timing-log-.*|--no-barrier-with-level-1-timing|--tensorboard-log-interval|--wandb-entity|"
     r"--no-record-throughput|--memory-profile.*|--record-memory-history|--memory-snapshot-path|--pytorch-profiler-.*|"
     r"--profile_steps|--nvtx-ranges|--record-shapes|--no-log-learnig-rate-to-tensorboard|--log-level-replica|"
     r"--log-path|--save-(activations|dgrads|params|wgrads|tokens-per-expert)-interval|--dump-param-to-param-group-map|"
     r"--throughput-check-only|--moe-routing-trace-.*", NO_EFFECT, _LOGGING),
    (r"--empty-unused-memory-level|--(no-)?manual-gc.*|--no-pin-cpu-(grads|params)|--use-pin-memory|"
     r"--no-clone-scatter-output-in-embedding|--use-torch-optimizer-for-cpu-offload|--optimizer-offload-.*|"
     r"--overlap-cpu-optimizer-d2h-h2d|--max-tokens-to-oom", NO_EFFECT, _MEMORY),
    (r"--cuda-graph-.*|--enable-cuda-graph|--external-cuda-graph|--optimizer-cuda-graph|--decode-only-cuda-graphs|"
     r"--delay-offload-until-cuda-graph|--moe-pad-experts-for-cuda-graph-inference", NO_EFFECT, _CUDA_GRAPH),
    (r"--use-te|--use-te-activation-func|--te-rng-tracker|--export-te-mcore-model|--export-default-te-spec",
     NO_EFFECT, _TE),
    (r"--inference.*|--temperature|--top[-_]k|--top[-_]p|--topk-.*|--greedy|--out-seq-length|--num-tokens-to-.*|"
     r"--prompts?|--prompt-.*|--genfile|--sample-(input|output)-file|--return-log-probs|--top-n-logprobs|"
     r"--repetition[-_]penalty|--stop-words|--termination-id|--incoming-requests-.*|--flash-decode|"
     r"--num-speculative-tokens|--text-generate-.*|--output-(path|every-n-results|request-events|bert-embedders?)|"
     r"--enable-chunked-prefill|--disable-chunked-prefill|--prefill-chunk-size|--mlp-chunks-for-(prefill|training)|"
     r"--nccl-all-reduce-for-prefill|--use-legacy-static-engine|--skip-prompt-log-probs|--coordinator-schedule-.*|"
     r"--input-len|--drain-between-batches|--batch-boundaries|--mem-batch-size|--mem-infer-seq-len|--bpe-.*|"
     r"--num-samples|--model-provider|--use-same-sampling-seed-across-dp-ranks|--online-evaluation-config|"
     r"--export-.*|--modelopt-enabled|--time|--max-num-samples|--use-dataset-only|--test-mode",
     NO_EFFECT, _INFERENCE),
    (r"--(rl|grpo|langrl)-.*|--perform-rl-step|--refit-method|--mos", REFUSED,
     "reinforcement learning (GRPO) is not in rapidtrain"),
    (r"--(kd|distill).*|--load-teacher|.*-teacher|--logits-.*|--qad-train-target|--export-kd-.*", REFUSED,
     "knowledge distillation is not in rapidtrain"),
    (r"--(vision|dino|swin|mm|img|image)-.*|--patch-(dim|size)|--num-channels|--freeze-(ViT|clip-vision-tower|LM|llm)|"
     r"--tune-mm-mlp-adapter|--use-thumbnail|--use-tiling|--max-num-tiles|--num-frames|--temporal-patch-size|"
     r"--spatial-merge-size|--mrope-section|--classes-fraction|--data-per-class-fraction|--num-classes|--mask-factor|"
     r"--mask-type|--allow-missing-vision-projection-checkpoint|--cvcuda-image-processing|--vision-tower|"
     r"--language-model-type|--tile-factor|--disable-vision-class-token|--special-tokens|--pretrained-bert|"
     r"--image-folder|--binary-mask|--soft-mask|--use-gigatoken|--model-type-vlm|--basemodel-type", REFUSED,
     "vision and multimodal models are not in rapidtrain"),
    (r"--retro-.*|--ict-.*|--biencoder-.*|--bert-load|--titles-data-path|--evidence-data-path|--query-in-block-prob|"
     r"--use-one-sent-docs|--retriever-.*|--block-data-path|--indexer-.*|--embedding-path|--faiss-use-gpu|"
     r"--report-topk-accuracies|--bert-embedder-type", REFUSED,
     "retrieval models (RETRO, ICT, REALM) are not in rapidtrain"),
    (r"--(encoder|decoder)-(num-layers|seq-length)|--mean-noise-span-length|--noise-density|--source-seq-len|"
     r"--target-seq-len|--transformer-type", REFUSED,
     "encoder-decoder (T5) models are not in rapidtrain"),
    (r"--mamba-.*|--hybrid-.*|--is-hybrid-model|--linear-(attention-freq|conv-kernel-dim|key-head-dim|num-key-heads|"
     r"num-value-heads|value-head-dim)|--gdp-.*|--disable-mamba-mem-eff-path|--no-rope-freq|--mhc-.*|"
     r"--enable-mhc-connections|--experimental-attention-variant|--dsa-.*|--no-dsa-.*|"
     r"--heterogeneous-layers-config-.*", REFUSED, HYBRID_LAYERS),
    (r"--cache-mla-latents", REFUSED, "multi-head latent attention caches each head's key and value after the "
     "up-projection; caching the compressed latents (absorbing the up-projections) is not in rapidtrain"),
    (r"--mtp-.*|--freeze-base-for-mtp", REFUSED, "that multi-token prediction option is not in rapidtrain "
     "(--mtp-num-layers and --mtp-loss-scaling-factor are)"),
    (r"--apply-wd-to-qk-layernorm", REFUSED,
     "the q/k norms of --qk-layernorm get no weight decay, as every norm and bias (Megatron's default); decaying "
     "them is not in rapidtrain"),
    (r"--qk-(l2-norm|clip|clip-alpha|clip-threshold)|--mup-.*|--use-mup|"
     r"--lion-.*|--soap-.*|--use-bnb-optimizer|--no-weight-decay-cond-type", REFUSED,
     "not in rapidtrain (no QK L2-norm or clipping, muP, Lion or SOAP); use the defaults and --optimizer adamw or "
     "muon"),
    (r"--moe-(router-force-.*|router-quantile-balancing-ema|apply-probs-on-input|latent-size|layer-recompute|"
     r"mlp-glu-interleave-size|shared-expert-gate|shared-expert-glu-interleave-size|single-grouped-.*|"
     r"use-grouped-tensor|use-legacy-grouped-gemm|use-upcycling|upcycling-granularity|enable-routing-replay|"
     r"input-feature-slicing|paged-stash.*|expert-rank-capacity-factor|pad-expert-input-to-capacity|"
     r"token-drop-policy)|--use-grouped-gemm-for-.*|--normalize-router-logits|--moe-router-topk-limited-devices",
     REFUSED, "that Megatron-Core MoE option is not in rapidtrain's MoE layer (top-k softmax router, load-balancing "
              "and z-loss, capacity with token dropping or dropless)"),
    (r"--pipeline-model-parallel-split-rank|--standalone-embedding-stage|"
     r"--encoder-(pipeline|tensor)-model-parallel-size", REFUSED,
     "encoder-decoder splits and the legacy standalone embedding stage are not in rapidtrain; a stage of its own "
     "for the embedding is --pipeline-model-parallel-layout 'E|...' (other splits: --decoder-first/last-pipeline-"
     "num-layers, --account-for-embedding/loss-in-pipeline-split, --pp-partition-method)"),
    (r"--(hierarchical-context-parallel-sizes|hybrid-context-parallel|max-seqlen-per-dp-cp-rank)", REFUSED,
     "hierarchical and hybrid context parallelism are not in rapidtrain; use --context-parallel-size with "
     "--cp-comm-type p2p, allgather or a2a"),
    (r"--ds-sequence-parallel-fpdt.*|--force-ds-sequence-parallel", REFUSED,
     "DeepSpeed's FPDT (chunked, offloaded Ulysses) is not in rapidtrain; --ds-sequence-parallel-size serves "
     "Ulysses' all-to-all without the chunking"),
    (r"--cpu-offloading-retain-pinned-cpu-buffers", NO_EFFECT,
     "--cpu-offloading's host copies are torch.autograd.graph.save_on_cpu's, allocated per saved tensor; keeping "
     "pinned buffers between steps only saves their allocation"),
    (r"--(cpu-offloading|fine-grained-activation-offloading|activation-offload-fraction|offload-modules|"
     r"fine-grained-offloading-max-inflight-offloads|min-offloaded-tensor-size).*", REFUSED,
     "fine-grained (per-module, partial) activation offloading is not in rapidtrain; --cpu-offloading "
     "--cpu-offloading-num-layers N offloads whole layers, --checkpoint-activations recomputes them"),
    (r"--(outer-dp-sharding-strategy|enable-full-sharding-in-hsdp|replication|replication-factor|replication-jump)",
     REFUSED, "hybrid sharding and replication are not in rapidtrain; use --fsdp-memory-optimization"),
    (r"--fim-.*", REFUSED, "fill-in-the-middle data is not in rapidtrain"),
    (r"--(flextron.*|budget-.*|flex-.*|force-(emb|mamba|mlp|router-skip)|router-(beta|gbs|inter-dim|std)|"
     r"enable-router|tau-.*|linear-scaler-.*|layer-ranking-list|hard-sample-th|original-model-sample-prob|"
     r"param-budget-target|override-selected-budget|log-budgets|disable-budget|is-flex-eval|emb-.*|"
     r"moe-expert-(int|per)-list|mlp-(int|per)-list|slice|add-skipping|no-attn-skip|freeze-(router|model|"
     r"all-layers)|skip-(num-attn-layer|total-layer)-constraint|num-unique-layers|param-sharing-style|"
     r"phase-transition-iterations|loss-alpha|curr-iteration)", REFUSED,
     "Megatron's elastic (Flextron) training is not in rapidtrain"),
    (r"--(eval-(hf|dev|only|seq-length|batch-size|text-key|max-preds-per-seq)|strict-lambada|cloze-eval|"
     r"overlapping-eval|num-fewshot|task-list|full-validation|multiple-validation-sets|validation-set-names|"
     r"start-eval-at-iter)", REFUSED, "that evaluation mode is not in rapidtrain; evaluation runs --eval-iters "
                                      "batches of the validation split every --eval-interval"),
    (r"--(iterations-to-skip|skip-train-iteration-range|reset-iteration|override-ckpt-iteration|"
     r"data-parallel-random-init|suspend-.*|train-data-exact-num-epochs|data-epochs|iter-per-epoch|adaptive-seq-len)",
     REFUSED, "not in rapidtrain's loop; leave it out"),
    (r"--(train|valid|test)-(desc|doc-idx|idx|sample-idx|shuffle-idx)-path|--(data|per-split-data)-args-path|"
     r"--dataset-config|--per-dataset-sequences-path|--num-tokens-from-file|--input-data-sizes-file|"
     r"--finetune-(data-files|data-split|hf-dataset)|--use-npy-data-loader|--use-tfrecords|--val-data-path|--data-loader|"
     r"--s3-cache-path|--object-storage-cache-path|--enable-msc|--disable-msc|--dataloader-(save|fast-cache-load|"
     r"inter-document-masking|seq-length|defer-npy-index-mmap)|--mid-level-dataset-surplus|--sample-rate|"
     r"--return-data-index|--dataset-name-or-path|--split-transformers-data", REFUSED,
     "that data source is not in rapidtrain: give Megatron indexed data (--data-path, made by "
     "scripts/preprocess_data.py)"),
    (r"--load-tag", REFUSED,
     "DeepSpeed's tag to load instead of the one its `latest` file names: rapidtrain reads the tag `latest` names; "
     "write the tag there (echo global_stepN > DIR/latest), or leave --load-tag out"),
    (r"--exit-on-missing-checkpoint", REFUSED,
     "rapidtrain starts from scratch when --load holds no checkpoint (and the plan says so), as Megatron does "
     "without this flag; check the folder before launching, or leave the flag out"),
    (r"--sft|--sft-tokenizer-prompt-format", REFUSED,
     "Megatron-LM's SFT dataset renders each JSONL 'messages' line with its own prompt formats (nemotron-h-aligned "
     "and the others of --sft-tokenizer-prompt-format), which rapidtrain does not have; the same JSONL trains with "
     "--dataset JSON-SFT --train-mode finetune --train-data-path FILE (the tokenizer folder's chat template; "
     "--reset-position-ids --reset-attention-mask pack conversations as --sft does)"),
    (r"--chat-template", REFUSED,
     "a chat template given apart from the tokenizer is not read: --dataset JSON-SFT renders with the chat template "
     "of the --tokenizer-model folder (its tokenizer_config.json or chat_template.jinja); put the template there"),
    (r"--tokenizer-prompt-format", REFUSED,
     "Pai-Megatron-Patch's LLaVA prompt format (mistral, llama3, chatml) for its multimodal data; vision and "
     "multimodal models are not in rapidtrain"),
    (r"--(presplit-sentences|loose-json|text-key|delim|shuffle|max-preds-per-seq|cache-dir|tokenizer-model-type|"
     r"num-dataset-builder-threads|dataloader-.*)", NO_EFFECT,
     "a data-loading option of Megatron's 2019 loader or its dataset builder; rapidtrain reads indexed data made by "
     "scripts/preprocess_data.py"),
    (r"--(tokenizer-hf-.*|tokenizer-sentencepiece-legacy|tiktoken-.*|tokenizer-special-tokens|null-tokenizer-.*|"
     r"tokenizer-metadata|legacy-tokenizer|no-save-tokenizer-assets|no-use-tokenizer-model-from-checkpoint-args|"
     r"no-tokenizer-sentencepiece-ignore-extra-whitespaces)", NO_EFFECT,
     "a detail of Megatron's tokenizer wrappers; rapidtrain's tokenizers read the files as given"),
    (r"--(no-initialization|load-openai|llama-model|convert-checkpoint-from-megatron-to-transformers|"
     r"pretrained-.*|use-cpu-initialization)", NO_EFFECT,
     "a conversion or start-up option of Megatron's tools; rapidtrain loads Hugging Face folders with "
     "--pretrained-model-name-or-path and converts with `rapidtrain convert`"),
]
