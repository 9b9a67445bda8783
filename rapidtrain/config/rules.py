"""The conflict table: one row per rule, each a predicate and a message naming flags, reason and fix.

`validate` reports every violated row at once. `docs/compatibility.md` is generated from this table
(`python -m rapidtrain.config.rules --write-docs`), and a test fails when the file is out of date.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from rapidtrain.config import arguments
from rapidtrain.config.arguments import TASKS
from rapidtrain.config.partitioning import chosen_partitioning, zero_stage
from rapidtrain.config.plan import (
    RunContext,
    data_parallel_size,
    expand_num_experts,
    layout_of,
    optimizer_settings,
    precision_of,
    read_user_config,
    switches_of,
    zero_by_fsdp2,
)
from rapidtrain.models import hf_config
from rapidtrain.models.attention_backends import KERNEL_OF_NAME

Args = argparse.Namespace


@dataclass(frozen=True)
class Rule:
    name: str
    flags: tuple[str, ...]  # the flags the rule is about, for the docs' matrix
    summary: str  # the rule in words, for the docs
    violated: Callable[[Args, RunContext], bool]
    message: Callable[[Args, RunContext], str]


class FlagConflict(SystemExit):
    """Raised with every violated rule's message; exits with status 2 when uncaught."""

    def __init__(self, messages: list[str]):
        self.messages = messages
        super().__init__(2)

    def __str__(self) -> str:
        return format_conflicts(self.messages)


def format_conflicts(messages: list[str]) -> str:
    lines = [f"rapidtrain: {len(messages)} problem(s) with the flags:"]
    lines += [f"  - {m}" for m in messages]
    return "\n".join(lines)


def _partitioning(args: Args) -> list[str]:
    return chosen_partitioning(args)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _tp(args: Args) -> int:
    return args.tensor_model_parallel_size


def _pp(args: Args) -> int:
    return args.pipeline_model_parallel_size


def _three_d(args: Args) -> bool:
    return _tp(args) > 1 or _pp(args) > 1


def _dp(args: Args, ctx: RunContext) -> int:
    return data_parallel_size(ctx.world_size, _tp(args), _pp(args))


def _layout_divides(args: Args, ctx: RunContext) -> bool:
    return _tp(args) >= 1 and _pp(args) >= 1 and ctx.world_size % (_tp(args) * _pp(args)) == 0


def _accumulation_steps(args: Args, ctx: RunContext) -> int | None:
    """Micro-batches per iteration, when the batch flags divide (another rule reports when they do not)."""
    if not _layout_divides(args, ctx) or args.micro_batch_size < 1:
        return None
    per_step = args.micro_batch_size * _dp(args, ctx)
    global_batch = args.global_batch_size or per_step
    return global_batch // per_step if global_batch % per_step == 0 else None


def _uses_hf_model(args: Args) -> bool:
    """A Hugging Face model is trained (fine-tuning tasks, user scripts); with --task pretraining the folder
    only gives the built-in model its initial weights."""
    return not hf_config.trains_builtin_model(args)


def _query_groups(args: Args) -> int:
    return (args.num_query_groups or 1) if args.group_query_attention else args.num_attention_heads


def _deepspeed_zero(args: Args) -> bool:
    return zero_stage(args) > 0 and not zero_by_fsdp2(args)


def _optimizer_choice(args: Args) -> tuple[str, str]:
    """(name, flag that chose it): `--optimizer` overrides `--optimizers`."""
    return (args.optimizer, "--optimizer") if args.optimizer else (args.optimizers, "--optimizers")


def _sliding_window(args: Args) -> int | None:
    """The sliding window a Hugging Face model that initialises the built-in one attends within, if any."""
    if not hf_config.initialises_builtin(args) or hf_config.unsupported_reason(args):
        return None
    config = hf_config.read_config(args.pretrained_model_name_or_path)
    if config.get("model_type") == "qwen2" and not config.get("use_sliding_window"):
        return None
    return config.get("sliding_window")


def _lengths(args: Args) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in ("train_iters", "train_samples", "epochs")
            if getattr(args, n, None) is not None]


def _warmups(args: Args) -> list[str]:
    given = [("--lr-warmup-fraction", args.lr_warmup_fraction is not None),
             ("--lr-warmup-iters", args.lr_warmup_iters > 0), ("--lr-warmup-samples", args.lr_warmup_samples > 0)]
    return [flag for flag, present in given if present]


def _mixed_schedule_flags(args: Args) -> list[str]:
    """Schedule flags counted in the other unit than the training length."""
    if args.train_samples is not None:
        names = (("lr_decay_iters", None), ("lr_warmup_iters", 0), ("lr_wsd_decay_iters", None))
    else:
        names = (("lr_decay_samples", None), ("lr_warmup_samples", 0), ("lr_wsd_decay_samples", None))
    return [f"--{n.replace('_', '-')}" for n, unset in names if getattr(args, n) not in (unset, None)]


def _batch_schedule_problem(args: Args) -> str | None:
    from rapidtrain.config.plan import parse_step_schedule

    if args.rampup_batch_size and args.step_batch_size_schedule:
        return "--rampup-batch-size and --step-batch-size-schedule both change the global batch; keep one."
    if args.step_batch_size_schedule:
        try:
            parse_step_schedule(args.step_batch_size_schedule, max(args.seq_length, 1))
        except ValueError as error:
            return (f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: {error}. Write "
                    "'THRESHOLD:BATCH ...' with thresholds in tokens from 0, e.g. '0:16 1M:32'.")
        return None
    if not args.rampup_batch_size:
        return None
    start, increment, samples = args.rampup_batch_size
    final = args.global_batch_size
    if final is None:
        return "--rampup-batch-size ramps up to --global-batch-size: give it (Megatron requires it too)."
    if start < 1 or increment < 1 or samples < 0:
        return (f"--rampup-batch-size {start} {increment} {samples}: the start and the increment are positive and "
                "the ramp-up samples not negative.")
    if start > final or (final - start) % increment:
        return (f"--rampup-batch-size {start} {increment} {samples} with --global-batch-size {final}: the ramp goes "
                f"from {start} up to {final} in whole steps of {increment}, so {final} - {start} must be a "
                f"non-negative multiple of {increment}.")
    return None


def _batch_schedule_misfits(args: Args, ctx: RunContext) -> list[int]:
    """Global batches of the ramp-up / step schedule that do not split into whole micro-batches."""
    from rapidtrain.config.plan import batch_schedule_of

    if _batch_schedule_problem(args) is not None or not _layout_divides(args, ctx) or args.micro_batch_size < 1:
        return []
    schedule = batch_schedule_of(args)
    if schedule is None:
        return []
    per_step = args.micro_batch_size * _dp(args, ctx)
    if args.num_layers_per_virtual_pipeline_stage and _pp(args) > 1:
        per_step *= _pp(args)
    final = args.global_batch_size or per_step
    return [size for size in schedule.sizes(final) if size % per_step]


def _different_folders(a: str, b: str) -> bool:
    from pathlib import Path

    return Path(a).resolve() != Path(b).resolve()


def _deepspeed_config_problem(args: Args) -> str | None:
    if not args.deepspeed_config:
        return None
    if not _deepspeed_zero(args):
        return (f"--deepspeed_config {args.deepspeed_config}: its settings apply where DeepSpeed runs, which is a "
                "--zero-1/2/3-memory-optimization switch without tensor/pipeline parallelism here. Add one, or drop "
                "--deepspeed_config.")
    try:
        read_user_config(args.deepspeed_config)
    except ValueError as error:
        return str(error)
    return None


def _per_split_problem(args: Args, ctx: RunContext) -> str | None:
    splits = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if not any(splits):
        return None
    if args.data_path:
        return ("--data-path with --train-data-path / --valid-data-path / --test-data-path: the per-split paths "
                "replace --data-path and its --split. Give one form (Megatron refuses both too).")
    if _needs_iterations(args, ctx) and not args.train_data_path:
        return "--valid-data-path / --test-data-path without --train-data-path: pretraining needs training data."
    if args.data_iterator == "dynamic-shape":
        return ("--data-iterator dynamic-shape reads the documents of one --data-path prefix; with per-split data "
                "drop it, or give --data-path PREFIX --split instead.")
    return None


LOW_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "adamw_4bit")
NON_ELEMENTWISE_OPTIMIZERS = ("apex_lamb", "adafactor")  # per-parameter norms or factored statistics
OFFLOADABLE_OPTIMIZERS = ("apex_adam", "adamw", "adam")  # what DeepSpeedCPUAdam implements


def _low_bit_optimizer_problem(args: Args, ctx: RunContext) -> str | None:
    """Why no library serves the chosen 8/4-bit optimizer on this layout and device (None: one does)."""
    if _optimizer_choice(args)[0] not in LOW_BIT_OPTIMIZERS or not _layout_divides(args, ctx):
        return None
    from rapidtrain.optim.optimizers import low_bit_optimizer_problem

    layout = layout_of(args, ctx)
    return low_bit_optimizer_problem(optimizer_settings(args, layout, switches_of(args, layout, ctx)), ctx.device_type)


def _lora_settings_given(args: Args) -> list[str]:
    given = [("--lora-alpha", args.lora_alpha is not None), ("--lora-dropout", args.lora_dropout != 0.0),
             ("--lora-target-modules", bool(args.lora_target_modules))]
    return [flag for flag, is_given in given if is_given]


def _bad_lora_values(args: Args) -> list[str]:
    bad = []
    if args.lora_rank < 0:
        bad.append(f"--lora-rank {args.lora_rank} must be >= 0 (0 turns LoRA off)")
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        bad.append(f"--lora-alpha {args.lora_alpha:g} must be > 0")
    if not 0.0 <= args.lora_dropout < 1.0:
        bad.append(f"--lora-dropout {args.lora_dropout:g} must be in [0, 1)")
    return bad


def _k_bit_flag(args: Args) -> str:
    return "--load-in-4bit" if args.load_in_4bit else "--load-in-8bit"


def _k_bit_problem(args: Args, ctx: RunContext) -> str | None:
    if not (args.load_in_4bit or args.load_in_8bit):
        return None
    from rapidtrain.optim.optimizers import bitsandbytes_problem

    return bitsandbytes_problem(ctx.device_type, kernels="4/8-bit layer")


def _compile_settings_given(args: Args) -> list[str]:
    given = [("--torch-compile-backend", args.torch_compile_backend != "inductor"),
             ("--torch-compile-mode", args.torch_compile_mode is not None)]
    return [flag for flag, is_given in given if is_given]


def _compiles(args: Args) -> bool:
    """Whether torch.compile runs: --torch-compile, or --onnx-runtime-training where ORTModule cannot serve."""
    if args.torch_compile:
        return True
    if args.onnx_runtime_training:
        from rapidtrain.config.plan import _ort_status

        return not _ort_status()[0]
    return False


def _compile_backends() -> list[str]:
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


ZERO_DEFAULTS = {dest: arguments.build_parser().get_default(dest) for dest in (
    "zero_overlap_comm", "zero_contiguous_gradients", "zero_reduce_bucket_size", "zero_allgather_bucket_size",
    "zero_stage3_prefetch_bucket_size", "zero_stage3_param_persistence_threshold", "zero_stage3_max_live_parameters")}


def _zero_settings_given(args: Args, stage3_only: bool = False) -> list[str]:
    """The DeepSpeed ZeRO flags given other values than their defaults (stage-3 ones only, if asked)."""
    dests = [d for d in ZERO_DEFAULTS if not stage3_only or "stage3" in d]
    flags = [_flag(d) for d in dests if getattr(args, d) != ZERO_DEFAULTS[d]]
    return [f.replace("--zero-overlap-comm", "--no-zero-overlap-comm").replace(
        "--zero-contiguous-gradients", "--no-zero-contiguous-gradients") for f in flags]


def _async_io_problem() -> str | None:
    """Why DeepSpeed's async I/O op (ZeRO-Infinity's NVMe offload) cannot build here, or None when it can."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as error:  # DeepSpeed missing or broken: say so rather than fail
        return f"DeepSpeed's AsyncIOBuilder does not import ({type(error).__name__}: {error})"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("DeepSpeed's async_io op cannot build here: it needs libaio's headers and library (Debian/Ubuntu: "
                "apt-get install libaio-dev)")
    return None


def _experts(args: Args) -> list[int]:
    return [e for e in expand_num_experts(args.num_experts, args.num_layers, args.moe_layer_freq) if e > 0]


def _num_experts_length_ok(args: Args) -> bool:
    """One count, one per layer, or one per MoE layer with MoE layers at a fixed interval (DeepSpeed's pyramid)."""
    return not args.num_experts or len(args.num_experts) == 1 or (
        args.num_layers >= 1 and args.num_layers % len(args.num_experts) == 0)


def _needs_iterations(args: Args, ctx: RunContext) -> bool:
    # A user script runs its own template (an epoch-based Finetuner or own loop too), whatever --task says.
    return args.task == "pretraining" and not (args.user_script or ctx.script)


def _positive_sizes(args: Args) -> list[str]:
    names = ("micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "num_query_groups")
    bad = [_flag(n) for n in names if getattr(args, n) is not None and getattr(args, n) < 1]
    if args.global_batch_size is not None and args.global_batch_size < 1:
        bad.append("--global-batch-size")
    return bad


def _non_finite_or_negative(args: Args) -> list[str]:
    names = ("lr", "min_lr", "weight_decay", "clip_grad")
    return [f"{_flag(n)} {getattr(args, n)}" for n in names
            if getattr(args, n) is not None and not (math.isfinite(getattr(args, n)) and getattr(args, n) >= 0)]


def _not_positive_counts(args: Args) -> list[str]:
    """Counts that must be at least 1 when given: a 0 would divide by zero or never log, evaluate or stop."""
    names = ("train_iters", "epochs", "log_interval", "eval_interval", "save_interval", "exit_interval",
             "nproc_per_node", "distributed_timeout_minutes")
    bad = [f"{_flag(n)} {getattr(args, n)}" for n in names
           if getattr(args, n, None) is not None and getattr(args, n) < 1]
    return bad + [f"{_flag(n)} {getattr(args, n)}" for n in ("eval_iters", "num_workers")
                  if getattr(args, n, None) is not None and getattr(args, n) < 0]


# (flag, low, high, high included): probabilities; a dropout of 1 zeroes every activation.
FRACTIONS = (("hidden_dropout", 0.0, 1.0, False), ("attention_dropout", 0.0, 1.0, False),
             ("mask_prob", 0.0, 1.0, True), ("short_seq_prob", 0.0, 1.0, True),
             ("adam_beta1", 0.0, 1.0, False), ("adam_beta2", 0.0, 1.0, False))


def _outside_range(args: Args) -> list[str]:
    bad = []
    for name, low, high, closed in FRACTIONS:
        value = getattr(args, name, None)
        if value is None:  # an entry point fills it in later
            continue
        if not (low <= value <= high if closed else low <= value < high):  # NaN fails both
            bad.append(f"{_flag(name)} {value} (allowed [{low:g}, {high:g}{']' if closed else ')'})")
    return bad


SEED_LIMIT = 2**32  # numpy's RandomState, which orders the data, takes seeds in [0, 2**32)


def _split_problem(args: Args, ctx: RunContext) -> str | None:
    """Why --split cannot be used, or None: unparseable, all zero, or no training share in pretraining."""
    from rapidtrain.data.gpt_dataset import parse_split
    from rapidtrain.data.index_cache import DataConfigError

    try:
        weights = parse_split(args.split)
    except DataConfigError as error:
        return str(error)
    if _needs_iterations(args, ctx) and weights[0] == 0:
        return (f"--split {args.split!r} gives the training split no documents; pretraining needs a positive first "
                "(train) weight, e.g. --split 969,30,1")
    return None


# The sample stream's indices take about 28 bytes per sample (sample index 16, shuffle index 8, document index
# ~4): beyond 2**36 samples (~1.8 TiB of indices, 35 times the largest public pretraining runs of ~2·10^9
# samples) the count is a typo, not a plan.
MAX_TRAIN_SAMPLES = 2**36
INDEX_BYTES_PER_SAMPLE = 28


def _train_samples(args: Args, ctx: RunContext) -> int | None:
    if args.train_samples is not None:
        return args.train_samples
    if args.train_iters is None or args.train_iters < 1 or args.micro_batch_size < 1:
        return None
    return args.train_iters * (args.global_batch_size or args.micro_batch_size * max(_dp(args, ctx), 1))


# Options of a switch that is off would be accepted and do nothing: each is refused without its switch.
TRACKER_OPTIONS = (("wandb_exp_name", "wandb_project"), ("wandb_save_dir", "wandb_project"),
                   ("mlflow_tracking_uri", "mlflow_experiment"), ("mlflow_run_name", "mlflow_experiment"),
                   ("profile_step_start", "profile"), ("profile_step_end", "profile"), ("profile_ranks", "profile"),
                   ("async_save", "save"))


def _options_without_switch(args: Args) -> list[str]:
    given = set(getattr(args, "given_flags", ()))
    return [f"{_flag(option)} needs {_flag(switch)}" for option, switch in TRACKER_OPTIONS
            if option in given and not getattr(args, switch, None)]


def _recompute_granularities(args: Args) -> list[str]:
    """The granularity each recompute flag given asks for (Megatron's meanings)."""
    asked = []
    if args.recompute_granularity:
        asked.append(f"--recompute-granularity {args.recompute_granularity}")
    if args.recompute_activations:
        asked.append("--recompute-activations (selective)")
    if args.checkpoint_activations:
        asked.append("--checkpoint-activations (full)")
    if args.activations_checkpoint_method:
        asked.append(f"--activations-checkpoint-method {args.activations_checkpoint_method} (full)")
    return asked


def _recompute_problem(args: Args) -> str | None:
    asked = _recompute_granularities(args)
    kinds = {text.split()[-1].strip("()") for text in asked}
    if len(kinds) > 1:
        return f"{' and '.join(asked)} ask for different recompute granularities; keep one."
    method, layers = args.recompute_method or args.activations_checkpoint_method, args.recompute_num_layers
    if not asked and (method or layers is not None):
        return ("--recompute-method / --recompute-num-layers choose which layers are recomputed, and no recompute "
                "was asked for: add --recompute-granularity full (or op).")
    if kinds == {"selective"} and (method or layers is not None):
        return ("--recompute-granularity selective recomputes the attention core of every layer; "
                "--recompute-method / --recompute-num-layers do not apply to it (as in Megatron): drop them.")
    if layers is not None and layers < 1:
        return f"--recompute-num-layers {layers} must be at least 1."
    if (method or "uniform") == "uniform" and (layers or 1) > 1:
        return (f"--recompute-method uniform --recompute-num-layers {layers}: rapidtrain recomputes in units of one "
                "layer, not chunks of several; use --recompute-num-layers 1 (every layer), or --recompute-method "
                f"block --recompute-num-layers {layers} to recompute only the first {layers} layers of each stage.")
    backend = getattr(args, "attention_backend", "auto")
    if kinds == {"selective"} and KERNEL_OF_NAME.get(backend) == "eager":
        return (f"--recompute-granularity selective recomputes the attention core, a scaled_dot_product_attention "
                f"or flex_attention call; --attention-backend {backend} computes softmax(QKᵀ)V itself, so there "
                "would be nothing to recompute: use --recompute-granularity full or op, or an SDPA backend (auto).")
    if kinds == {"op"} and _uses_hf_model(args):
        return ("--recompute-granularity op replays the built-in models' layers op by op; a Hugging Face model's "
                "layers run different ops when recomputed (transformers' own checkpointing path), so it is not "
                "served for them: use --recompute-granularity full or selective.")
    per_stage = args.num_layers // max(_pp(args), 1) if args.num_layers else None
    if method == "block" and per_stage and layers and layers > per_stage:
        return (f"--recompute-method block --recompute-num-layers {layers}: a pipeline stage holds {per_stage} "
                f"layers; give at most {per_stage}.")
    return None


def _auto_micro_batch_problem(args: Args, ctx: RunContext) -> str | None:
    if not args.auto_micro_batch_size:
        return ("--memory-budget-gb is the budget of --auto-micro-batch-size and does nothing alone: add "
                "--auto-micro-batch-size, or drop it.") if args.memory_budget_gb is not None else None
    if args.memory_budget_gb is None or not args.memory_budget_gb > 0:
        return ("--auto-micro-batch-size fits the micro batch into --memory-budget-gb GiB per rank: give a positive "
                "budget (trying sizes on the GPU until one runs out of memory is not served yet).")
    if _uses_hf_model(args):
        return ("--auto-micro-batch-size estimates activations from the built-in model's shape; for a Hugging Face "
                "model give --micro-batch-size yourself.")
    if args.rampup_batch_size or args.step_batch_size_schedule:
        return ("--auto-micro-batch-size keeps one global batch; with a batch schedule give --micro-batch-size "
                "yourself.")
    if not _layout_divides(args, ctx):
        return None  # the layout rule reports it
    from rapidtrain.config.plan import (
        activation_bytes_per_sample,
        builtin_vocab_size,
        memory_estimate,
        model_config_from_args,
        precision_of,
        recompute_of,
        tokenizer_settings_of,
    )

    vocab = builtin_vocab_size(args, tokenizer_settings_of(args))
    if not vocab:
        return None
    model, precision = model_config_from_args(args, vocab), precision_of(args, ctx)
    state = memory_estimate(args, model, layout_of(args, ctx), precision, ctx).total_bytes
    need = state + activation_bytes_per_sample(model, precision, recompute_of(args))
    if need <= args.memory_budget_gb * 2**30:
        return None
    return (f"--auto-micro-batch-size: even micro batch 1 needs ~{need / 2**30:.2f} GiB (model state "
            f"{state / 2**30:.2f} GiB + one sample's activations) > --memory-budget-gb {args.memory_budget_gb:g}, "
            "so the global batch cannot be kept: raise the budget, recompute (--recompute-granularity full), "
            "shard the model state (--zero-3-memory-optimization), or shorten --seq-length.")


def _profile_problem(args: Args, ctx: RunContext) -> str | None:
    """Why --profile would trace nothing or fail, or None."""
    if not getattr(args, "profile", False):
        return None
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0 or end <= start:
        return (f"--profile-step-start {start} / --profile-step-end {end}: steps [start, end) are traced, so "
                "0 ≤ start < end (e.g. 10 and 12).")
    if args.train_iters is not None and end > args.train_iters:
        return (f"--profile-step-end {end} is past --train-iters {args.train_iters}: the run ends before the trace "
                f"does. Choose steps within the run (e.g. --profile-step-start "
                f"{max(args.train_iters - 2, 0)} --profile-step-end {args.train_iters}).")
    outside = [r for r in args.profile_ranks if not 0 <= r < ctx.world_size]
    if outside:
        return (f"--profile-ranks {' '.join(map(str, args.profile_ranks))}: rank(s) {outside} do not exist in a world "
                f"of {ctx.world_size}; give ranks from 0 to {ctx.world_size - 1}.")
    return None


RULES: tuple[Rule, ...] = (
    Rule(
        "positive-sizes", ("--micro-batch-size", "--tensor-model-parallel-size", "--num-layers"),
        "Batch sizes, parallel sizes and model dimensions are positive integers.",
        lambda a, c: bool(_positive_sizes(a)),
        lambda a, c: f"{', '.join(_positive_sizes(a))} must be at least 1.",
    ),
    Rule(
        "unknown-task", ("--task",),
        f"--task is one of {', '.join(TASKS)} (causal_lm is accepted for casual_lm).",
        lambda a, c: a.task not in TASKS,
        lambda a, c: f"--task {a.task!r} is not a task rapidtrain knows"
        + (f"; did you mean {difflib.get_close_matches(a.task, TASKS, 1)[0]!r}?"
           if difflib.get_close_matches(a.task, TASKS, 1) else "")
        + f" Choose one of: {', '.join(TASKS)}.",
    ),
    Rule(
        "one-state-partitioning", ("--oss-memory-optimization", "--oss-sdp-memory-optimization",
                                   "--fsdp-memory-optimization", "--zero-1-memory-optimization",
                                   "--zero-2-memory-optimization", "--zero-3-memory-optimization"),
        "At most one model-state partitioning switch (OSS, SDP, FSDP, ZeRO-1/2/3).",
        lambda a, c: len(_partitioning(a)) > 1,
        lambda a, c: f"{' and '.join(_flag(f) for f in _partitioning(a))} each choose how model state is partitioned; "
        "they cannot be combined. Keep one (ZeRO-3 or FSDP shard the most, ZeRO-1 or OSS the least).",
    ),
    Rule(
        "3d-only-zero12", ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                           "--zero-3-memory-optimization", "--oss-memory-optimization",
                           "--oss-sdp-memory-optimization", "--fsdp-memory-optimization"),
        "With tensor or pipeline parallelism only ZeRO-1 or ZeRO-2 partitioning combines (served by FSDP2 over "
        "the data-parallel dimension).",
        lambda a, c: _three_d(a) and any(f in _partitioning(a) for f in (
            "zero_3_memory_optimization", "oss_memory_optimization", "oss_sdp_memory_optimization",
            "fsdp_memory_optimization")),
        lambda a, c: f"--tensor-model-parallel-size {_tp(a)} / --pipeline-model-parallel-size {_pp(a)} cannot be "
        f"combined with {', '.join(_flag(f) for f in _partitioning(a))}: with 3D parallelism parameters are already "
        "split by layer or column, and only optimizer state and gradients are partitioned further. Use "
        "--zero-1-memory-optimization or --zero-2-memory-optimization instead, or drop tensor/pipeline parallelism.",
    ),
    Rule(
        "cpu-offload-needs-zero", ("--cpu-offload", "--zero-1-memory-optimization", "--zero-2-memory-optimization",
                                   "--zero-3-memory-optimization", "--fsdp-memory-optimization"),
        "--cpu-offload needs a DeepSpeed ZeRO switch and no tensor/pipeline/expert parallelism (DeepSpeedCPUAdam "
        "serves it); FSDP's own CPU offload is not used.",
        lambda a, c: a.cpu_offload and not _deepspeed_zero(a),
        lambda a, c: "--cpu-offload moves the optimizer state and step to the CPU with DeepSpeed's DeepSpeedCPUAdam, "
        "which only DeepSpeed ZeRO without tensor/pipeline/expert parallelism provides. Add "
        "--zero-2-memory-optimization (or --zero-1/--zero-3), set --tensor-model-parallel-size, "
        "--pipeline-model-parallel-size and --expert-model-parallel-size to 1, or drop --cpu-offload."
        + (" With --fsdp-memory-optimization, FSDP2's CPUOffloadPolicy is not used: it would also move the sharded "
           "parameters and gradients to the CPU and step there (nothing to offload on a CPU-only run); for fully "
           "sharded states with the optimizer on the CPU use --zero-3-memory-optimization --cpu-offload instead."
           if a.fsdp_memory_optimization else ""),
    ),
    Rule(
        "world-divisible-by-tp-pp",
        ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--nproc-per-node"),
        "The world size is divisible by tensor × pipeline parallel size.",
        lambda a, c: _tp(a) >= 1 and _pp(a) >= 1 and c.world_size % (_tp(a) * _pp(a)) != 0,
        lambda a, c: f"world size {c.world_size} is not divisible by --tensor-model-parallel-size {_tp(a)} × "
        f"--pipeline-model-parallel-size {_pp(a)} = {_tp(a) * _pp(a)}. Launch a multiple of {_tp(a) * _pp(a)} "
        "processes (--nproc-per-node × nodes) or change the parallel sizes.",
    ),
    Rule(
        "global-batch-divisible", ("--global-batch-size", "--micro-batch-size"),
        "The global batch is divisible by micro batch × data-parallel size (the quotient is the accumulation steps).",
        lambda a, c: _layout_divides(a, c) and a.global_batch_size is not None and a.micro_batch_size >= 1
        and a.global_batch_size % (a.micro_batch_size * _dp(a, c)) != 0,
        lambda a, c: f"--global-batch-size {a.global_batch_size} is not divisible by --micro-batch-size "
        f"{a.micro_batch_size} × data-parallel size {_dp(a, c)} = {a.micro_batch_size * _dp(a, c)}. Choose a global "
        f"batch that is a multiple of {a.micro_batch_size * _dp(a, c)} (accumulation steps = global / that).",
    ),
    Rule(
        "layers-divisible-by-pp", ("--num-layers", "--pipeline-model-parallel-size"),
        "The number of layers is divisible by the pipeline-parallel size.",
        lambda a, c: _pp(a) >= 1 and a.num_layers % _pp(a) != 0,
        lambda a, c: f"--num-layers {a.num_layers} is not divisible by --pipeline-model-parallel-size {_pp(a)}: "
        "each stage holds the same number of layers. Change one of them.",
    ),
    Rule(
        "virtual-stages", ("--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-size"),
        "Interleaved pipelining needs pipeline parallelism and layers per stage divisible by layers per virtual stage.",
        lambda a, c: a.num_layers_per_virtual_pipeline_stage is not None and (
            _pp(a) < 2 or a.num_layers_per_virtual_pipeline_stage < 1
            or (a.num_layers // max(_pp(a), 1)) % a.num_layers_per_virtual_pipeline_stage != 0),
        lambda a, c: f"--num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage} needs "
        "--pipeline-model-parallel-size ≥ 2 and must divide the layers per stage "
        f"({a.num_layers} / {_pp(a)}). Adjust it or drop it for the plain 1F1B schedule.",
    ),
    Rule(
        "interleaved-micro-batches", ("--num-layers-per-virtual-pipeline-stage", "--global-batch-size",
                                      "--micro-batch-size"),
        "The interleaved schedule needs the micro-batches per iteration (accumulation steps) to be a multiple of the "
        "pipeline size, as in Megatron.",
        lambda a, c: _pp(a) > 1 and a.num_layers_per_virtual_pipeline_stage is not None
        and (steps := _accumulation_steps(a, c)) is not None and steps % _pp(a) != 0,
        lambda a, c: f"--num-layers-per-virtual-pipeline-stage with {_accumulation_steps(a, c)} micro-batches per "
        f"iteration (--global-batch-size / (--micro-batch-size × data-parallel size {_dp(a, c)})): the interleaved "
        f"schedule runs micro-batches in rounds of --pipeline-model-parallel-size {_pp(a)}. Make --global-batch-size "
        f"a multiple of {_pp(a) * a.micro_batch_size * _dp(a, c)}, or drop the virtual stages.",
    ),
    Rule(
        "pipeline-per-token-loss", ("--pipeline-model-parallel-size", "--bert-binary-head"),
        "Pipelining runs per-token losses: not the BERT binary head's sentence-order loss.",
        lambda a, c: _pp(a) > 1 and a.bert_binary_head,
        lambda a, c: f"--pipeline-model-parallel-size {_pp(a)} with --bert-binary-head: the sentence-order loss is "
        "not a per-token loss the last stage can sum. Drop one of them.",
    ),
    Rule(
        "heads-divisible-by-tp", ("--num-attention-heads", "--tensor-model-parallel-size"),
        "Attention heads are divisible by the tensor-parallel size.",
        lambda a, c: _tp(a) >= 1 and a.num_attention_heads % _tp(a) != 0,
        lambda a, c: f"--num-attention-heads {a.num_attention_heads} is not divisible by --tensor-model-parallel-size "
        f"{_tp(a)}: heads are split across tensor-parallel ranks. Choose a head count that is a multiple of {_tp(a)}.",
    ),
    Rule(
        "query-groups-need-gqa", ("--num-query-groups", "--group-query-attention"),
        "--num-query-groups takes effect with --group-query-attention only.",
        lambda a, c: a.num_query_groups is not None and not a.group_query_attention,
        lambda a, c: f"--num-query-groups {a.num_query_groups} without --group-query-attention would be ignored: "
        "add --group-query-attention, or drop --num-query-groups for one key/value head per attention head.",
    ),
    Rule(
        "heads-divisible-by-query-groups", ("--num-attention-heads", "--num-query-groups"),
        "The attention heads are divisible by the query groups (each key/value head serves as many query heads).",
        lambda a, c: a.num_attention_heads >= 1 and _query_groups(a) >= 1
        and a.num_attention_heads % _query_groups(a) != 0,
        lambda a, c: f"--num-attention-heads {a.num_attention_heads} is not divisible by --num-query-groups "
        f"{_query_groups(a)}: each key/value head serves an equal share of the query heads. Choose a group count "
        "that divides the heads.",
    ),
    Rule(
        "query-groups-divisible-by-tp", ("--num-query-groups", "--tensor-model-parallel-size"),
        "With grouped-query attention the query groups (key/value heads) are divisible by the tensor-parallel size.",
        lambda a, c: a.group_query_attention and _tp(a) >= 1 and _query_groups(a) >= 1
        and _query_groups(a) % _tp(a) != 0,
        lambda a, c: f"--num-query-groups {_query_groups(a)} is not divisible by --tensor-model-parallel-size "
        f"{_tp(a)}: tensor parallelism splits the key/value heads, each rank holding whole ones for its query "
        f"heads. Use a group count that is a multiple of {_tp(a)}, or a smaller tensor-parallel size.",
    ),
    Rule(
        "qkv-bias-needs-no-bias-linear", ("--add-qkv-bias", "--disable-bias-linear"),
        "--add-qkv-bias adds q/k/v biases to a model without biases (--disable-bias-linear).",
        lambda a, c: a.add_qkv_bias and a.add_bias_linear,
        lambda a, c: "--add-qkv-bias without --disable-bias-linear changes nothing: every linear layer already has "
        "a bias. Add --disable-bias-linear (biases on q/k/v only, as Qwen2) or drop --add-qkv-bias.",
    ),
    Rule(
        "rotary-flags-need-rope", ("--rotary-base", "--rotary-percent", "--position-embedding-type"),
        "--rotary-base and --rotary-percent apply to rotary position embeddings.",
        lambda a, c: a.position_embedding_type != "rope" and (a.rotary_base is not None
                                                              or a.rotary_percent is not None),
        lambda a, c: "--rotary-base / --rotary-percent configure rotary embeddings, but --position-embedding-type is "
        f"{a.position_embedding_type}. Add --position-embedding-type rope or drop them.",
    ),
    Rule(
        "rotary-percent-range", ("--rotary-percent",),
        "--rotary-percent lies in (0, 1].",
        lambda a, c: a.rotary_percent is not None and not 0 < a.rotary_percent <= 1,
        lambda a, c: f"--rotary-percent {a.rotary_percent} is the share of each head that rope rotates: give a "
        "value in (0, 1].",
    ),
    Rule(
        "swiglu-ffn-size", ("--swiglu", "--ffn-hidden-size", "--hidden-size"),
        "With --swiglu and no --ffn-hidden-size the MLP is 2/3 of 4 × hidden rounded down to a multiple of 64 "
        "(Megatron); that must leave at least 64.",
        lambda a, c: a.swiglu and a.ffn_hidden_size is None and int(4 * a.hidden_size * 2 / 3 / 64) < 1,
        lambda a, c: f"--swiglu with --hidden-size {a.hidden_size} and no --ffn-hidden-size: 2/3 of 4 × hidden "
        "rounded down to a multiple of 64 leaves no MLP. Give --ffn-hidden-size.",
    ),
    Rule(
        "openai-gelu-needs-gelu", ("--openai-gelu", "--swiglu"),
        "--openai-gelu changes the GELU of GELU MLPs; a GPT with --swiglu has none.",
        lambda a, c: a.openai_gelu and a.swiglu and a.model_type == "gpt",
        lambda a, c: "--openai-gelu with --swiglu: the GPT's MLPs use SiLU gates, no GELU is left to change. Drop "
        "one of them.",
    ),
    Rule(
        "pretrained-folder-initialises-builtin", ("--pretrained-model-name-or-path", "--task"),
        "With --task pretraining, --pretrained-model-name-or-path is a Hugging Face folder (config.json) of a "
        "GPT-2, Llama, Mistral, Qwen2, Mixtral or BERT model, which initialises the built-in model.",
        lambda a, c: hf_config.unsupported_reason(a) is not None,
        lambda a, c: f"{hf_config.unsupported_reason(a)}.",
    ),
    Rule(
        "pretrained-shape-flags", ("--pretrained-model-name-or-path", "--num-layers", "--hidden-size", "--swiglu"),
        "Shape flags given beside a Hugging Face folder that initialises the built-in model agree with its "
        "config.json (flags not given are taken from it).",
        lambda a, c: bool(hf_config.pretrained_conflicts(a)),
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path}: its config.json fixes the "
        "model's shape, and these flags contradict it: " + "; ".join(hf_config.pretrained_conflicts(a))
        + ". Drop them (flags not given are taken from config.json), or use another folder.",
    ),
    Rule(
        "finetuned-shape-flags", ("--pretrained-model-name-or-path", "--num-layers", "--hidden-size", "--seq-length"),
        "Shape flags given beside a Hugging Face folder that is fine-tuned as it is agree with its config.json, and "
        "--seq-length fits its position table.",
        lambda a, c: bool(hf_config.finetune_conflicts(a)),
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path}: its config.json describes "
        "the model, and these flags contradict it: " + "; ".join(hf_config.finetune_conflicts(a))
        + ". Drop them (the folder's config decides) or give its values.",
    ),
    Rule(
        "pretrained-needs-data", ("--pretrained-model-name-or-path", "--data-path"),
        "Continued pretraining from Hugging Face weights reads --data-path (the demo corpus has its own tokenizer).",
        lambda a, c: hf_config.initialises_builtin(a) and not a.data_path and not a.user_script,
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path} without --data-path would "
        "train on the demo corpus, whose token ids come from the demo's own tokenizer and mean nothing to this "
        "model. Preprocess text with the model's tokenizer (scripts/preprocess_data.py --tokenizer-type "
        f"HuggingFaceTokenizer --tokenizer-model {a.pretrained_model_name_or_path}) and give --data-path.",
    ),
    Rule(
        "pretrained-sliding-window", ("--pretrained-model-name-or-path", "--seq-length"),
        "A Hugging Face model with sliding-window attention trains with --seq-length within the window (where the "
        "window changes nothing).",
        lambda a, c: _sliding_window(a) is not None and a.seq_length > _sliding_window(a),
        lambda a, c: f"--seq-length {a.seq_length} is longer than the sliding_window {_sliding_window(a)} of "
        f"{a.pretrained_model_name_or_path}/config.json: the built-in attention sees the whole sequence. Use "
        f"--seq-length {_sliding_window(a)} or less.",
    ),
    Rule(
        "hidden-divisible-by-heads", ("--hidden-size", "--num-attention-heads"),
        "The hidden size is divisible by the number of attention heads.",
        lambda a, c: a.num_attention_heads >= 1 and a.hidden_size % a.num_attention_heads != 0,
        lambda a, c: f"--hidden-size {a.hidden_size} is not divisible by --num-attention-heads "
        f"{a.num_attention_heads}: each head gets hidden / heads dimensions. Change one of them.",
    ),
    Rule(
        "fp16-xor-bf16", ("--fp16", "--bf16"),
        "--fp16 and --bf16 are exclusive.",
        lambda a, c: a.fp16 and a.bf16,
        lambda a, c: "--fp16 and --bf16 both choose the autocast type; keep one (bf16 needs no loss scaling).",
    ),
    Rule(
        "fp16-deepspeed-cpu", ("--fp16", "--mixed-precision", "--zero-1-memory-optimization"),
        "DeepSpeed refuses fp16 on the CPU: under ZeRO on CPU use --bf16 (--mixed-precision resolves to bf16 there).",
        lambda a, c: a.fp16 and c.device_type == "cpu" and _deepspeed_zero(a),
        lambda a, c: "--fp16 with a --zero-*-memory-optimization switch on the CPU: DeepSpeed's CPU accelerator does "
        "not support fp16. Use --bf16 or --mixed-precision (bf16 on CPU) instead.",
    ),
    Rule(
        "seq-within-positions", ("--seq-length", "--max-position-embeddings"),
        "The sequence length is at most the position-embedding table (learned absolute positions).",
        lambda a, c: a.position_embedding_type == "learned_absolute" and a.max_position_embeddings is not None
        and a.seq_length > a.max_position_embeddings,
        lambda a, c: f"--seq-length {a.seq_length} exceeds --max-position-embeddings {a.max_position_embeddings}: "
        "positions past the table have no embedding. Raise --max-position-embeddings or shorten --seq-length.",
    ),
    Rule(
        "num-experts-length", ("--num-experts", "--num-layers"),
        "--num-experts is one number, one per layer, or one per evenly spaced MoE layer.",
        lambda a, c: not _num_experts_length_ok(a),
        lambda a, c: f"--num-experts has {len(a.num_experts)} values but --num-layers is {a.num_layers}: give one "
        "number (MoE layers chosen by --moe-layer-freq), one per layer (0 for dense), or one per MoE layer with the "
        "MoE layers evenly spaced (a count that divides --num-layers, as DeepSpeed's pyramid MoE).",
    ),
    Rule(
        "experts-divisible-by-ep", ("--num-experts", "--expert-model-parallel-size"),
        "The number of experts of every MoE layer is divisible by the expert-parallel size.",
        lambda a, c: _num_experts_length_ok(a) and a.expert_model_parallel_size >= 1
        and any(e % a.expert_model_parallel_size for e in _experts(a)),
        lambda a, c: f"--num-experts {' '.join(map(str, a.num_experts or []))} is not divisible by "
        f"--expert-model-parallel-size {a.expert_model_parallel_size}: each expert-parallel rank holds an equal share "
        "of every MoE layer's experts. Use expert counts that are multiples of it.",
    ),
    Rule(
        "ep-divides-dp",
        ("--expert-model-parallel-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size"),
        "The expert-parallel size divides the data-parallel size, and needs --num-experts.",
        lambda a, c: a.expert_model_parallel_size > 1 and _layout_divides(a, c) and (
            not _experts(a) or _dp(a, c) % a.expert_model_parallel_size != 0),
        lambda a, c: f"--expert-model-parallel-size {a.expert_model_parallel_size} needs --num-experts and must divide "
        f"the data-parallel size {_dp(a, c)} (world {c.world_size} / (TP {_tp(a)} × PP {_pp(a)})): experts are sharded "
        "over data-parallel ranks. Change the expert-parallel size or the number of processes.",
    ),
    Rule(
        "ep-with-zero3-or-fairscale", ("--expert-model-parallel-size", "--zero-3-memory-optimization",
                                       "--sharding-backend"),
        "Expert parallelism combines with OSS, SDP, FSDP and ZeRO-1/2 (torch engines), not with DeepSpeed ZeRO-3 or "
        "FairScale.",
        lambda a, c: a.expert_model_parallel_size > 1 and (
            a.zero_3_memory_optimization or (a.sharding_backend == "fairscale" and bool(_partitioning(a)))),
        lambda a, c: f"--expert-model-parallel-size {a.expert_model_parallel_size} with "
        + ("--zero-3-memory-optimization: DeepSpeed partitions every parameter over all data-parallel ranks, but "
           "each expert-parallel rank holds other experts, which must be reduced over their own group. Use "
           "--fsdp-memory-optimization (FSDP2 shards the expert slices over the ranks holding the same experts)"
           if a.zero_3_memory_optimization else
           "--sharding-backend fairscale: FairScale's OSS broadcasts every parameter over all data-parallel ranks, "
           "which would overwrite the expert slices that differ between expert-parallel ranks. Use the default "
           "torch backend")
        + ", or --expert-model-parallel-size 1.",
    ),
    Rule(
        "3d-builtin-models-only", ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                   "--pretrained-model-name-or-path"),
        "Tensor and pipeline parallelism apply to the built-in Megatron-style models, not Hugging Face models.",
        lambda a, c: _three_d(a) and _uses_hf_model(a),
        lambda a, c: "--tensor-model-parallel-size / --pipeline-model-parallel-size apply to the built-in "
        "Megatron-style models; --pretrained-model-name-or-path loads a Hugging Face model, which they cannot split. "
        "For a model that does not fit, use --zero-3-memory-optimization or --fsdp-memory-optimization instead.",
    ),
    Rule(
        "moe-builtin-models-only", ("--num-experts", "--pretrained-model-name-or-path"),
        "Mixture of experts replaces MLPs of the built-in models only.",
        lambda a, c: bool(_experts(a)) and _uses_hf_model(a),
        lambda a, c: "--num-experts turns the built-in models' MLPs into MoE layers; it cannot change a Hugging Face "
        "model loaded with --pretrained-model-name-or-path. Drop one of them.",
    ),
    Rule(
        "dynamic-shape-no-pp", ("--data-iterator", "--pipeline-model-parallel-size"),
        "The dynamic-shape iterator does not combine with pipeline parallelism (stages exchange fixed shapes).",
        lambda a, c: a.data_iterator == "dynamic-shape" and _pp(a) > 1,
        lambda a, c: "--data-iterator dynamic-shape with --pipeline-model-parallel-size "
        f"{_pp(a)}: pipeline stages exchange activations of one fixed shape. Drop dynamic shapes or pipelining.",
    ),
    Rule(
        "iters-xor-epochs", ("--train-iters", "--train-samples", "--epochs"),
        "Exactly one of --train-iters / --train-samples / --epochs: pretraining counts iterations (or samples, "
        "Megatron's sample-based training), fine-tuning epochs (or iterations).",
        lambda a, c: len(_lengths(a)) != 1,
        lambda a, c: (f"{' and '.join(_lengths(a))} all set the training length; give one." if _lengths(a)
                      else "--train-iters, --train-samples or --epochs is needed: "
                      + ("pretraining is iteration-based (--train-iters N, or --train-samples N)."
                         if _needs_iterations(a, c) else "fine-tuning runs --epochs N (or --train-iters N).")),
    ),
    Rule(
        "pretraining-needs-iters", ("--epochs", "--task"),
        "Pretraining (--task pretraining, without --user-script) is iteration-based.",
        lambda a, c: _needs_iterations(a, c) and a.epochs is not None and a.train_iters is None
        and a.train_samples is None,
        lambda a, c: "--epochs with --task pretraining: Megatron-style pretraining counts iterations over a "
        "sample stream. Use --train-iters N (or --train-samples N).",
    ),
    Rule(
        "schedule-counts-as-training", ("--train-samples", "--lr-decay-samples", "--lr-decay-iters"),
        "The schedule is counted as the training length is (Megatron): with --train-samples the -samples forms "
        "(--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples), otherwise the -iters forms.",
        lambda a, c: bool(_mixed_schedule_flags(a)),
        lambda a, c: f"{', '.join(_mixed_schedule_flags(a))} with "
        + ("--train-samples: sample-based training counts its schedule in samples. Use "
           + ", ".join(f.replace("-iters", "-samples") for f in _mixed_schedule_flags(a))
           if a.train_samples is not None else
           "iteration-based training (--train-iters / --epochs): its schedule is counted in iterations. Use "
           + ", ".join(f.replace("-samples", "-iters") for f in _mixed_schedule_flags(a)) + " or --train-samples")
        + " (Megatron refuses the mix too).",
    ),
    Rule(
        "one-warmup", ("--lr-warmup-fraction", "--lr-warmup-iters", "--lr-warmup-samples"),
        "Warm-up by fraction, by iterations or by samples: one of them.",
        lambda a, c: len(_warmups(a)) > 1,
        lambda a, c: f"{' and '.join(_warmups(a))} all set the warm-up; keep one.",
    ),
    Rule(
        "samples-warmup-within-decay", ("--lr-warmup-samples", "--train-samples", "--lr-decay-samples"),
        "With sample-based training the warm-up ends before the decay horizon.",
        lambda a, c: a.train_samples is not None and a.lr_warmup_samples > 0
        and a.lr_warmup_samples >= (a.lr_decay_samples or a.train_samples),
        lambda a, c: f"--lr-warmup-samples {a.lr_warmup_samples} is not below the decay horizon ("
        f"{'--lr-decay-samples' if a.lr_decay_samples else '--train-samples'} "
        f"{a.lr_decay_samples or a.train_samples}). Lower it or train longer.",
    ),
    Rule(
        "batch-schedule-valid", ("--rampup-batch-size", "--step-batch-size-schedule", "--global-batch-size"),
        "--rampup-batch-size START INCREMENT SAMPLES ramps from START (> 0) to --global-batch-size in whole "
        "INCREMENTs; --step-batch-size-schedule is 'THRESHOLD:BATCH ...' from threshold 0; not both.",
        lambda a, c: _batch_schedule_problem(a) is not None,
        lambda a, c: str(_batch_schedule_problem(a)),
    ),
    Rule(
        "batch-schedule-divisible", ("--rampup-batch-size", "--step-batch-size-schedule", "--micro-batch-size"),
        "Every global batch of a ramp-up or step schedule is divisible by micro batch × data-parallel size (and, "
        "with interleaved pipelining, gives a multiple of the pipeline size of micro-batches).",
        lambda a, c: bool(_batch_schedule_misfits(a, c)),
        lambda a, c: f"global batch sizes {', '.join(map(str, _batch_schedule_misfits(a, c)))} of the batch schedule "
        f"are not divisible by --micro-batch-size {a.micro_batch_size} × data-parallel size {_dp(a, c)}"
        + (f" × --pipeline-model-parallel-size {_pp(a)} (interleaved schedule)"
           if a.num_layers_per_virtual_pipeline_stage else "")
        + ": each iteration runs whole micro-batches on every rank. Choose a start, increment and final batch (or "
        "schedule sizes) that are multiples of it.",
    ),
    Rule(
        "warmup-within-decay", ("--lr-warmup-iters", "--train-iters", "--lr-decay-iters"),
        "Warm-up ends before the decay horizon.",
        lambda a, c: (a.lr_decay_iters or a.train_iters) is not None and a.lr_warmup_iters > 0
        and a.lr_warmup_iters >= (a.lr_decay_iters or a.train_iters),
        lambda a, c: f"--lr-warmup-iters {a.lr_warmup_iters} is not shorter than the decay horizon "
        f"({'--lr-decay-iters' if a.lr_decay_iters else '--train-iters'} {a.lr_decay_iters or a.train_iters}). "
        "Lower --lr-warmup-iters (or use --lr-warmup-fraction) or train longer.",
    ),
    Rule(
        "lr-required", ("--lr",),
        "--lr is required.",
        lambda a, c: a.lr is None,
        lambda a, c: "--lr is missing: give the peak learning rate, e.g. --lr 1e-4.",
    ),
    Rule(
        "fairscale-backend-scope", ("--sharding-backend", "--fsdp-memory-optimization", "--oss-memory-optimization"),
        "--sharding-backend fairscale serves OSS and SDP only (FairScale's FSDP fails on current PyTorch).",
        lambda a, c: a.sharding_backend == "fairscale" and not (
            a.oss_memory_optimization or a.oss_sdp_memory_optimization),
        lambda a, c: "--sharding-backend fairscale applies to --oss-memory-optimization and "
        "--oss-sdp-memory-optimization only"
        + (" (FairScale's FSDP does not run with current PyTorch; use the default torch backend for "
           "--fsdp-memory-optimization)" if a.fsdp_memory_optimization else "")
        + ". Drop --sharding-backend or add one of those switches.",
    ),
    Rule(
        "binary-head-bert-only", ("--bert-binary-head", "--model-type"),
        "The binary (next-sentence) head belongs to BERT.",
        lambda a, c: bool(a.bert_binary_head) and a.model_type != "bert",
        lambda a, c: "--bert-binary-head needs --model-type bert.",
    ),
    Rule(
        "pretrained-checkpoint-or-load", ("--pretrained-model-name-or-path", "--load"),
        "A Megatron-format checkpoint named by --pretrained-model-name-or-path is loaded as --load is: give one "
        "folder to load from.",
        lambda a, c: hf_config.is_megatron_checkpoint(a) and a.load is not None and _different_folders(
            a.load, a.pretrained_model_name_or_path),
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path} is a Megatron-format "
        f"checkpoint folder, which the run loads as --load, but --load names {a.load}. Give one of them.",
    ),
    Rule(
        "router-type-supported", ("--router-type", "--num-experts"),
        "Rapidformer's --router-type 0 (top-k gating with the load-balancing loss) is the built-in router; other "
        "router types are not implemented.",
        lambda a, c: a.router_type != 0,
        lambda a, c: f"--router-type {a.router_type}: the built-in MoE implements Rapidformer's router type 0 only "
        "(top-k gating by a linear layer, trained with the load-balancing loss, --moe-loss-coeff); a router "
        "without that loss is not implemented here. Use --router-type 0 (or leave it out).",
    ),
    Rule(
        "remote-device-none", ("--remote-device", "--zero-3-memory-optimization"),
        "--remote-device (Megatron-DeepSpeed's ZeRO-3 parameter placement) is served for 'none' only.",
        lambda a, c: a.remote_device != "none",
        lambda a, c: f"--remote-device {a.remote_device}: rapidtrain's ZeRO-3 keeps the parameter partitions on the "
        "device; DeepSpeed's parameter offload is not wired up. Use --remote-device none, and --cpu-offload (with "
        "ZeRO) to move the optimizer state and step to the CPU.",
    ),
    Rule(
        "residual-moe-needs-experts", ("--mlp-type", "--use-expert-residual-network", "--num-experts"),
        "PR-MoE (--mlp-type residual / --use-expert-residual-network) adds a dense MLP beside MoE layers: it needs "
        "--num-experts.",
        lambda a, c: a.mlp_type == "residual" and not _experts(a),
        lambda a, c: "--mlp-type residual (--use-expert-residual-network) mixes a dense MLP into each MoE layer, but "
        "no layer has experts: add --num-experts N, or drop it.",
    ),
    Rule(
        "deepspeed-config-with-zero", ("--deepspeed_config", "--zero-2-memory-optimization"),
        "--deepspeed_config FILE is merged into the config of a DeepSpeed ZeRO run (a --zero-*-memory-optimization "
        "switch without tensor/pipeline parallelism); the file is JSON.",
        lambda a, c: _deepspeed_config_problem(a) is not None,
        lambda a, c: str(_deepspeed_config_problem(a)),
    ),
    Rule(
        "per-split-data", ("--train-data-path", "--data-path", "--data-iterator"),
        "Megatron's per-split data (--train-data-path ...) replaces --data-path and --split; pretraining needs its "
        "training split, and the dynamic-shape iterator reads one --data-path prefix.",
        lambda a, c: _per_split_problem(a, c) is not None,
        lambda a, c: str(_per_split_problem(a, c)),
    ),
    Rule(
        "dynamic-shape-one-prefix", ("--data-iterator", "--data-path"),
        "The dynamic-shape iterator in pretraining reads the documents of one --data-path prefix (not a blend).",
        lambda a, c: _needs_iterations(a, c) and a.data_iterator == "dynamic-shape" and a.data_path is not None
        and len(a.data_path) > 1,
        lambda a, c: "--data-iterator dynamic-shape with a weighted blend in --data-path: unpacked documents come from "
        "one indexed dataset. Give a single prefix, or drop --data-iterator dynamic-shape.",
    ),
    Rule(
        "lora-needs-hf-model", ("--lora-rank", "--pretrained-model-name-or-path"),
        "LoRA adapters are for fine-tuning a Hugging Face model.",
        lambda a, c: a.lora_rank > 0 and not _uses_hf_model(a),
        lambda a, c: "--lora-rank adds peft LoRA adapters to a Hugging Face model; give "
        "--pretrained-model-name-or-path DIR or drop --lora-rank.",
    ),
    Rule(
        "zero-elementwise-optimizer", ("--zero-1-memory-optimization", "--zero-2-memory-optimization",
                                       "--zero-3-memory-optimization", "--optimizers", "--optimizer"),
        "DeepSpeed ZeRO steps flat partitions of each parameter group: it takes elementwise optimizers (Adam, "
        "AdamW, SGD), not LAMB or Adafactor.",
        lambda a, c: _deepspeed_zero(a) and _optimizer_choice(a)[0] in NON_ELEMENTWISE_OPTIMIZERS,
        lambda a, c: f"{_optimizer_choice(a)[1]} {_optimizer_choice(a)[0]} with --zero-{zero_stage(a)}-memory-"
        "optimization: DeepSpeed ZeRO flattens each parameter group into one tensor and partitions it, so LAMB's "
        "per-layer trust ratio or Adafactor's row/column statistics would be computed over slices of many "
        "parameters, a different optimizer. Use --optimizers apex_adam (or --optimizer adamw, adam or sgd) with "
        "ZeRO, or --oss-memory-optimization, which keeps each parameter whole on one rank.",
    ),
    Rule(
        "cpu-offload-adam-only", ("--cpu-offload", "--optimizers", "--optimizer"),
        "--cpu-offload steps the optimizer with DeepSpeedCPUAdam: the optimizer must be Adam or AdamW.",
        lambda a, c: bool(a.cpu_offload or a.nvme_offload_dir)
        and _optimizer_choice(a)[0] not in OFFLOADABLE_OPTIMIZERS
        and not (_deepspeed_zero(a) and _optimizer_choice(a)[0] in NON_ELEMENTWISE_OPTIMIZERS),
        lambda a, c: f"{'--cpu-offload' if a.cpu_offload else '--nvme-offload-dir'} with {_optimizer_choice(a)[1]} "
        f"{_optimizer_choice(a)[0]}: the offloaded "
        "optimizer step is DeepSpeedCPUAdam, which implements Adam and AdamW only. Use --optimizers apex_adam "
        "(AdamW) or --optimizer adamw/adam, or drop --cpu-offload.",
    ),
    Rule(
        "world-size-positive", ("--nproc-per-node",),
        "The world size (processes per node × nodes; `rapidtrain plan --world-size`) is at least 1.",
        lambda a, c: c.world_size < 1,
        lambda a, c: f"world size {c.world_size}: the number of processes must be at least 1 (rapidtrain plan "
        "--world-size N, or --nproc-per-node × NNODES for a run).",
    ),
    Rule(
        "rates-finite", ("--lr", "--min-lr", "--weight-decay", "--clip-grad"),
        "Learning rates, weight decay and the clipping norm are finite and not negative.",
        lambda a, c: bool(_non_finite_or_negative(a)),
        lambda a, c: f"{', '.join(_non_finite_or_negative(a))}: must be a finite number ≥ 0 (a negative rate "
        "climbs the loss, NaN poisons every weight at the first step). Give e.g. --lr 1e-4.",
    ),
    Rule(
        "counts-positive", ("--train-iters", "--log-interval", "--eval-interval", "--num-workers"),
        "Iteration counts and intervals are at least 1; --eval-iters and --num-workers are not negative.",
        lambda a, c: bool(_not_positive_counts(a)),
        lambda a, c: f"{', '.join(_not_positive_counts(a))}: iteration counts and intervals must be at least 1, "
        "--eval-iters and --num-workers at least 0 (leave an interval out to use its default).",
    ),
    Rule(
        "probabilities-in-range", ("--hidden-dropout", "--attention-dropout", "--mask-prob"),
        "Dropout rates and betas lie in [0, 1); masking probabilities in [0, 1].",
        lambda a, c: bool(_outside_range(a)),
        lambda a, c: f"{', '.join(_outside_range(a))}: these are probabilities. Give a value in the range shown "
        "(dropout 0.1 is Megatron's default).",
    ),
    Rule(
        "seed-range", ("--seed",),
        "--seed lies in [0, 2**32) (numpy's RandomState orders the data with it).",
        lambda a, c: a.seed is not None and not 0 <= a.seed < SEED_LIMIT,
        lambda a, c: f"--seed {a.seed}: must lie in [0, {SEED_LIMIT}) because numpy's RandomState, which shuffles "
        "the data, takes no other seeds. Give e.g. --seed 1234.",
    ),
    Rule(
        "split-usable", ("--split",),
        "--split is one to three non-negative weights with a positive sum; pretraining needs a positive train weight.",
        lambda a, c: _split_problem(a, c) is not None,
        lambda a, c: str(_split_problem(a, c)),
    ),
    Rule(
        "train-samples-bound", ("--train-iters", "--global-batch-size"),
        f"--train-iters × global batch stays below 2**36 samples: the data indices take ~{INDEX_BYTES_PER_SAMPLE} "
        "bytes per sample.",
        lambda a, c: (_train_samples(a, c) or 0) > MAX_TRAIN_SAMPLES,
        lambda a, c: f"--train-iters {a.train_iters} × global batch "
        f"{(_train_samples(a, c) or 0) // max(a.train_iters or 1, 1)} = {_train_samples(a, c):,} samples: the sample "
        f"and shuffle indices of that stream would need about "
        f"{(_train_samples(a, c) or 0) * INDEX_BYTES_PER_SAMPLE / 2**40:,.0f} TiB ({INDEX_BYTES_PER_SAMPLE} bytes "
        f"per sample), and {MAX_TRAIN_SAMPLES:,} samples (2**36) is far beyond any real run. Check --train-iters.",
    ),
    Rule(
        "nccl-needs-cuda", ("--distributed-backend",),
        "--distributed-backend nccl needs CUDA devices.",
        lambda a, c: a.distributed_backend == "nccl" and c.device_type != "cuda",
        lambda a, c: "--distributed-backend nccl: NCCL runs collectives between CUDA devices, and this run has none "
        "(device cpu). Use --distributed-backend gloo, or leave the flag out (gloo on CPU, nccl on CUDA).",
    ),
    Rule(
        "low-bit-optimizer-available", ("--optimizer", "--tensor-model-parallel-size", "--fsdp-memory-optimization"),
        "--optimizer adamw_8bit needs bitsandbytes (plain-tensor layouts) or torchao (any layout); "
        "paged_adamw_8bit needs bitsandbytes on CUDA with plain tensors; adamw_4bit needs torchao and plain tensors.",
        lambda a, c: _low_bit_optimizer_problem(a, c) is not None,
        lambda a, c: f"{_optimizer_choice(a)[1]} {_optimizer_choice(a)[0]}: {_low_bit_optimizer_problem(a, c)}. "
        "Install the library, choose --optimizer adamw_8bit (bitsandbytes or torchao, every layout), or use "
        "--optimizer adamw.",
    ),
    Rule(
        "lora-values", ("--lora-rank", "--lora-alpha", "--lora-dropout"),
        "LoRA's rank is >= 0, its alpha > 0 and its dropout in [0, 1).",
        lambda a, c: bool(_bad_lora_values(a)),
        lambda a, c: "; ".join(_bad_lora_values(a)) + ".",
    ),
    Rule(
        "lora-settings-need-rank", ("--lora-alpha", "--lora-dropout", "--lora-target-modules", "--lora-rank"),
        "--lora-alpha, --lora-dropout and --lora-target-modules shape LoRA adapters: they need --lora-rank > 0.",
        lambda a, c: bool(_lora_settings_given(a)) and a.lora_rank <= 0,
        lambda a, c: f"{', '.join(_lora_settings_given(a))} set LoRA adapters, but --lora-rank is {a.lora_rank} "
        "(no adapters), so they would do nothing. Add --lora-rank R (e.g. 8), or drop them.",
    ),
    Rule(
        "k-bit-needs-lora", ("--load-in-4bit", "--load-in-8bit", "--lora-rank"),
        "A 4/8-bit base is frozen: it trains through LoRA adapters (--lora-rank > 0), one width at a time.",
        lambda a, c: (a.load_in_4bit or a.load_in_8bit) and (a.lora_rank <= 0 or (a.load_in_4bit and a.load_in_8bit)),
        lambda a, c: "--load-in-4bit and --load-in-8bit both choose the base's width; keep one."
        if a.load_in_4bit and a.load_in_8bit else
        f"{_k_bit_flag(a)} loads the base model quantised, and quantised weights cannot be trained: add "
        "--lora-rank R (QLoRA trains adapters on the frozen quantised base), or drop it for full fine-tuning.",
    ),
    Rule(
        "k-bit-plain-data-parallel", ("--load-in-4bit", "--load-in-8bit", "--zero-3-memory-optimization",
                                      "--fsdp-memory-optimization", "--oss-sdp-memory-optimization"),
        "A 4/8-bit base trains under one process, DDP or OSS; ZeRO, FSDP and SDP would flatten or shard its packed "
        "quantised weights.",
        lambda a, c: (a.load_in_4bit or a.load_in_8bit) and (zero_stage(a) > 0 or a.fsdp_memory_optimization
                                                              or a.oss_sdp_memory_optimization),
        lambda a, c: f"{_k_bit_flag(a)} with {', '.join(_flag(f) for f in _partitioning(a))}: the partitioning "
        "engine would flatten or shard bitsandbytes' packed weights and their quantisation state. The frozen "
        "quantised base is already small and only the adapters train: drop the partitioning switch (plain data "
        "parallel), or use --oss-memory-optimization.",
    ),
    Rule(
        "k-bit-available", ("--load-in-4bit", "--load-in-8bit"),
        "--load-in-4bit / --load-in-8bit need bitsandbytes with 4/8-bit kernels for the device (≥ 0.50 on CPU).",
        lambda a, c: _k_bit_problem(a, c) is not None,
        lambda a, c: f"{_k_bit_flag(a)}: {_k_bit_problem(a, c)}. Install bitsandbytes>=0.50 (pip install "
        "'rapidtrain[lowbit]'), or drop the flag to fine-tune the fp32 base with LoRA.",
    ),
    Rule(
        "k-bit-checkpoints", ("--load-in-4bit", "--load-in-8bit", "--save", "--load"),
        "Checkpoints of a 4/8-bit base: torch.distributed.checkpoint cannot save bitsandbytes' 8-bit layers, nor "
        "load into 4-bit ones; a 4-bit run's exported model (SAVE/best, SAVE/last) is written dequantised.",
        lambda a, c: (a.load_in_8bit and bool(a.save or a.load)) or (a.load_in_4bit and bool(a.load)),
        lambda a, c: ("--load-in-8bit with --save/--load: torch.distributed.checkpoint cannot save bitsandbytes' "
                      "Linear8bitLt layers (their state dict carries SCB/weight_format entries that are not module "
                      "attributes). Use --load-in-4bit (QLoRA), or run without --save/--load."
                      if a.load_in_8bit else
                      "--load-in-4bit with --load: resuming into bitsandbytes' packed 4-bit layers is not supported "
                      "(the checkpoint's packed weights do not load into freshly quantised ones). Start a new run "
                      "without --load; the exported SAVE/best and SAVE/last models (dequantised, adapters merged) "
                      "load with from_pretrained."),
    ),
    Rule(
        "compile-settings-need-compile", ("--torch-compile-backend", "--torch-compile-mode", "--torch-compile"),
        "--torch-compile-backend and --torch-compile-mode configure torch.compile: they need --torch-compile (or "
        "--onnx-runtime-training where torch.compile serves it).",
        lambda a, c: bool(_compile_settings_given(a)) and not _compiles(a),
        lambda a, c: f"{', '.join(_compile_settings_given(a))} configure torch.compile, which this run does not use, "
        "so they would do nothing. Add --torch-compile, or drop them.",
    ),
    Rule(
        "compile-backend-known", ("--torch-compile-backend",),
        "--torch-compile-backend names a backend registered with torch._dynamo.",
        # inductor (the default) is always registered: asking torch._dynamo costs ~1.5 s of `rapidtrain plan`.
        lambda a, c: a.torch_compile_backend != "inductor" and a.torch_compile_backend not in _compile_backends(),
        lambda a, c: f"--torch-compile-backend {a.torch_compile_backend!r} is not a torch.compile backend here; "
        f"choose one of {', '.join(_compile_backends())} (inductor is the default).",
    ),
    Rule(
        "compile-mode-inductor", ("--torch-compile-mode", "--torch-compile-backend"),
        "--torch-compile-mode chooses how inductor compiles: it needs the inductor backend.",
        lambda a, c: a.torch_compile_mode is not None and a.torch_compile_backend != "inductor",
        lambda a, c: f"--torch-compile-mode {a.torch_compile_mode} with --torch-compile-backend "
        f"{a.torch_compile_backend}: modes are options of the inductor backend. Drop the mode, or use "
        "--torch-compile-backend inductor.",
    ),
    Rule(
        "zero-settings-need-deepspeed", ("--zero-overlap-comm", "--no-zero-overlap-comm", "--zero-reduce-bucket-size",
                                         "--zero-allgather-bucket-size", "--zero-1-memory-optimization"),
        "The --zero-* communication settings configure DeepSpeed ZeRO: they need a ZeRO switch without tensor/pipeline "
        "parallelism (with TP/PP/EP, FSDP2 serves ZeRO-1/2).",
        lambda a, c: bool(_zero_settings_given(a)) and not _deepspeed_zero(a),
        lambda a, c: f"{', '.join(_zero_settings_given(a))} configure DeepSpeed ZeRO, which does not serve this run "
        f"({'FSDP2 serves ZeRO-1/2 with tensor/pipeline/expert parallelism' if zero_by_fsdp2(a) else 'no ZeRO switch'})"
        ", so they would do nothing. Add --zero-1/2/3-memory-optimization without tensor/pipeline/expert parallelism, "
        "or drop them.",
    ),
    Rule(
        "zero-stage3-settings", ("--zero-stage3-prefetch-bucket-size", "--zero-stage3-param-persistence-threshold",
                                 "--zero-3-memory-optimization"),
        "The --zero-stage3-* settings apply to ZeRO-3 only.",
        lambda a, c: bool(_zero_settings_given(a, stage3_only=True)) and _deepspeed_zero(a) and zero_stage(a) != 3,
        lambda a, c: f"{', '.join(_zero_settings_given(a, stage3_only=True))} tune how ZeRO-3 gathers partitioned "
        f"parameters; --zero-{zero_stage(a)}-memory-optimization does not partition parameters. Use "
        "--zero-3-memory-optimization, or drop them.",
    ),
    Rule(
        "param-offload-needs-zero3", ("--cpu-offload-params", "--nvme-offload-dir", "--zero-3-memory-optimization"),
        "--cpu-offload-params and --nvme-offload-dir offload parameter partitions: they need DeepSpeed ZeRO-3.",
        lambda a, c: bool(a.cpu_offload_params or a.nvme_offload_dir)
        and not (_deepspeed_zero(a) and zero_stage(a) == 3),
        lambda a, c: f"{'--cpu-offload-params' if a.cpu_offload_params else '--nvme-offload-dir'} offloads each "
        "rank's parameter partition, which only DeepSpeed ZeRO-3 keeps (ZeRO-Infinity). Add "
        "--zero-3-memory-optimization (without tensor/pipeline parallelism), or use --cpu-offload with ZeRO-1/2 to "
        "offload the optimizer only.",
    ),
    Rule(
        "one-offload-target", ("--nvme-offload-dir", "--cpu-offload", "--cpu-offload-params"),
        "--nvme-offload-dir puts optimizer state and parameters on NVMe: not with --cpu-offload or "
        "--cpu-offload-params.",
        lambda a, c: bool(a.nvme_offload_dir) and (a.cpu_offload or a.cpu_offload_params),
        lambda a, c: "--nvme-offload-dir offloads optimizer state and parameters to NVMe, and "
        f"{'--cpu-offload' if a.cpu_offload else '--cpu-offload-params'} sends them to host memory instead: choose "
        "one target (NVMe for models whose states exceed host memory).",
    ),
    Rule(
        "nvme-offload-needs-async-io", ("--nvme-offload-dir",),
        "--nvme-offload-dir needs DeepSpeed's async_io op, which builds against libaio.",
        lambda a, c: bool(a.nvme_offload_dir) and _async_io_problem() is not None,
        lambda a, c: f"--nvme-offload-dir {a.nvme_offload_dir}: {_async_io_problem()}. Install it, or offload to "
        "host memory with --cpu-offload --cpu-offload-params.",
    ),
    Rule(
        "option-needs-its-switch", ("--wandb-exp-name", "--wandb-project", "--mlflow-tracking-uri",
                                    "--mlflow-experiment", "--profile-step-start", "--profile", "--async-save",
                                    "--save"),
        "A tracker's, the profiler's or the async save's options need their switch (--wandb-project, "
        "--mlflow-experiment, --profile, --save); alone they would do nothing.",
        lambda a, c: bool(_options_without_switch(a)),
        lambda a, c: f"{'; '.join(_options_without_switch(a))}: without its switch an option does nothing. Add the "
        "switch, or drop the option.",
    ),
    Rule(
        "profile-steps", ("--profile", "--profile-step-start", "--profile-step-end", "--profile-ranks"),
        "--profile traces steps [start, end) with 0 ≤ start < end ≤ --train-iters, on ranks that exist.",
        lambda a, c: _profile_problem(a, c) is not None,
        lambda a, c: str(_profile_problem(a, c)),
    ),
    Rule(
        "attention-backend-runs-here", ("--attention-backend", "--attention-dropout", "--bf16", "--fp16",
                                        "--pretrained-model-name-or-path"),
        "--attention-backend names a kernel the device runs: fused (cuDNN) only on CUDA; flash and fused on CUDA "
        "with --bf16/--fp16; flash on CPU and flex_attention without attention dropout; flex_attention trains on "
        "CUDA only (no backward on CPU); a Hugging Face model takes no fused, and flash_attention_2 needs CUDA and "
        "the flash_attn package.",
        lambda a, c: _attention_problem(a, c) is not None,
        lambda a, c: str(_attention_problem(a, c)),
    ),
    Rule(
        "padding-free-packing", ("--padding-free", "--task", "--pretrained-model-name-or-path"),
        "--padding-free packs the casual_lm fine-tuning task's sequences into one row per micro-batch, for a "
        "Hugging Face model whose modeling code builds its mask with transformers' create_causal_mask (which keeps "
        "packed sequences apart by their position ids, for eager, sdpa, flex_attention and flash_attention_2).",
        lambda a, c: _padding_free_problem(a, c) is not None,
        lambda a, c: str(_padding_free_problem(a, c)),
    ),
    Rule(
        "recompute-settings", ("--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                               "--recompute-activations", "--checkpoint-activations",
                               "--activations-checkpoint-method", "--pipeline-model-parallel-size"),
        "Recompute flags agree on one granularity; --recompute-method / --recompute-num-layers need full or op "
        "granularity (not selective, as in Megatron); uniform recomputes in units of one layer; block recomputes "
        "at most the layers of a pipeline stage; op granularity is for the built-in models.",
        lambda a, c: _recompute_problem(a) is not None,
        lambda a, c: str(_recompute_problem(a)),
    ),
    Rule(
        "auto-micro-batch-size", ("--auto-micro-batch-size", "--memory-budget-gb", "--global-batch-size",
                                  "--rampup-batch-size", "--pretrained-model-name-or-path"),
        "--auto-micro-batch-size needs --memory-budget-gb (and the budget needs it), the built-in model and one "
        "global batch (no batch schedule); refused when even micro batch 1 does not fit, as the global batch "
        "could not be kept.",
        lambda a, c: _auto_micro_batch_problem(a, c) is not None,
        lambda a, c: str(_auto_micro_batch_problem(a, c)),
    ),
)


def _padding_free_problem(args: Args, ctx: RunContext) -> str | None:
    """Why --padding-free cannot keep the packed sequences apart in this run; None where it can."""
    if not args.padding_free:
        return None
    if args.task != "casual_lm" or not _uses_hf_model(args):
        what = f"--task {args.task}" if args.task != "casual_lm" else "a run without a Hugging Face model folder"
        return (f"--padding-free packs the casual_lm fine-tuning task's sequences of a Hugging Face model; {what} "
                "does not use it, so it would do nothing. Drop --padding-free, or use --task causal_lm with "
                "--pretrained-model-name-or-path DIR (a Hugging Face folder) "
                "(pretraining packs documents itself: --reset-position-ids --reset-attention-mask)")
    folder = args.pretrained_model_name_or_path
    problem = hf_config.packing_problem(folder) if folder and hf_config.classify_folder(folder) == "huggingface" \
        else None
    if problem:
        return (f"--padding-free: the model in {folder} would attend across the packed sequences: {problem}. Drop "
                "--padding-free (padded batches; --data-iterator dynamic-shape pads each batch only to its longest)")
    return None


def _attention_problem(args: Args, ctx: RunContext) -> str | None:
    from rapidtrain.models.attention_backends import attention_problem

    return attention_problem(args.attention_backend, ctx.device_type, hf_config.trains_builtin_model(args),
                             args.attention_dropout, half_precision=precision_of(args, ctx).dtype != "fp32")


# Rapidformer restrictions that reflected its implementation only; rapidtrain lifts them (docs list these).
LIFTED_RESTRICTIONS = (
    "ZeRO partitioning works in every template (Trainer, PreTrainer, Finetuner, Engine.compose), not only Trainer.",
    "3D parallelism works in the PreTrainer and Trainer templates for the built-in models, not only Trainer.",
    "Gradient accumulation also works in epoch-based fine-tuning: accumulation steps = global / (micro × "
    "data-parallel).",
    "The dynamic-shape iterator also serves fine-tuning, not only the PreTrainer.",
    "--mixed-precision works in the black-box command too (it resolves to bf16 where fp16 does not run).",
    "Megatron refuses --rampup-batch-size with --train-iters (its 2024 GPT-3 example passes both); rapidtrain runs "
    "it: the batch ramps by samples consumed, the schedule's horizon is --lr-decay-iters × the final batch.",
    "Megatron's leniencies instead of refusals: --sequence-parallel at --tensor-model-parallel-size 1 is turned "
    "off, --finetune without --load does nothing (each said in the plan).",
)


def violations(args: Args, ctx: RunContext) -> list[str]:
    return [rule.message(args, ctx) for rule in RULES if rule.violated(args, ctx)]


def validate(args: Args, ctx: RunContext) -> None:
    """Raise FlagConflict (exit status 2) listing every violated rule."""
    messages = violations(args, ctx)
    if messages:
        raise FlagConflict(messages)


def exit_on_conflicts(args: Args, ctx: RunContext) -> None:
    """For entry points: print every problem to stderr and exit 2, without a traceback."""
    messages = violations(args, ctx)
    if messages:
        print(format_conflicts(messages), file=sys.stderr)
        raise SystemExit(2)


def compatibility_markdown() -> str:
    """docs/compatibility.md: the switches × switches matrix and each rule in words, from RULES."""
    switches = ["--oss-memory-optimization", "--oss-sdp-memory-optimization", "--fsdp-memory-optimization",
                "--zero-1-memory-optimization", "--zero-2-memory-optimization", "--zero-3-memory-optimization",
                "--cpu-offload", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--expert-model-parallel-size", "--data-iterator", "--pretrained-model-name-or-path",
                "--fp16", "--bf16"]
    short = {s: s.removeprefix("--").replace("-memory-optimization", "").replace("-model-parallel-size", "")
             for s in switches}
    lines = ["# Compatibility of rapidtrain's switches", "",
             "Generated from `rapidtrain/config/rules.py` by `python -m rapidtrain.config.rules --write-docs`; "
             "do not edit.", "",
             "A cell names the rules that involve both switches (each may hold only under some values, see below);",
             "an empty cell means no rule relates them.", "",
             "| | " + " | ".join(short[s] for s in switches) + " |",
             "|---|" + "---|" * len(switches)]
    for row in switches:
        cells = []
        for col in switches:
            names = [r.name for r in RULES if row != col and row in r.flags and col in r.flags]
            cells.append(", ".join(names))
        lines.append(f"| {short[row]} | " + " | ".join(cells) + " |")
    lines += ["", "## The rules", "", "| rule | flags | in words |", "|---|---|---|"]
    lines += [f"| `{r.name}` | {', '.join(f'`{f}`' for f in r.flags)} | {r.summary} |" for r in RULES]
    lines += ["", "## Rapidformer restrictions that rapidtrain lifts", ""]
    lines += [f"- {text}" for text in LIFTED_RESTRICTIONS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    target = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
    if "--write-docs" in sys.argv:
        target.parent.mkdir(exist_ok=True)
        target.write_text(compatibility_markdown())
        print(f"wrote {target}")
    else:
        print(compatibility_markdown())
