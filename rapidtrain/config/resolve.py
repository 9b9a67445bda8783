"""Each component's settings resolved from the flags (with Megatron's meanings already applied): precision,
switches, data, tokenizer, schedule, checkpoint, logging, ZeRO, optimizer, LoRA. `config.plan.from_args` calls
these once; nothing after the plan does."""

from __future__ import annotations

import argparse
import functools
import json
import os
from typing import TYPE_CHECKING, Any, Literal

from rapidtrain.config.partitioning import (  # noqa: F401 (read_user_config: resolve's name for it, kept)
    PARTITIONING_SWITCHES,
    chosen_partitioning,
    read_user_config,
    zero_by_fsdp2,
    zero_stage,
)
from rapidtrain.config.pipeline_split import (
    V_SHAPED,
    SplitError,
    deepspeed_split,
    deepspeed_units,
    layout_split,
    megatron_split,
    parse_layout,
)
from rapidtrain.config.settings import (
    Batches,
    BatchSchedule,
    CheckpointSettings,
    CompileWith,
    DataSettings,
    DataSource,
    DistributedSettings,
    Layout,
    LoggingSettings,
    OffloadTarget,
    Partitioning,
    PartitioningEngine,
    Precision,
    ProfileSettings,
    RecomputeSettings,
    RunContext,
    ScheduleFrom,
    ScheduleSettings,
    Switches,
    TrackingSettings,
    TrainingSettings,
    ZeroSettings,
    expand_num_experts,
    rope_type_of,
)
from rapidtrain.data.tokenizer import TokenizerSettings
from rapidtrain.models.attention_backends import KERNEL_OF_NAME, AttentionSettings
from rapidtrain.models.attention_backends import resolve as resolve_attention
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.hf_config import initialises_builtin, is_megatron_checkpoint, trains_builtin_model

if TYPE_CHECKING:
    from rapidtrain.optim.grad_scaler import LossScaleSettings

if TYPE_CHECKING:
    from rapidtrain.models.lora import LoraSettings


def precision_of(args: argparse.Namespace, ctx: RunContext) -> Precision:
    """The flags' precision, and for --mixed-precision what the device does natively: fp16 on CUDA (Rapidformer
    documents --mixed-precision as fp16, and DESIGN.md keeps that meaning even on GPUs with native bf16, where the
    reason names --bf16), bf16 on a CPU with native bf16, else fp32."""
    if args.bf16:
        return Precision("bf16", "none", "--bf16: bf16 matmuls under autocast, fp32 master weights, no loss "
                         "scaling")
    if args.fp16:
        return Precision("fp16", _loss_scaling(args), "--fp16: fp16 autocast with loss scaling, fp32 master weights")
    if args.mixed_precision:
        if ctx.device_type == "cuda":
            return Precision("fp16", _loss_scaling(args), _cuda_mixed_precision_reason(args, ctx))
        cpu = ctx.capability.name or "this CPU"
        if ctx.capability.native_bf16:
            return Precision("bf16", "none", f"--mixed-precision on a CPU with native bf16 ({cpu} with AVX512-BF16 "
                             "or AMX) resolves to bf16: fp16 is not supported there (DeepSpeed refuses it, CPU fp16 "
                             "kernels are slow); bf16 needs no loss scaling")
        return Precision("fp32", "none", f"--mixed-precision on a CPU without native bf16 ({cpu}: no AVX512-BF16 "
                         f"or AMX) resolves to fp32: {EMULATED_BF16_COST}; fp16 is not supported on CPUs")
    return Precision("fp32", "none", "no precision flag: fp32")


def _cuda_mixed_precision_reason(args: argparse.Namespace, ctx: RunContext) -> str:
    """Why --mixed-precision is fp16 on a GPU, and what a GPU with native bf16 offers instead. Kept fp16 (not bf16
    where the GPU has it, as on a CPU, whose fp16 does not run): Rapidformer's scripts mean fp16 by it, and their
    runs' checkpoints carry a loss scaler and their loss curves fp16's skipped iterations."""
    gpu = ctx.capability.name or "this GPU"
    reason = (f"--mixed-precision on CUDA is fp16 autocast with {_loss_scaling(args)} loss scaling, the meaning "
              "Rapidformer documents (its scripts and loss-scaled checkpoints train and resume as they did)")
    if ctx.capability.native_bf16:
        return reason + f"; {gpu} computes bf16 natively: --bf16 trains without loss scaling or skipped iterations"
    return reason + f"; {gpu} has no native bf16 (compute capability below 8.0), so fp16 is also its fast choice"


EMULATED_BF16_COST = ("bf16 would be emulated in fp32 and be far slower, not faster (measured on an AVX2 EPYC: "
                      "0.73 s per step in fp32, more than 100 s in bf16)")


def precision_warnings(args: argparse.Namespace, ctx: RunContext, precision: Precision) -> list[str]:
    """An explicit --bf16 on a device that only emulates bf16, or --fp16 on a CPU, runs, but at a cost the user
    should know."""
    if precision.dtype == "fp16" and ctx.device_type == "cpu":
        scale = f"{args.loss_scale:g} (--loss-scale)" if args.loss_scale else (
            f"2^{int(args.initial_loss_scale).bit_length() - 1} (--initial-loss-scale)")
        return [f"--fp16 on a CPU runs fp16 autocast, but CPU fp16 kernels are slow (measured here: ~30x the fp32 "
                f"step of a tiny GPT) and the loss scale starts at {scale}: the first iterations overflow and are "
                "skipped, logged with no loss, until the scale has backed off (about one iteration per halving). "
                "Use fp32 (no flag) or --bf16 on a CPU with native bf16; for fp16 give a lower --initial-loss-scale"]
    if precision.dtype != "bf16" or ctx.capability.native_bf16:
        return []
    if ctx.device_type == "cuda":
        return [f"--bf16 on {ctx.capability.name or 'this GPU'}, which has no native bf16 (compute capability 8.0 "
                "or newer): torch emulates it, expect steps slower than fp32; use --fp16 (loss-scaled) on this GPU"]
    return [f"--bf16 on a CPU without native bf16 ({ctx.capability.name or 'this CPU'}: no AVX512-BF16 or AMX): "
            f"{EMULATED_BF16_COST}; drop --bf16 (fp32), or use --mixed-precision, which picks fp32 here"]


def _loss_scaling(args: argparse.Namespace) -> str:
    return f"static {args.loss_scale:g}" if args.loss_scale else "dynamic"


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        model_type=args.model_type,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        vocab_size=vocab_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon,
        position_embedding_type=args.position_embedding_type,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        bert_binary_head=args.bert_binary_head,
        num_tokentypes=2 if args.model_type == "bert" else 0,
        num_experts=expand_num_experts(args.num_experts, args.num_layers, args.moe_layer_freq),
        moe_router_topk=args.moe_router_topk,
        moe_capacity_factor=args.moe_capacity_factor,
        moe_min_capacity=args.moe_min_capacity,
        moe_token_dropping=not args.disable_moe_token_dropping,
        moe_aux_loss_coeff=args.moe_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_jitter_eps=args.moe_jitter_eps,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_aux_loss_type=getattr(args, "moe_aux_loss_type", "aux_loss"),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=shared_expert_size(args),
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        mtp_num_layers=mtp_depths(args),
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        normalization=args.normalization,
        swiglu=args.swiglu,
        num_query_groups=(args.num_query_groups or 1) if args.group_query_attention else None,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        rotary_base=args.rotary_base or 10000,
        rotary_percent=args.rotary_percent or 1.0,
        openai_gelu=args.openai_gelu,
        post_layernorm=args.post_layernorm,
        hf_weights=args.pretrained_model_name_or_path if initialises_builtin(args) else None,
        moe_residual=args.mlp_type == "residual",
        attention_kernel=KERNEL_OF_NAME[getattr(args, "attention_backend", "auto")],
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        **_rope_scaling(args),
        rotary_interpolation_factor=args.rotary_seq_len_interpolation_factor or 1.0,
        embed_layernorm=args.embed_layernorm,
        sliding_window=args.sliding_window,
        window_skip_freq=int(getattr(args, "window_attn_skip_freq", None) or 0),
        multi_latent_attention=args.multi_latent_attention,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        softmax_type=args.softmax_type,
        quick_geglu=args.quick_geglu,
        squared_relu=args.squared_relu,
        rotary_interleaved=args.rotary_interleaved,
        activation_clamp=args.activation_func_clamp_value,
        glu_linear_offset=args.glu_linear_offset,
        # Megatron-Core's router has a bias with --add-bias-linear; rapidtrain's MoE keeps DeepSpeed-MoE's bias-free
        # router (its checkpoints and scripts) except beside Megatron-Core's gpt-oss MLP, the quick-GEGLU.
        moe_router_bias=args.add_bias_linear and args.quick_geglu,
    )


def mtp_depths(args: argparse.Namespace) -> int:
    """Multi-token prediction's depths: Megatron-Core's --mtp-num-layers, else Pai's --use-multi-token-prediction
    with --num-mtp-predictor (1 when not given); 0: none."""
    if args.mtp_num_layers is not None:
        return args.mtp_num_layers
    return (args.num_mtp_predictor or 1) if args.use_multi_token_prediction else 0


def shared_expert_size(args: argparse.Namespace) -> int | None:
    """The shared experts' hidden size (all of them together): Megatron-Core's --moe-shared-expert-intermediate-size,
    else Pai's --shared-moe-ffn-hidden-size (Qwen) or --num-shared-experts × the routed experts' size (DeepSeek),
    each with or without Pai's --enable-shared-expert (a size asks for them); None: no shared experts."""
    if args.moe_shared_expert_intermediate_size:
        return args.moe_shared_expert_intermediate_size
    if not (args.enable_shared_expert or args.num_shared_experts or args.shared_moe_ffn_hidden_size):
        return None
    if args.shared_moe_ffn_hidden_size:
        return args.shared_moe_ffn_hidden_size
    expert_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    return args.num_shared_experts * expert_size if args.num_shared_experts and expert_size else None


def _rope_scaling(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of rope scaling: Llama 3.1's (--use-rope-scaling) or YaRN's (--rope-type yarn)."""
    if rope_type_of(args) == "yarn":
        beta_fast, beta_slow = args.yarn_beta_fast, args.yarn_beta_slow
        return dict(rope_scaling="yarn", rope_scaling_factor=args.rotary_scaling_factor,
                    rope_original_max_positions=args.yarn_original_max_position_embeddings or 4096,
                    yarn_beta_fast=32.0 if beta_fast is None else beta_fast,
                    yarn_beta_slow=1.0 if beta_slow is None else beta_slow,
                    yarn_mscale=args.mscale, yarn_mscale_all_dim=args.mscale_all_dim,
                    yarn_round_range=args.yarn_correction_range_round_to_int is not False)
    return dict(rope_scaling="llama3" if args.use_rope_scaling else "none",
                rope_scaling_factor=args.rope_scaling_factor)


def attention_settings(args: argparse.Namespace) -> AttentionSettings:
    return resolve_attention(getattr(args, "attention_backend", "auto"), args.reset_attention_mask)


def is_pretraining(args: argparse.Namespace, ctx: RunContext) -> bool:
    """rapidtrain's own iteration-based pretraining of the built-in model (no user script)."""
    return args.task == "pretraining" and not ctx.script


def data_settings(args: argparse.Namespace, ctx: RunContext) -> DataSettings:
    from rapidtrain.config.arguments import is_megatron_task, uses_demo_data

    if is_pretraining(args, ctx):
        source: DataSource = "demo" if uses_demo_data(args) else "indexed"
    elif ctx.script:
        source = "demo" if uses_demo_data(args) and args.task == "pretraining" else "script"
    elif is_megatron_task(args):
        source = "task"
    else:
        source = "finetune"
    return DataSettings(
        source=source, data_path=tuple(args.data_path or ()), split=args.split, data_impl=args.data_impl,
        cache_path=args.data_cache_path, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        **loader_choice(args, ctx, source), seed=args.seed, eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob,
        dynamic_shape=args.data_iterator == "dynamic-shape", data_dir=args.data_dir, data_name=args.data_name,
        split_paths=split_paths_of(args), keep_last=args.keep_last, mmap_warmup=args.mmap_warmup,
        padding_free=args.padding_free, weighted_splits=getattr(args, "weighted_split_groups", None),
        raw_json=getattr(args, "raw_json_dataset", None), max_padding_length=getattr(args, "max_padding_length", None),
        idxmap_sft=bool(getattr(args, "idxmap_sft", False)),
        train_data=tuple(args.train_data or ()) if source == "task" else (),
        valid_data=tuple(args.valid_data or ()) if source == "task" else ())


def loader_choice(args: argparse.Namespace, ctx: RunContext, source: DataSource) -> dict[str, Any]:
    """DataLoader workers and pinned memory by device and data source (--num-workers overrides the count), with the
    reason the plan prints. Measured on a 2-core EPYC (docs/first-hour.md): the demo's wait for a batch is 2-7 ms
    in the process against 6-16 ms through two workers, whose processes also take the cores the model needs."""
    pin = ctx.device_type == "cuda"
    pinning = ("pinned memory, so each batch copies to the GPU beside the computation" if pin else
               "no pinned memory (nothing is copied to a GPU)")
    if args.num_workers is not None:
        return {"num_workers": args.num_workers, "pin_memory": pin, "loader_reason": f"--num-workers; {pinning}"}
    if ctx.device_type == "cpu" and source in ("demo", "indexed"):
        return {"num_workers": 0, "pin_memory": pin, "loader_reason": "a CPU run on memory-mapped tokens: a "
                "sample is a slice of the file, cheaper made here than handed over by a worker process that would "
                f"also take a core from the computation; {pinning}"}
    why = ("a GPU run: workers prepare the next batches while the GPU computes" if ctx.device_type == "cuda" else
           "samples are tokenized or collated in Python, which workers do beside the computation")
    return {"num_workers": 2, "pin_memory": pin, "loader_reason": f"{why}; {pinning}"}


def split_paths_of(args: argparse.Namespace) -> tuple[tuple[str, ...] | None, ...] | None:
    """Megatron's per-split data (--train-data-path ...), or None when --data-path is split by --split."""
    paths = [getattr(args, f"{split}_data_path", None) for split in ("train", "valid", "test")]
    if not any(paths):
        return None
    return tuple(tuple(p) if p else None for p in paths)


STEP_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """Megatron's --step-batch-size-schedule "0:768 250B:1536 ...": thresholds in tokens (K/M/B/T suffixes)
    turned into samples by --seq-length, sorted; ValueError names what is wrong."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, size = entry.partition(":")
        if not sep:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH")
        steps.append((_count(threshold) // seq_length, _count(size)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError("the first threshold must be 0")
    if any(b[0] <= a[0] for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError("thresholds must be strictly increasing (in samples: tokens / --seq-length)")
    if any(size <= 0 for _, size in steps):
        raise ValueError("batch sizes must be positive")
    return tuple(steps)


def _count(text: str) -> int:
    text = text.strip().upper()
    multiplier = STEP_SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if multiplier > 1 else text) * multiplier)
    except ValueError:
        raise ValueError(f"{text!r} is not a number (K/M/B/T suffixes allowed)") from None


def batch_schedule_of(args: argparse.Namespace) -> BatchSchedule | None:
    """--rampup-batch-size or --step-batch-size-schedule as a BatchSchedule (validated by the rules)."""
    if args.rampup_batch_size:
        start, increment, samples = args.rampup_batch_size
        return BatchSchedule("rampup", start=start, increment=increment, rampup_samples=samples)
    if args.step_batch_size_schedule:
        return BatchSchedule("steps", steps=parse_step_schedule(args.step_batch_size_schedule, args.seq_length))
    return None


def tokenizer_settings_of(args: argparse.Namespace) -> TokenizerSettings | None:
    """The tokenizer of the pretraining data: the flags', or the demo corpus's; None when there is none."""
    from rapidtrain.config.arguments import uses_demo_data

    if uses_demo_data(args) and args.tokenizer_type is None:
        from rapidtrain.data.demo import demo_tokenizer_settings

        return demo_tokenizer_settings()
    if args.tokenizer_type is None:
        return None
    return TokenizerSettings(
        tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        tensor_model_parallel_size=args.tensor_model_parallel_size)


def builtin_vocab_size(args: argparse.Namespace, tokenizer: TokenizerSettings | None) -> int | None:
    """The built-in model's padded vocabulary (Megatron's padding: a multiple of --make-vocab-size-divisible-by
    × TP), or None when no built-in model is trained (a Hugging Face model, or no tokenizer to size it by).
    A Hugging Face model initialising it counts with its own vocabulary, if larger (all its embedding rows must
    fit; rows added by padding start at zero)."""
    if not trains_builtin_model(args):
        return None
    from rapidtrain.data.tokenizer import padded_vocab_size, tokenizer_vocab_size
    from rapidtrain.models.hf_config import pretrained_vocab_size

    vocab = max(tokenizer_vocab_size(tokenizer) if tokenizer is not None else 0, pretrained_vocab_size(args) or 0)
    if not vocab:
        return None
    return padded_vocab_size(vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def training_settings(args: argparse.Namespace, batches: Batches) -> TrainingSettings:
    eval_interval = args.eval_interval
    if eval_interval is None and args.task == "pretraining":
        eval_interval = 1000  # Megatron's default; fine-tuning evaluates after each epoch instead
    train_iters = args.train_iters
    if args.train_samples is not None:  # Megatron's update_train_iters: ramp-up iterations, then whole batches
        train_iters = batches.iterations_for_samples(args.train_samples)
    return TrainingSettings(train_iters=train_iters, epochs=args.epochs, eval_interval=eval_interval,
                            eval_iters=args.eval_iters, seed=args.seed, exit_interval=args.exit_interval,
                            exit_duration_in_mins=args.exit_duration_in_mins, train_samples=args.train_samples,
                            per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
                            on_sigterm="save" if args.save else ("stop" if args.exit_signal_handler else "default"),
                            exit_signal=args.exit_signal)


def checkpoint_settings(args: argparse.Namespace, vocab_size: int | None = None,
                        batches: Batches | None = None) -> CheckpointSettings:
    schedule_from: ScheduleFrom = "flags" if args.override_opt_param_scheduler else (
        "checkpoint" if args.use_checkpoint_opt_param_scheduler else "same")
    pretrained = is_megatron_checkpoint(args) and args.load == args.pretrained_model_name_or_path \
        and args.load != args.save
    return CheckpointSettings(save=args.save, save_interval=args.save_interval, load=args.load,
                              finetune=args.finetune, load_optimizer=not args.no_load_optim,
                              load_rng=not args.no_load_rng, schedule_from=schedule_from,
                              async_save=getattr(args, "async_save", False), load_is_pretrained_model=pretrained,
                              pretrained_model=args.pretrained_model_name_or_path,
                              pretrained_checkpoint=megatron_task_checkpoint(args),
                              load_format=foreign_checkpoint_kind(args.load, args.universal_checkpoint),
                              universal_checkpoint=args.universal_checkpoint,
                              flags=recorded_flags(args, vocab_size, batches))


def foreign_checkpoint_kind(load: str | None, universal: bool = False) -> str | None:
    """What another tool's --load folder is (from its file names), for the plan; None for rapidtrain's own."""
    from rapidtrain.checkpoint.foreign_formats import detect_foreign

    found = detect_foreign(load, universal) if load else None
    return found.describe() if found is not None else None


def megatron_task_checkpoint(args: argparse.Namespace) -> str | None:
    from rapidtrain.config.arguments import is_megatron_task

    return getattr(args, "pretrained_checkpoint", None) if is_megatron_task(args) else None


def recorded_flags(args: argparse.Namespace, vocab_size: int | None, batches: Batches | None = None) -> dict[str, Any]:
    """The flags as plain JSON values, with the built-in model's padded vocabulary and the global batch the run
    resolved (as Megatron's args carry them: a resume compares values, not whether a flag was typed)."""
    from rapidtrain.config.arguments import flag_values

    flags = json.loads(json.dumps(flag_values(args), default=str))
    if vocab_size:
        flags["padded_vocab_size"] = vocab_size
    if batches is not None:
        flags["global_batch_size"] = batches.global_batch_size
    return flags


def logging_settings(args: argparse.Namespace, ctx: RunContext, precision: Precision, tf32: bool) -> LoggingSettings:
    from rapidtrain.core.peak_flops import peak_flops

    peak = peak_flops(ctx.device_type, ctx.capability.name, precision.dtype, tf32, args.peak_tflops)
    return LoggingSettings(
        log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir, peak_tflops=peak.tflops,
        peak_source=peak.source,
        loss_log_file=args.loss_log_file, tracking=tracking_settings(args),
        tensorboard_queue_size=args.tensorboard_queue_size, timers_to_tensorboard=args.log_timers_to_tensorboard,
        batch_size_to_tensorboard=args.log_batch_size_to_tensorboard,
        validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
        memory_to_tensorboard=args.log_memory_to_tensorboard,
        world_size_to_tensorboard=args.log_world_size_to_tensorboard,
        learning_rate_to_tensorboard=args.log_learning_rate_to_tensorboard,
        loss_scale_to_tensorboard=args.log_loss_scale_to_tensorboard, params_norm=args.log_params_norm,
        logging_path=args.logging_path, show_library_warnings=args.show_library_warnings)


def tracking_settings(args: argparse.Namespace) -> TrackingSettings | None:
    project, experiment = getattr(args, "wandb_project", None), getattr(args, "mlflow_experiment", None)
    if not project and not experiment:
        return None
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    return TrackingSettings(wandb_project=project or None, wandb_exp_name=args.wandb_exp_name,
                            wandb_save_dir=save_dir if project else None, mlflow_experiment=experiment or None,
                            mlflow_tracking_uri=args.mlflow_tracking_uri if experiment else None,
                            mlflow_run_name=(args.mlflow_run_name or args.wandb_exp_name) if experiment else None)


def profile_settings(args: argparse.Namespace) -> ProfileSettings:
    if not getattr(args, "profile", False):
        return ProfileSettings()
    return ProfileSettings(True, args.profile_step_start, args.profile_step_end, tuple(args.profile_ranks),
                           args.tensorboard_dir or "profile")


def distributed_settings(args: argparse.Namespace, ctx: RunContext) -> DistributedSettings:
    backend = args.distributed_backend or ("nccl" if ctx.device_type == "cuda" else "gloo")
    return DistributedSettings(backend="cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
                               timeout_minutes=args.distributed_timeout_minutes)


def schedule_settings(args: argparse.Namespace) -> ScheduleSettings:
    sample_based = args.train_samples is not None
    return ScheduleSettings(lr=args.lr or 0.0, min_lr=args.min_lr, decay_style=args.lr_decay_style,
                            decay_iters=args.lr_decay_iters, warmup_iters=args.lr_warmup_iters,
                            warmup_fraction=args.lr_warmup_fraction, wsd_decay_iters=args.lr_wsd_decay_iters,
                            warmup_init=args.lr_warmup_init, wsd_decay_style=args.lr_wsd_decay_style,
                            decay_samples=(args.lr_decay_samples or args.train_samples) if sample_based else None,
                            warmup_samples=args.lr_warmup_samples, wsd_decay_samples=args.lr_wsd_decay_samples)


def loss_scale_settings(args: argparse.Namespace) -> LossScaleSettings:
    from rapidtrain.optim.grad_scaler import LossScaleSettings

    return LossScaleSettings(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                             min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                             hysteresis=args.hysteresis)


def switches_of(args: argparse.Namespace, layout: Layout, ctx: RunContext) -> Switches:
    chosen = [PARTITIONING_SWITCHES[dest] for dest in chosen_partitioning(args)]
    partitioning: Partitioning = chosen[0] if chosen else "none"
    engine: PartitioningEngine
    if partitioning.startswith("zero"):
        engine = "fsdp2" if zero_by_fsdp2(args) else "deepspeed"
    elif partitioning in ("oss", "sdp") and args.sharding_backend == "fairscale":
        engine = "fairscale"
    else:
        by_switch: dict[str, PartitioningEngine] = {"oss": "zero-redundancy", "sdp": "fsdp2", "fsdp": "fsdp2"}
        engine = by_switch.get(partitioning, "ddp")
    compile_with: CompileWith = "none"
    if args.onnx_runtime_training:
        compile_with = "ortmodule" if ort_status()[0] else "inductor"
    elif args.torch_compile:
        compile_with = "inductor"
    recompute = recompute_of(args)
    return Switches(partitioning, engine, args.cpu_offload, recompute.enabled, compile_with,
                    args.data_iterator == "dynamic-shape", compile_backend=args.torch_compile_backend,
                    compile_mode=args.torch_compile_mode, deepspeed_config_file=args.deepspeed_config,
                    tf32=args.tf32 and ctx.device_type == "cuda",
                    build_on_meta=model_construction(args, ctx, layout, partitioning, engine)[0],
                    cpu_allocator_tuning=args.cpu_allocator_tuning and ctx.device_type == "cpu",
                    cpu_threads=cpu_threads(ctx)[0], recompute=recompute)


def recompute_of(args: argparse.Namespace) -> RecomputeSettings:
    """Megatron's meanings: --recompute-activations is selective; --checkpoint-activations and the 2021-22
    --activations-checkpoint-method are full recompute (the rules refuse flags that disagree)."""
    granularity = args.recompute_granularity
    if granularity is None:
        if args.recompute_activations:
            granularity = "selective"
        elif args.checkpoint_activations or args.activations_checkpoint_method:
            granularity = "full"
        else:
            granularity = "none"
    method: Literal["uniform", "block"] = args.recompute_method or args.activations_checkpoint_method or "uniform"
    return RecomputeSettings(granularity, method, args.recompute_num_layers or 1,
                             moe_layers=bool(getattr(args, "moe_layer_recompute", False) and args.num_experts),
                             offload_layers=args.cpu_offloading_num_layers if args.cpu_offloading else 0,
                             modules=tuple(dict.fromkeys(args.recompute_modules or ()))
                             if granularity == "selective" and args.recompute_modules else ("core_attn",))


def model_construction(args: argparse.Namespace, ctx: RunContext, layout: Layout, partitioning: str,
                       engine: str) -> tuple[bool, str]:
    """(build the built-in model on meta?, why) for the built-in pretraining: on meta wherever the layout shards
    the model (FSDP, SDP, ZeRO-3 over several ranks; tensor or pipeline parallelism), so no rank holds it whole."""
    sharding = [name for name, shards in (
        (f"--{partitioning}" if not partitioning.startswith("zero") else f"ZeRO stage {partitioning[-1]}",
         partitioning in ("fsdp", "sdp", "zero-3") and engine != "fairscale" and layout.data_parallel_size > 1),
        ("tensor parallelism", layout.tensor_parallel_size > 1),
        ("pipeline parallelism", layout.pipeline_parallel_size > 1)) if shards]
    if not sharding or not (is_pretraining(args, ctx) and trains_builtin_model(args)):
        return False, ""
    if layout.expert_parallel_size > 1:
        return False, "built whole on every rank: expert parallelism slices the experts of a materialized model"
    if engine == "deepspeed" and initialises_builtin(args):
        return False, "built whole on every rank: ZeRO-3 copies the Hugging Face weights from a whole model"
    return True, " and ".join(sharding)


def parameters_are_dtensors(layout: Layout, switches: Switches) -> bool:
    """Whether the optimizer receives DTensor parameters: tensor parallelism (and composable `replicate`, data
    parallel beside it) and FSDP2 (FSDP, SDP, ZeRO-1/2 with TP/PP) make them; one process, DDP (pipeline stages'
    too), ZeroRedundancyOptimizer, FairScale and DeepSpeed hand over plain tensors."""
    if layout.tensor_parallel_size > 1:
        return True
    return layout.data_parallel_size > 1 and switches.partitioning_engine == "fsdp2"


def optimizer_settings(args: argparse.Namespace, layout: Layout | None = None, switches: Switches | None = None):
    """The optimizer's own settings; `--optimizer` (beyond Rapidformer) overrides `--optimizers`. With the
    layout, they say whether the parameters are DTensors (the implementation is chosen from that)."""
    from rapidtrain.optim.optimizers import OptimizerSettings

    name = args.optimizer or args.optimizers
    if name == "adam":  # Megatron's --optimizer adam is Adam with decoupled weight decay, i.e. AdamW
        name = "adamw"
    if name == "dist_muon":  # Megatron-Core's Muon with its state sharded; here the layout decides where state lives
        name = "muon"
    dtensors = layout is not None and switches is not None and parameters_are_dtensors(layout, switches)
    decoupled_lr = getattr(args, "decoupled_lr", None)  # Megatron-Core's flags (config/surface_meanings.py)
    decoupled_min_lr = getattr(args, "decoupled_min_lr", None)
    return OptimizerSettings(name=name, lr=args.lr or 0.0, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             sgd_momentum=args.sgd_momentum, dtensor_parameters=dtensors, decoupled_lr=decoupled_lr,
                             decoupled_min_lr=None if decoupled_lr is None else
                             (args.min_lr if decoupled_min_lr is None else decoupled_min_lr),
                             muon_momentum=args.muon_momentum, muon_nesterov=args.muon_nesterov,
                             muon_ns_steps=args.muon_num_ns_steps, muon_scale_mode=args.muon_scale_mode,
                             muon_extra_scale_factor=args.muon_extra_scale_factor)


def uses_deepspeed(args: argparse.Namespace, layout: Layout) -> bool:
    """ZeRO switches are served by DeepSpeed unless tensor/pipeline parallelism asks for FSDP2 instead."""
    return zero_stage(args) > 0 and layout.tensor_parallel_size == layout.pipeline_parallel_size == 1


def cores_per_rank(local_ranks: int) -> int:
    """This machine's usable cores shared among the node's ranks (at least one each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores // max(local_ranks, 1), 1)


def local_ranks(ctx: RunContext) -> int:
    """The ranks on this node: torchrun's LOCAL_WORLD_SIZE, or the planned world over the nodes."""
    nodes = int(os.environ.get("NNODES", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", max(ctx.world_size // max(nodes, 1), 1)))


def cpu_adam_threads(ctx: RunContext) -> int:
    """DeepSpeedCPUAdam's OpenMP threads: an explicit OMP_NUM_THREADS other than torchrun's default of 1, else
    the cores per rank (torchrun sets 1, which would leave the offloaded optimizer step on one core)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 1:
        return int(given)
    return cores_per_rank(local_ranks(ctx))


def cpu_threads(ctx: RunContext) -> tuple[int, str, str]:
    """A CPU run's intra-op threads per rank to set (0: leave them), what runs, and why. The node's cores shared
    among its ranks: more threads than cores make the ranks' threads wait on each other (a loaded 2-core host ran
    4x slower with 2 threads per rank than with 1). OMP_NUM_THREADS, when the user set it, is kept: torchrun sets 1
    itself for several local ranks, so a 1 there counts as torchrun's."""
    if ctx.device_type != "cpu":
        return 0, "", ""
    given, ranks = os.environ.get("OMP_NUM_THREADS", ""), local_ranks(ctx)
    if given.isdigit() and int(given) >= 1 and (int(given) > 1 or ranks == 1):
        return 0, f"torch intra-op threads: {given} per rank", f"OMP_NUM_THREADS={given}, as given"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = cores_per_rank(ranks)
    return threads, f"torch intra-op threads: {threads} per rank", (
        f"this machine's {cores} cores shared among {ranks} local rank{'s' if ranks > 1 else ''}, so no rank's "
        "threads wait on another's (OMP_NUM_THREADS sets another count)")


def zero_settings(args: argparse.Namespace, layout: Layout, ctx: RunContext) -> ZeroSettings | None:
    if not uses_deepspeed(args, layout):
        return None
    nvme = args.nvme_offload_dir
    offload_optimizer: OffloadTarget = "nvme" if nvme else "cpu" if args.cpu_offload else "none"
    offload_params: OffloadTarget = "nvme" if nvme else "cpu" if args.cpu_offload_params else "none"
    offloads = offload_optimizer != "none" or offload_params != "none"
    return ZeroSettings(
        stage=zero_stage(args), overlap_comm=args.zero_overlap_comm,
        contiguous_gradients=args.zero_contiguous_gradients,
        reduce_bucket_size=args.zero_reduce_bucket_size, allgather_bucket_size=args.zero_allgather_bucket_size,
        stage3_prefetch_bucket_size=args.zero_stage3_prefetch_bucket_size,
        stage3_param_persistence_threshold=args.zero_stage3_param_persistence_threshold,
        stage3_max_live_parameters=args.zero_stage3_max_live_parameters,
        offload_optimizer=offload_optimizer, offload_params=offload_params, nvme_path=nvme,
        # Page-locked host buffers let CUDA copy asynchronously; a CPU-only run has nothing to pin for.
        pin_memory=offloads and ctx.device_type == "cuda",
        cpu_adam_threads=cpu_adam_threads(ctx) if offload_optimizer != "none" else None,
        defaulted=zero_keys_defaulted(args),
    )


# The --zero-* flags of DeepSpeed's zero_optimization keys (the key is the name without "zero_").
ZERO_FLAG_DESTS = ("zero_overlap_comm", "zero_contiguous_gradients", "zero_reduce_bucket_size",
                   "zero_allgather_bucket_size", "zero_stage3_prefetch_bucket_size",
                   "zero_stage3_param_persistence_threshold", "zero_stage3_max_live_parameters")


@functools.cache
def zero_flag_defaults() -> dict[str, Any]:
    from rapidtrain.config.arguments import _add_memory

    parser = argparse.ArgumentParser(add_help=False)  # the group that declares them, not every flag
    _add_memory(parser)
    return {dest: parser.get_default(dest) for dest in ZERO_FLAG_DESTS}


def zero_keys_defaulted(args: argparse.Namespace) -> tuple[str, ...]:
    """DeepSpeed's names of the ZeRO sizes and switches whose --zero-* flags the user left at their defaults."""
    return tuple(dest.removeprefix("zero_") for dest, default in zero_flag_defaults().items()
                 if getattr(args, dest) == default)


def load_in_bits(args: argparse.Namespace) -> Literal[4, 8] | None:
    return 4 if args.load_in_4bit else 8 if args.load_in_8bit else None


def lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    """The adapters' and k-bit base's settings of a Hugging Face fine-tune, or the built-in model's adapters (None
    for a built-in model without them)."""
    builtin = trains_builtin_model(args)
    if builtin and args.lora_rank <= 0:
        return None
    from rapidtrain.models.lora import LoraSettings

    return LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                        target_modules=tuple(args.lora_target_modules or ()), load_in_bits=load_in_bits(args),
                        builtin=builtin)


def ort_status() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None:
        return False, ("onnxruntime-training is not installed (its last release, 1.19.2, does not import "
                       "with torch 2.13)")
    try:
        from onnxruntime.training.ortmodule import ORTModule  # noqa: F401
    except Exception as error:  # any failure means it cannot serve; say why
        return False, f"onnxruntime.training does not import with this torch: {type(error).__name__}: {error}"
    return True, ""


# ---- the pipeline: schedule, virtual stages, layers per stage (config/pipeline_split.py's arithmetic) ----


def pipeline_schedule_of(args: argparse.Namespace) -> str:
    """--pipeline-schedule, or Megatron-DeepSpeed's --enable-zbh1-pipeline (zero bubble), else 1F1B."""
    return args.pipeline_schedule or ("zero-bubble" if args.enable_zbh1_pipeline else "1f1b")


def virtual_stages_of(args: argparse.Namespace) -> int:
    """Stages per pipeline rank: a layout's stages over P, two for the V schedules, or the virtual-stage flags."""
    pp = args.pipeline_model_parallel_size
    if pp < 2:
        return 1
    if args.pipeline_model_parallel_layout:
        return max(len(parse_layout(args.pipeline_model_parallel_layout)) // pp, 1)
    if pipeline_schedule_of(args) in V_SHAPED:
        return 2
    if args.num_virtual_stages_per_pipeline_rank:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage:
        layers = args.num_layers + args.account_for_embedding_in_pipeline_split \
            + args.account_for_loss_in_pipeline_split
        return max(layers // pp // args.num_layers_per_virtual_pipeline_stage, 1)
    return 1


def uneven_split_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that split the pipeline other than evenly."""
    flags = [("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers is not None),
             ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers is not None),
             ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
             ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
             ("--pipeline-model-parallel-layout", bool(args.pipeline_model_parallel_layout)),
             ("--pp-partition-method", bool(args.pp_partition_method))]
    return [flag for flag, given in flags if given]


def pipeline_split_of(args: argparse.Namespace, model: ModelConfig | None = None) -> tuple[int, ...]:
    """Transformer layers per pipeline stage, in model order (one entry without pipelining). Raises SplitError,
    naming the flags and numbers, for a split that cannot be made. DeepSpeed's `parameters` method weighs each layer
    by its parameters, which needs `model`; without it every layer weighs alike."""
    pp, virtual = args.pipeline_model_parallel_size, virtual_stages_of(args)
    uneven = uneven_split_flags(args)
    if pp < 2:
        uneven = [flag for flag in uneven if flag != "--pp-partition-method"]  # DeepSpeed's: one stage holds all
        if uneven:
            raise SplitError(f"{', '.join(uneven)} split pipeline stages: they need --pipeline-model-parallel-size "
                             f"≥ 2 (it is {pp}). Drop them or pipeline the model.")
        return (args.num_layers,)
    if len([f for f in uneven if f in ("--pipeline-model-parallel-layout", "--pp-partition-method")]) > 1 or (
            (args.pipeline_model_parallel_layout or args.pp_partition_method) and len(uneven) > 1):
        raise SplitError(f"{' and '.join(uneven)} each decide the pipeline split: give one of them")
    schedule = pipeline_schedule_of(args)
    if args.pipeline_model_parallel_layout:
        split = layout_split(args.pipeline_model_parallel_layout, pp, args.num_layers, mtp_depths(args))
    elif args.pp_partition_method:
        if virtual > 1:
            raise SplitError(f"--pp-partition-method {args.pp_partition_method} splits one stage per pipeline rank "
                             "(DeepSpeed's pipeline has no virtual stages): drop the virtual stages or give "
                             "--pipeline-model-parallel-layout")
        split = deepspeed_split(args.pp_partition_method, _deepspeed_units(args, model), pp)
    else:
        if schedule in V_SHAPED and uneven:
            raise SplitError(f"{', '.join(uneven)} with --pipeline-schedule {schedule}: its V puts stages r and "
                             f"2P-1-r on rank r, so Megatron's first/last pipeline rank is no stage; give "
                             "--pipeline-model-parallel-layout instead")
        split = megatron_split(args.num_layers, pp, virtual, first=args.decoder_first_pipeline_num_layers,
                               last=args.decoder_last_pipeline_num_layers,
                               embedding=args.account_for_embedding_in_pipeline_split,
                               loss=args.account_for_loss_in_pipeline_split)
    if schedule in V_SHAPED and len(split) != 2 * pp:
        raise SplitError(f"--pipeline-schedule {schedule} runs two stages per pipeline rank ({2 * pp}); the split has "
                         f"{len(split)}")
    return split


def _deepspeed_units(args: argparse.Namespace, model: ModelConfig | None) -> list[tuple[str, int]]:
    from rapidtrain.models.counting import pipeline_unit_parameters

    sixteen_bit = bool(args.fp16 or args.bf16)
    if model is None:
        return deepspeed_units(args.num_layers, tied=not args.untie_embeddings_and_output_weights,
                               rmsnorm=args.normalization == "RMSNorm", sixteen_bit=sixteen_bit)
    embedding, layers, norm, head = pipeline_unit_parameters(model)
    return deepspeed_units(model.num_layers, tied=model.tie_embeddings, rmsnorm=model.normalization == "RMSNorm",
                           sixteen_bit=sixteen_bit, embedding_parameters=embedding, layer_parameters=layers,
                           norm_parameters=norm, head_parameters=head)
