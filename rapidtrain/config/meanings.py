"""Megatron's and Rapidformer's meanings of flags, applied once when the flags are parsed.

Leniencies (Megatron warns where rapidtrain used to refuse), translations (the distributed optimizer, a
Megatron-format checkpoint named by --pretrained-model-name-or-path, per-split data) and derived values user
scripts read from get_args() (`moe`, `zero_stage`). Each change and each flag accepted without an effect
here leaves a line in `args.compat_notes`, which the plan prints: nothing is dropped silently.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rapidtrain.config.partitioning import chosen_partitioning, zero_stage
from rapidtrain.config.settings import MEGATRON_TASKS, rope_type_of
from rapidtrain.models.config import shape_past_bounds
from rapidtrain.models.hf_config import is_megatron_checkpoint

Args = argparse.Namespace

# Multi-head latent attention's and YaRN's flags (each changes nothing without --multi-latent-attention / YaRN).
MLA_FLAGS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
             "v_head_dim")
YARN_FLAGS = ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_beta_fast", "yarn_beta_slow",
              "yarn_original_max_position_embeddings", "yarn_correction_range_round_to_int")

# Shape flags a Megatron-format checkpoint fixes; those not given on the command line are taken from the flags
# it was saved with (as Megatron's --use-checkpoint-args does), and the load refuses any that differ.
CHECKPOINT_SHAPE_FLAGS = (
    "model_type", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
    "position_embedding_type", "normalization", "layernorm_epsilon", "swiglu", "group_query_attention",
    "num_query_groups", "add_bias_linear", "add_qkv_bias", "rotary_base", "rotary_percent", "openai_gelu",
    "post_layernorm", "untie_embeddings_and_output_weights", "bert_binary_head", "num_experts", "moe_layer_freq",
    "moe_router_topk", "mlp_type", "make_vocab_size_divisible_by", "kv_channels", "qk_layernorm", "use_rope_scaling",
    "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "embed_layernorm", "sliding_window",
    "window_attn_skip_freq", *MLA_FLAGS, *YARN_FLAGS, "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias", "softmax_type", "quick_geglu",
    "glu_linear_offset", "activation_func_clamp_value", "squared_relu", "rotary_interleaved",
)

# Megatron-family flags that set a shape flag under another name (surface_meanings.py's handlers): given, they keep
# the checkpoint's saved value from replacing theirs, as the shape flag itself would.
SHAPE_SET_BY = {"sliding_window": ("window_size",), "num_query_groups": ("num_key_value_heads",),
                "group_query_attention": ("num_key_value_heads",),
                "make_vocab_size_divisible_by": ("pad_vocab_size_to", "padded_vocab_size")}


def apply_megatron_meanings(args: Args, given: set[str], entry: str | None = None,
                            earlier_notes: list[str] | None = None) -> None:
    """`entry`: the built-in pretraining's entry point (pretrain.py, pretrain_gpt.py, ...), None for a user script
    or fine-tuning. `earlier_notes`: those of the Megatron-family flags already applied (surface_meanings.py)."""
    notes: list[str] = list(earlier_notes or [])
    _bert_binary_head(args)
    _sequence_parallel(args, notes)
    _megatron_checkpoint_folder(args, given, notes)
    _finetune_without_load(args, notes)
    _distributed_optimizer(args, notes)
    if entry is not None and args.task == "pretraining":
        _per_split_data(args, notes)
    _finetune_data_path(args, notes)
    if args.use_expert_residual_network:
        args.mlp_type = "residual"
    if args.moe_router_pre_softmax and args.moe_router_score_function != "softmax":
        args.moe_router_pre_softmax = False  # Megatron-Core's router reads it for softmax scores only
        notes.append(f"--moe-router-pre-softmax: no effect with --moe-router-score-function "
                     f"{args.moe_router_score_function} (Megatron-Core applies it to softmax scores only); the k "
                     "chosen scores are normalised to sum 1 when --moe-router-topk > 1")
    # What Megatron's and Rapidformer's args carry for user scripts.
    args.moe = bool(args.num_experts) and max(args.num_experts) > 1
    args.zero_stage = zero_stage(args)
    notes += _flags_without_effect(args, given, entry)
    args.compat_notes = notes


def _bert_binary_head(args: Args) -> None:
    """Megatron's default: BERT has its binary head unless --bert-no-binary-head."""
    if args.bert_binary_head is None:
        args.bert_binary_head = args.model_type == "bert"


def _sequence_parallel(args: Args, notes: list[str]) -> None:
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
        notes.append("--sequence-parallel is turned off: it splits norms and dropout over tensor-parallel ranks and "
                     "--tensor-model-parallel-size is 1 (Megatron does the same)")


def _megatron_checkpoint_folder(args: Args, given: set[str], notes: list[str]) -> None:
    if not is_megatron_checkpoint(args):
        return
    folder = args.pretrained_model_name_or_path
    has_checkpoint = (Path(folder) / "latest_checkpointed_iteration.txt").exists()
    if args.load is None:
        args.load = folder
        loads = "loads it as --load does (model only, from iteration 0, with --finetune or in a Finetuner template)"
        fresh = "holds no checkpoint yet, so training starts from scratch and --save writes there (a later run " \
                "resumes from it)"
        what = loads if has_checkpoint else fresh
        notes.append(f"--pretrained-model-name-or-path {folder} is a Megatron-format checkpoint folder "
                     f"(Rapidformer's meaning): the run {what}")
    if has_checkpoint:
        _shape_from_checkpoint(args, given, folder, notes)


def _shape_from_checkpoint(args: Args, given: set[str], folder: str, notes: list[str]) -> None:
    from rapidtrain.checkpoint.checkpointer import CheckpointError, iteration_dir, latest_iteration, read_common

    try:
        directory = iteration_dir(folder, latest_iteration(folder) or 0)
        common = read_common(directory)
    except CheckpointError:
        return  # loading it reports the problem, naming the file
    saved = dict(common.get("args") or {})
    # A user script may have set args.model_type to Megatron's ModelType: the saved plan says which model it is.
    saved_model = (common.get("plan") or {}).get("model") or {}
    if isinstance(saved_model, dict) and saved_model.get("model_type") in ("gpt", "bert"):
        saved["model_type"] = saved_model["model_type"]
    taken = []
    for dest in CHECKPOINT_SHAPE_FLAGS:
        typed = dest in given or any(flag in given for flag in SHAPE_SET_BY.get(dest, ()))
        if dest in saved and not typed and getattr(args, dest, None) != saved[dest]:
            expected = [] if dest == "num_experts" else getattr(args, dest, None)  # a list, even when unset
            if not _fits(saved[dest], expected) or shape_past_bounds({dest: saved[dest]}):
                raise CheckpointError(f"{directory / 'common.json'}: damaged: its saved {dest} is {saved[dest]!r}; "
                                      "resume from another iteration, or give the shape flags yourself.")
            setattr(args, dest, saved[dest])
            taken.append(dest)
    if taken:
        notes.append(f"model shape taken from the checkpoint in {folder} (flags not given): "
                     + ", ".join("--" + d.replace("_", "-") for d in taken))


def _fits(saved: Any, current: Any) -> bool:
    """A saved shape value is of the kind the flag holds (damage that left valid JSON would fail far from the file):
    the current value's type, or for a flag without a value, a number, a word, a switch or a list of counts."""
    def count_list(value: Any) -> bool:
        return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)

    if isinstance(current, bool):
        return isinstance(saved, bool)
    if isinstance(current, int):
        return type(saved) is int and saved >= 0
    if isinstance(current, float):
        return type(saved) in (int, float) and saved >= 0
    if isinstance(current, str):
        return isinstance(saved, str)
    if isinstance(current, (list, tuple)):
        return count_list(saved)
    return saved is None or isinstance(saved, (bool, str)) or count_list(saved) or (
        type(saved) in (int, float) and saved >= 0)


def _finetune_without_load(args: Args, notes: list[str]) -> None:
    if args.finetune and args.task in MEGATRON_TASKS:
        notes.append("--finetune: Megatron's tasks start the model from --pretrained-checkpoint at iteration 0 "
                     "whether or not it is given")
    elif args.finetune and not args.load:
        notes.append("--finetune without --load does nothing (no checkpoint to take the model from); the model "
                     "starts from its initialisation, as in Megatron")


def _distributed_optimizer(args: Args, notes: list[str]) -> None:
    if not args.use_distributed_optimizer:
        return
    chosen = chosen_partitioning(args)
    if chosen:
        notes.append(f"--use-distributed-optimizer: the optimizer state is already sharded over data-parallel ranks "
                     f"by --{chosen[0].replace('_', '-')}")
        return
    if args.expert_model_parallel_size > 1:
        notes.append("--use-distributed-optimizer is not applied: expert parallelism does not combine with optimizer-"
                     "state sharding yet, so every data-parallel rank keeps the whole optimizer state")
        return
    three_d = args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1
    if three_d:
        args.zero_1_memory_optimization = True
        how = "FSDP2 over the data-parallel dimension (as --zero-1-memory-optimization does with tensor/pipeline " \
              "parallelism; gradients are reduce-scattered too, so memory is ZeRO-2's)"
    else:
        args.oss_memory_optimization = True
        how = "torch ZeroRedundancyOptimizer beside DistributedDataParallel (as --oss-memory-optimization)"
    notes.append("--use-distributed-optimizer: Megatron's optimizer-state sharding over data-parallel ranks, served "
                 f"by {how}")


def _per_split_data(args: Args, notes: list[str]) -> None:
    """Megatron tasks' --train-data/--valid-data/--test-data name the built-in pretraining's per-split data."""
    for split in ("train", "valid", "test"):
        files = getattr(args, f"{split}_data")
        if files and getattr(args, f"{split}_data_path") is None:
            setattr(args, f"{split}_data_path", list(files))
            notes.append(f"--{split}-data: the built-in pretraining reads it as --{split}-data-path (indexed data)")


def _finetune_data_path(args: Args, notes: list[str]) -> None:
    """Rapidformer's black-box example names the fine-tuning data with --data-path (`--data-path glue
    --data-name mrpc`): with no --data-dir, fine-tuning reads it as --data-dir."""
    if args.task == "pretraining" or not args.data_path or args.data_dir:
        return
    if len(args.data_path) == 1:
        args.data_dir = args.data_path[0]
        notes.append(f"--data-path {args.data_path[0]}: fine-tuning reads it as --data-dir (Rapidformer's usage)")
    else:
        notes.append(f"--data-path {' '.join(args.data_path)}: not read by fine-tuning, whose data come from "
                     "--data-dir / --data-name")


# Flags that describe the built-in model or its data; beside a Hugging Face model fine-tuned as it is they change
# nothing (the shape flags are checked against its config.json instead, rules.py).
BUILTIN_ONLY_FLAGS = (
    "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", "make_vocab_size_divisible_by",
    "model_type", "hidden_dropout", "attention_dropout", "init_method_std", "layernorm_epsilon",
    "position_embedding_type", "normalization", "swiglu", "group_query_attention", "num_query_groups",
    "add_bias_linear", "add_qkv_bias", "rotary_base", "rotary_percent", "openai_gelu", "post_layernorm",
    "kv_channels", "qk_layernorm", "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
    "untie_embeddings_and_output_weights", "bert_binary_head", "embed_layernorm", "sliding_window", "softmax_type",
    "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "squared_relu", "rotary_interleaved",
    "split",
    *MLA_FLAGS, *YARN_FLAGS, "data_impl", "eod_mask_loss",
    "reset_position_ids", "reset_attention_mask", "short_seq_prob",
)


def hugging_face_notes(args: Args, has_script: bool) -> list[str]:
    """The black-box fine-tuning of a Hugging Face folder: flags given that describe the built-in model, its
    tokenizer or its data, which this run does not read (a user script reads them itself from get_args())."""
    from rapidtrain.models.hf_config import fine_tuned_config

    if has_script or fine_tuned_config(args) is None:
        return []
    given = getattr(args, "given_flags", ())
    notes = []
    unused = [f"--{d.replace('_', '-')}" for d in BUILTIN_ONLY_FLAGS if d in given]
    if unused:
        notes.append(f"{', '.join(unused)}: not used; fine-tuning takes the model, its tokenizer and its dropout "
                     f"from {args.pretrained_model_name_or_path} (config.json and tokenizer files)")
    if "eval_iters" in given:
        notes.append("--eval-iters: fine-tuning evaluates the whole validation set (after each epoch, and every "
                     "--eval-interval iterations when given), as Megatron's fine-tuning tasks do")
    return notes


def _latent_and_yarn_without_effect(args: Args, given: set[str]) -> list[str]:
    """MLA's sizes without --multi-latent-attention, YaRN's values without YaRN: accepted, and said to do nothing."""
    notes = []
    sizes = [f"--{d.replace('_', '-')}" for d in MLA_FLAGS[1:] if d in given]
    if sizes and not args.multi_latent_attention:
        notes.append(f"{', '.join(sizes)}: no effect without --multi-latent-attention")
    if args.multi_latent_attention and args.use_rope_scaling:
        # Megatron-Core builds Llama 3.1's scaled rope only for standard attention; MLA rotates its own rope part
        # (YaRN's with --rope-type yarn), so DeepSeek's scripts that pass both train without it.
        notes.append("--use-rope-scaling: no effect with --multi-latent-attention (Llama 3.1's rope scaling is "
                     "standard attention's; MLA's rope part is " + ("YaRN's" if rope_type_of(args) == "yarn"
                                                                   else "unscaled") + ", as in Megatron-Core)")
        args.use_rope_scaling = False
    yarn = [f"--{d.replace('_', '-')}" for d in YARN_FLAGS[1:] if d in given]
    if yarn and rope_type_of(args) != "yarn":
        notes.append(f"{', '.join(yarn)}: no effect without YaRN (--rope-type yarn"
                     + (", or a --rotary-scaling-factor other than 1 with --multi-latent-attention)" if
                        args.multi_latent_attention else ")"))
    return notes


# The fine-grained MoE flags that shape routed experts (what they change needs MoE layers).
ROUTER_FLAGS = ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
                "moe_router_bias_update_rate", "moe_router_force_load_balancing", "moe_ffn_hidden_size")


def _router_and_mtp_without_effect(args: Args, given: set[str]) -> list[str]:
    """Router and multi-token prediction values given where nothing reads them (Megatron ignores them too)."""
    notes = []
    dense = not args.num_experts or not any(args.num_experts)
    unread = [f"--{dest.replace('_', '-')}" for dest in ROUTER_FLAGS if dest in given and dense]
    if unread:
        notes.append(f"{', '.join(unread)}: no effect without --num-experts (no MoE layer routes)")
    if "moe_router_bias_update_rate" in given and not dense and not args.moe_router_enable_expert_bias:
        notes.append("--moe-router-bias-update-rate: no effect without --moe-router-enable-expert-bias")
    if args.mtp_num_layers is None and not args.use_multi_token_prediction:
        for dest in ("mtp_loss_scaling_factor", "num_mtp_predictor"):
            if dest in given:
                notes.append(f"--{dest.replace('_', '-')}: no effect without --mtp-num-layers (or Pai's "
                             "--use-multi-token-prediction)")
    return notes


def _flags_without_effect(args: Args, given: set[str], entry: str | None) -> list[str]:
    """A line for each flag given that is accepted for compatibility but changes nothing here, and why."""
    notes = []
    if "ddp_impl" in given:
        notes.append(f"--DDP-impl {args.ddp_impl}: data parallelism is torch DistributedDataParallel (gradients "
                     "bucketed and all-reduced during backward) whichever is named; the averaged gradients are "
                     "Megatron's")
    if "use_contiguous_buffers_in_local_ddp" in given:
        notes.append("--no-contiguous-buffers-in-local-ddp: no effect; torch DDP keeps gradients in its own buckets")
    for flag in ("use_mcore_models", "use_legacy_models"):
        if getattr(args, flag):
            notes.append(f"--{flag.replace('_', '-')}: no effect; rapidtrain has one implementation of each built-in "
                         "model")
    for flag in ("app_name", "user_defined_parameters"):
        if getattr(args, flag) is not None:
            notes.append(f"--{flag.replace('_', '-')}: for the user script (get_args().{flag}); rapidtrain's own "
                         "templates do not read it")
    if args.deepspeed and not args.zero_stage:
        notes.append("--deepspeed: DeepSpeed serves the --zero-*-memory-optimization switches; without one this run "
                     "does not use DeepSpeed")
    tensorboard = ("tensorboard_queue_size", "log_timers_to_tensorboard", "log_batch_size_to_tensorboard",
                   "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard", "log_world_size_to_tensorboard")
    if not args.tensorboard_dir and any(flag in given for flag in tensorboard):
        notes.append("TensorBoard flags without --tensorboard-dir: nothing is written (as in Megatron)")
    if args.keep_last and entry is not None:
        notes.append("--keep-last: no effect in iteration-based pretraining (it keeps a fine-tuning epoch's last, "
                     "incomplete micro-batch)")
    if "rope_scaling_factor" in given and not args.use_rope_scaling:
        notes.append(f"--rope-scaling-factor {args.rope_scaling_factor:g}: no effect without --use-rope-scaling (as "
                     "in Megatron)")
    if args.cpu_offloading and args.cpu_offloading_num_layers == 0:
        notes.append("--cpu-offloading with --cpu-offloading-num-layers 0: no layer's activations go to host memory "
                     "(as in Megatron-Core); give the number of layers")
    if "cpu_offloading_num_layers" in given and not args.cpu_offloading:
        notes.append(f"--cpu-offloading-num-layers {args.cpu_offloading_num_layers}: no effect without "
                     "--cpu-offloading (as in Megatron-Core)")
    if args.moe_layer_recompute and not args.num_experts:
        notes.append("--moe-layer-recompute: no effect without --num-experts (no MoE layer to recompute)")
    notes += _latent_and_yarn_without_effect(args, given)
    notes += _router_and_mtp_without_effect(args, given)
    moe_options = ("router_type", "moe_linear_layer_type", "top_k_linear_strategy")
    if any(flag in given for flag in moe_options):
        notes.append("--router-type 0 / --moe-linear-layer-type standard / --top-k-linear-strategy normal: the "
                     "built-in MoE is exactly this (top-k gating by one linear layer, load-balancing loss, plain "
                     "expert linear layers)")
    return notes
