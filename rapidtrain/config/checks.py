"""The predicates the rule tables are written with: layout and batch arithmetic read from the flags, and the
problem finders that return a message or None."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

from rapidtrain.config import arguments
from rapidtrain.config.partitioning import chosen_partitioning, zero_stage
from rapidtrain.config.plan import layout_of
from rapidtrain.config.resolve import (
    optimizer_settings,
    precision_of,
    read_user_config,
    switches_of,
    tokenizer_settings_of,
    zero_by_fsdp2,
    zero_flag_defaults,
)
from rapidtrain.config.settings import (
    Batches,
    RunContext,
    context_parallel_of,
    data_parallel_size,
    expand_num_experts,
)
from rapidtrain.data.tokenizer import TokenizerSettingsError, tokenizer_vocab_size
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


def partitioning_flags(args: Args) -> list[str]:
    return chosen_partitioning(args)


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def tp_size(args: Args) -> int:
    return args.tensor_model_parallel_size


def pp_size(args: Args) -> int:
    return args.pipeline_model_parallel_size


def three_d(args: Args) -> bool:
    return tp_size(args) > 1 or pp_size(args) > 1


def cp_size(args: Args) -> int:
    return context_parallel_of(args)[0]


def dp_size(args: Args, ctx: RunContext) -> int:
    return data_parallel_size(ctx.world_size, tp_size(args), pp_size(args), cp_size(args))


def layout_divides(args: Args, ctx: RunContext) -> bool:
    return tp_size(args) >= 1 and pp_size(args) >= 1 and cp_size(args) >= 1 and \
        ctx.world_size % (tp_size(args) * pp_size(args) * cp_size(args)) == 0


def accumulation_steps(args: Args, ctx: RunContext) -> int | None:
    """Micro-batches per iteration, when the batch flags divide (another rule reports when they do not)."""
    if not layout_divides(args, ctx) or args.micro_batch_size < 1:
        return None
    batches = Batches.resolve(args.micro_batch_size, args.global_batch_size, dp_size(args, ctx))  # the plan's rule
    divides = batches.global_batch_size % (batches.micro_batch_size * batches.data_parallel_size) == 0
    return batches.accumulation_steps if divides else None


def uses_hf_model(args: Args) -> bool:
    """A Hugging Face model is trained (fine-tuning tasks, user scripts); with --task pretraining the folder
    only gives the built-in model its initial weights."""
    return not hf_config.trains_builtin_model(args)


def query_groups(args: Args) -> int:
    return (args.num_query_groups or 1) if args.group_query_attention else args.num_attention_heads


def deepspeed_zero(args: Args) -> bool:
    return zero_stage(args) > 0 and not zero_by_fsdp2(args)


def optimizer_choice(args: Args) -> tuple[str, str]:
    """(name, flag that chose it): `--optimizer` overrides `--optimizers`."""
    return (args.optimizer, "--optimizer") if args.optimizer else (args.optimizers, "--optimizers")


def sliding_window_of(args: Args) -> int | None:
    """The sliding window of a Hugging Face Qwen2 that initialises the built-in model, if it uses one: only its layers
    from max_window_layers on attend within it, which the built-in GPT's one window for all layers does not build.
    (Mistral's and Mixtral's window covers every layer: it becomes --sliding-window.)"""
    if not hf_config.initialises_builtin(args) or hf_config.unsupported_reason(args):
        return None
    config = hf_config.read_config(args.pretrained_model_name_or_path)
    if config.get("model_type") != "qwen2" or not config.get("use_sliding_window"):
        return None
    return config.get("sliding_window")


def lengths(args: Args) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in ("train_iters", "train_samples", "epochs")
            if getattr(args, n, None) is not None]


def warmups(args: Args) -> list[str]:
    given = [("--lr-warmup-fraction", args.lr_warmup_fraction is not None),
             ("--lr-warmup-iters", args.lr_warmup_iters > 0), ("--lr-warmup-samples", args.lr_warmup_samples > 0)]
    return [flag for flag, present in given if present]


def mixed_schedule_flags(args: Args) -> list[str]:
    """Schedule flags counted in the other unit than the training length."""
    if args.train_samples is not None:
        names = (("lr_decay_iters", None), ("lr_warmup_iters", 0), ("lr_wsd_decay_iters", None))
    else:
        names = (("lr_decay_samples", None), ("lr_warmup_samples", 0), ("lr_wsd_decay_samples", None))
    return [f"--{n.replace('_', '-')}" for n, unset in names if getattr(args, n) not in (unset, None)]


def batch_schedule_problem(args: Args) -> str | None:
    from rapidtrain.config.resolve import parse_step_schedule

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


def batch_schedule_misfits(args: Args, ctx: RunContext) -> list[int]:
    """Global batches of the ramp-up / step schedule that do not split into whole micro-batches."""
    from rapidtrain.config.resolve import batch_schedule_of

    if batch_schedule_problem(args) is not None or not layout_divides(args, ctx) or args.micro_batch_size < 1:
        return []
    schedule = batch_schedule_of(args)
    if schedule is None:
        return []
    per_step = args.micro_batch_size * dp_size(args, ctx)
    if pp_size(args) > 1 and interleaved(args):
        per_step *= pp_size(args)
    final = args.global_batch_size or per_step
    return [size for size in schedule.sizes(final) if size % per_step]


def different_folders(a: str, b: str) -> bool:
    from pathlib import Path

    return Path(a).resolve() != Path(b).resolve()


def deepspeed_config_problem(args: Args) -> str | None:
    if not args.deepspeed_config:
        return None
    if not deepspeed_zero(args):
        return (f"--deepspeed_config {args.deepspeed_config}: its settings apply where DeepSpeed runs, which is a "
                "--zero-1/2/3-memory-optimization switch without tensor/pipeline parallelism here. Add one, or drop "
                "--deepspeed_config.")
    try:
        read_user_config(args.deepspeed_config)
    except ValueError as error:
        return str(error)
    return None


def per_split_problem(args: Args, ctx: RunContext) -> str | None:
    splits = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if not any(splits):
        return None
    if args.data_path:
        return ("--data-path with --train-data-path / --valid-data-path / --test-data-path: the per-split paths "
                "replace --data-path and its --split. Give one form (Megatron refuses both too).")
    if needs_iterations(args, ctx) and not args.train_data_path:
        return "--valid-data-path / --test-data-path without --train-data-path: pretraining needs training data."
    if args.data_iterator == "dynamic-shape":
        return ("--data-iterator dynamic-shape reads the documents of one --data-path prefix; with per-split data "
                "drop it, or give --data-path PREFIX --split instead.")
    return None


LOW_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "adamw_4bit")


NON_ELEMENTWISE_OPTIMIZERS = ("apex_lamb", "adafactor")  # per-parameter norms or factored statistics


OFFLOADABLE_OPTIMIZERS = ("apex_adam", "adamw", "adam")  # what DeepSpeedCPUAdam implements


def low_bit_optimizer_refusal(args: Args, ctx: RunContext) -> str | None:
    """Why no library serves the chosen 8/4-bit optimizer on this layout and device (None: one does)."""
    if optimizer_choice(args)[0] not in LOW_BIT_OPTIMIZERS or not layout_divides(args, ctx):
        return None
    from rapidtrain.optim.optimizers import low_bit_optimizer_problem

    layout = layout_of(args, ctx)
    return low_bit_optimizer_problem(optimizer_settings(args, layout, switches_of(args, layout, ctx)), ctx.device_type)


def adafactor_on_dtensors(args: Args, ctx: RunContext) -> bool:
    """--optimizer adafactor on a layout whose parameters are DTensors (torch's Adafactor fails on them)."""
    if optimizer_choice(args)[0] != "adafactor" or not layout_divides(args, ctx):
        return False
    layout = layout_of(args, ctx)
    return optimizer_settings(args, layout, switches_of(args, layout, ctx)).dtensor_parameters


MUON_OPTIONS = ("muon_momentum", "muon_nesterov", "muon_num_ns_steps", "muon_scale_mode", "muon_extra_scale_factor")


def muon_chosen(args: Args) -> bool:
    from rapidtrain.optim.muon import MUON_OPTIMIZER_NAMES

    return optimizer_choice(args)[0] in MUON_OPTIMIZER_NAMES


def muon_under_fairscale(args: Args, ctx: RunContext) -> bool:
    if not muon_chosen(args) or not layout_divides(args, ctx):
        return False
    layout = layout_of(args, ctx)
    return switches_of(args, layout, ctx).partitioning_engine == "fairscale"


def muon_options_without_muon(args: Args) -> list[str]:
    """--muon-* options given while another optimizer runs (they would change nothing)."""
    given = set(getattr(args, "given_flags", ()))
    return [] if muon_chosen(args) else [flag_name(option) for option in MUON_OPTIONS if option in given]


def bad_muon_values(args: Args) -> list[str]:
    """Muon's settings outside what torch.optim.Muon takes (and a zero scale, which would not train)."""
    bad = []
    if not 0.0 <= args.muon_momentum < 1.0 or args.muon_momentum != args.muon_momentum:
        bad.append(f"--muon-momentum {args.muon_momentum} (give a value in [0, 1), e.g. 0.9)")
    if not 1 <= args.muon_num_ns_steps < 100:
        bad.append(f"--muon-num-ns-steps {args.muon_num_ns_steps} (torch.optim.Muon takes 1 to 99; 5 is usual)")
    if not 0.0 < args.muon_extra_scale_factor < float("inf"):
        bad.append(f"--muon-extra-scale-factor {args.muon_extra_scale_factor} (give a finite value > 0, e.g. 1.0)")
    return bad


def lora_settings_given(args: Args) -> list[str]:
    given = [("--lora-alpha", args.lora_alpha is not None), ("--lora-dropout", args.lora_dropout != 0.0),
             ("--lora-target-modules", bool(args.lora_target_modules))]
    return [flag for flag, is_given in given if is_given]


def bad_lora_values(args: Args) -> list[str]:
    bad = []
    if args.lora_rank < 0:
        bad.append(f"--lora-rank {args.lora_rank} must be >= 0 (0 turns LoRA off)")
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        bad.append(f"--lora-alpha {args.lora_alpha:g} must be > 0")
    if not 0.0 <= args.lora_dropout < 1.0:
        bad.append(f"--lora-dropout {args.lora_dropout:g} must be in [0, 1)")
    return bad


def k_bit_flag(args: Args) -> str:
    return "--load-in-4bit" if args.load_in_4bit else "--load-in-8bit"


def k_bit_problem(args: Args, ctx: RunContext) -> str | None:
    if not (args.load_in_4bit or args.load_in_8bit):
        return None
    from rapidtrain.optim.optimizers import bitsandbytes_problem

    return bitsandbytes_problem(ctx.device_type, kernels="4/8-bit layer")


def compile_settings_given(args: Args) -> list[str]:
    given = [("--torch-compile-backend", args.torch_compile_backend != "inductor"),
             ("--torch-compile-mode", args.torch_compile_mode is not None)]
    return [flag for flag, is_given in given if is_given]


def compile_requested(args: Args) -> bool:
    """Whether torch.compile runs: --torch-compile, or --onnx-runtime-training where ORTModule cannot serve."""
    if args.torch_compile:
        return True
    if args.onnx_runtime_training:
        from rapidtrain.config.resolve import ort_status

        return not ort_status()[0]
    return False


def compile_backends() -> list[str]:
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def zero_settings_given(args: Args, stage3_only: bool = False) -> list[str]:
    """The DeepSpeed ZeRO flags given other values than their defaults (stage-3 ones only, if asked)."""
    defaults = zero_flag_defaults()
    dests = [d for d in defaults if not stage3_only or "stage3" in d]
    flags = [flag_name(d) for d in dests if getattr(args, d) != defaults[d]]
    return [f.replace("--zero-overlap-comm", "--no-zero-overlap-comm").replace(
        "--zero-contiguous-gradients", "--no-zero-contiguous-gradients") for f in flags]


def async_io_problem() -> str | None:
    """Why DeepSpeed's async I/O op (ZeRO-Infinity's NVMe offload) cannot build here, or None when it can."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as error:  # DeepSpeed missing or broken: say so rather than fail
        return f"DeepSpeed's AsyncIOBuilder does not import ({type(error).__name__}: {error})"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("DeepSpeed's async_io op cannot build here: it needs libaio's headers and library (Debian/Ubuntu: "
                "apt-get install libaio-dev)")
    return None


def experts_of(args: Args) -> list[int]:
    return [e for e in expand_num_experts(args.num_experts, args.num_layers, args.moe_layer_freq) if e > 0]


def num_experts_length_ok(args: Args) -> bool:
    """One count, one per layer, or one per MoE layer with MoE layers at a fixed interval (DeepSpeed's pyramid)."""
    return not args.num_experts or len(args.num_experts) == 1 or (
        args.num_layers >= 1 and args.num_layers % len(args.num_experts) == 0)


def needs_iterations(args: Args, ctx: RunContext) -> bool:
    # A user script runs its own template (an epoch-based Finetuner or own loop too), whatever --task says.
    return args.task == "pretraining" and not (args.user_script or ctx.script)


def positive_sizes(args: Args) -> list[str]:
    names = ("micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "num_query_groups", "ffn_hidden_size", "max_position_embeddings", "kv_channels",
             "make_vocab_size_divisible_by")
    bad = [flag_name(n) for n in names if (value := getattr(args, n, None)) is not None and value < 1]
    if args.global_batch_size is not None and args.global_batch_size < 1:
        bad.append("--global-batch-size")
    return bad


def yarn_problems(args: Args) -> list[str]:
    """YaRN's values that cannot be, each as 'FLAG VALUE: why'."""
    problems = []
    if not args.rotary_scaling_factor > 0:
        problems.append(f"--rotary-scaling-factor {args.rotary_scaling_factor:g} stretches the context: give a "
                        "positive factor")
    original = args.yarn_original_max_position_embeddings
    if original is not None and original < 1:
        problems.append(f"--yarn-original-max-position-embeddings {original}: give the original context, at least 1")
    fast = 32.0 if args.yarn_beta_fast is None else args.yarn_beta_fast
    slow = 1.0 if args.yarn_beta_slow is None else args.yarn_beta_slow
    if not 0 < slow < fast:
        problems.append(f"--yarn-beta-slow {slow:g} / --yarn-beta-fast {fast:g}: turns over the original context, "
                        "positive with beta-slow below beta-fast")
    return problems


def mla_problems(args: Args) -> list[str]:
    """Multi-head latent attention's sizes that cannot be built, each as 'FLAG VALUE: why'."""
    sizes = {"--kv-lora-rank": args.kv_lora_rank, "--qk-head-dim": args.qk_head_dim,
             "--qk-pos-emb-head-dim": args.qk_pos_emb_head_dim, "--v-head-dim": args.v_head_dim,
             "--q-lora-rank": args.q_lora_rank}
    problems = [f"{flag} {size}: give at least 1" for flag, size in sizes.items() if size is not None and size < 1]
    if args.qk_pos_emb_head_dim >= 1 and args.qk_pos_emb_head_dim % 2:
        problems.append(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim}: rope rotates pairs, give an even size")
    return problems


def non_finite_or_negative(args: Args) -> list[str]:
    names = ("lr", "min_lr", "weight_decay", "clip_grad")
    return [f"{flag_name(n)} {getattr(args, n)}" for n in names
            if getattr(args, n) is not None and not (math.isfinite(getattr(args, n)) and getattr(args, n) >= 0)]


def min_lr_above_lr(args: Args) -> bool:
    lr, floor = args.lr, args.min_lr
    return lr is not None and floor is not None and math.isfinite(lr) and math.isfinite(floor) and floor > lr


def not_positive_counts(args: Args) -> list[str]:
    """Counts that must be at least 1 when given: a 0 would divide by zero or never log, evaluate or stop."""
    names = ("train_iters", "epochs", "log_interval", "eval_interval", "save_interval", "exit_interval",
             "nproc_per_node", "distributed_timeout_minutes")
    bad = [f"{flag_name(n)} {getattr(args, n)}" for n in names
           if getattr(args, n, None) is not None and getattr(args, n) < 1]
    return bad + [f"{flag_name(n)} {getattr(args, n)}" for n in ("eval_iters", "num_workers")
                  if getattr(args, n, None) is not None and getattr(args, n) < 0]


# (flag, low, high, high included): probabilities; a dropout of 1 zeroes every activation.
FRACTIONS = (("hidden_dropout", 0.0, 1.0, False), ("attention_dropout", 0.0, 1.0, False),
             ("mask_prob", 0.0, 1.0, True), ("short_seq_prob", 0.0, 1.0, True),
             ("adam_beta1", 0.0, 1.0, False), ("adam_beta2", 0.0, 1.0, False))


def outside_range(args: Args) -> list[str]:
    bad = []
    for name, low, high, closed in FRACTIONS:
        value = getattr(args, name, None)
        if value is None:  # an entry point fills it in later
            continue
        if not (low <= value <= high if closed else low <= value < high):  # NaN fails both
            bad.append(f"{flag_name(name)} {value} (allowed [{low:g}, {high:g}{']' if closed else ')'})")
    return bad


SEED_LIMIT = 2**32  # numpy's RandomState, which orders the data, takes seeds in [0, 2**32)


def split_problem(args: Args, ctx: RunContext) -> str | None:
    """Why --split cannot be used, or None: unparseable, all zero, or no training share in pretraining."""
    from rapidtrain.data.index_cache import DataConfigError
    from rapidtrain.data.splits import parse_split

    try:
        weights = parse_split(args.split)
    except DataConfigError as error:
        return str(error)
    if needs_iterations(args, ctx) and weights[0] == 0:
        return (f"--split {args.split!r} gives the training split no documents; pretraining needs a positive first "
                "(train) weight, e.g. --split 969,30,1")
    return None


# The sample stream's indices take about 28 bytes per sample (sample index 16, shuffle index 8, document index
# ~4): beyond 2**36 samples (~1.8 TiB of indices, 35 times the largest public pretraining runs of ~2·10^9
# samples) the count is a typo, not a plan.
MAX_TRAIN_SAMPLES = 2**36


INDEX_BYTES_PER_SAMPLE = 28


def train_samples_of(args: Args, ctx: RunContext) -> int | None:
    if args.train_samples is not None:
        return args.train_samples
    if args.train_iters is None or args.train_iters < 1 or args.micro_batch_size < 1:
        return None
    return args.train_iters * (args.global_batch_size or args.micro_batch_size * max(dp_size(args, ctx), 1))


# Options of a switch that is off would be accepted and do nothing: each is refused without its switch.
TRACKER_OPTIONS = (("wandb_exp_name", "wandb_project"), ("wandb_save_dir", "wandb_project"),
                   ("mlflow_tracking_uri", "mlflow_experiment"), ("mlflow_run_name", "mlflow_experiment"),
                   ("profile_step_start", "profile"), ("profile_step_end", "profile"), ("profile_ranks", "profile"),
                   ("async_save", "save"))


def options_without_switch(args: Args) -> list[str]:
    given = set(getattr(args, "given_flags", ()))
    return [f"{flag_name(option)} needs {flag_name(switch)}" for option, switch in TRACKER_OPTIONS
            if option in given and not getattr(args, switch, None)]


def recompute_granularities(args: Args) -> list[str]:
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


def cpu_offloading_problem(args: Args) -> str | None:
    """What Megatron-Core's TransformerConfig refuses of --cpu-offloading: a layer count outside 0 to the layers - 1,
    and offloading beside recomputation."""
    if not getattr(args, "cpu_offloading", False):
        return None
    layers = args.num_layers or 0
    if not 0 <= args.cpu_offloading_num_layers < max(layers, 1):
        return (f"--cpu-offloading-num-layers {args.cpu_offloading_num_layers}: give 0 to --num-layers - 1 "
                f"({max(layers - 1, 0)}) layers whose activations go to host memory.")
    if recompute_granularities(args):
        return (f"--cpu-offloading with {' and '.join(recompute_granularities(args))}: a recomputed layer keeps "
                "almost nothing to offload; choose one (Megatron-Core refuses both too).")
    return None


def recompute_problem(args: Args) -> str | None:
    asked = recompute_granularities(args)
    kinds = {text.split()[-1].strip("()") for text in asked}
    if len(kinds) > 1:
        return f"{' and '.join(asked)} ask for different recompute granularities; keep one."
    method, layers = args.recompute_method or args.activations_checkpoint_method, args.recompute_num_layers
    if not asked:
        return None  # --recompute-method / --recompute-num-layers alone: the plan says they change nothing
    if kinds == {"selective"} and (method or layers is not None):
        return ("--recompute-granularity selective recomputes the attention core of every layer; "
                "--recompute-method / --recompute-num-layers do not apply to it (as in Megatron): drop them.")
    if layers is not None and layers < 1:
        return f"--recompute-num-layers {layers} must be at least 1."
    if (method or "uniform") == "uniform" and (layers or 1) > 1:
        return (f"--recompute-method uniform --recompute-num-layers {layers}: rapidtrain recomputes in units of one "
                "layer, not chunks of several; use --recompute-num-layers 1 (every layer), or --recompute-method "
                f"block --recompute-num-layers {layers} to recompute only the first {layers} layers of each stage.")
    modules = set(getattr(args, "recompute_modules", None) or ("core_attn",)) if kinds == {"selective"} else set()
    if modules - {"core_attn"} and uses_hf_model(args):
        return (f"--recompute-modules {' '.join(sorted(modules))}: the modules are the built-in models'; a Hugging "
                "Face model recomputes its attention core only (--recompute-modules core_attn) or whole layers "
                "(--recompute-granularity full).")
    lacking = [name for name, present in (
        ("mla_up_proj", bool(getattr(args, "multi_latent_attention", False))),
        ("moe", bool(args.num_experts)), ("moe_act", bool(args.num_experts)),
        ("shared_experts", bool(getattr(args, "moe_shared_expert_intermediate_size", None))),
    ) if name in modules and not present]
    if lacking:
        return (f"--recompute-modules {' '.join(lacking)}: this model has no "
                + ", ".join({"mla_up_proj": "multi-latent attention", "moe": "MoE layer", "moe_act": "experts",
                             "shared_experts": "shared experts"}[name] for name in lacking)
                + " to recompute; drop them.")
    backend = getattr(args, "attention_backend", "auto")
    if "core_attn" in modules and KERNEL_OF_NAME.get(backend) == "eager":
        return (f"--recompute-granularity selective recomputes the attention core, a scaled_dot_product_attention "
                f"or flex_attention call; --attention-backend {backend} computes softmax(QKᵀ)V itself, so there "
                "would be nothing to recompute: use --recompute-granularity full or op, or an SDPA backend (auto).")
    if kinds == {"op"} and uses_hf_model(args):
        return ("--recompute-granularity op replays the built-in models' layers op by op; a Hugging Face model's "
                "layers run different ops when recomputed (transformers' own checkpointing path), so it is not "
                "served for them: use --recompute-granularity full or selective.")
    per_stage = args.num_layers // max(pp_size(args), 1) if args.num_layers else None
    if method == "block" and per_stage and layers and layers > per_stage:
        return (f"--recompute-method block --recompute-num-layers {layers}: a pipeline stage holds {per_stage} "
                f"layers; give at most {per_stage}.")
    return None


def auto_micro_batch_problem(args: Args, ctx: RunContext) -> str | None:
    if not args.auto_micro_batch_size:
        return ("--memory-budget-gb is the budget of --auto-micro-batch-size and does nothing alone: add "
                "--auto-micro-batch-size, or drop it.") if args.memory_budget_gb is not None else None
    if args.memory_budget_gb is None or not args.memory_budget_gb > 0:
        return ("--auto-micro-batch-size fits the micro batch into --memory-budget-gb GiB per rank: give a positive "
                "budget (trying sizes on the GPU until one runs out of memory is not served yet).")
    if uses_hf_model(args):
        return ("--auto-micro-batch-size estimates activations from the built-in model's shape; for a Hugging Face "
                "model give --micro-batch-size yourself.")
    if args.rampup_batch_size or args.step_batch_size_schedule:
        return ("--auto-micro-batch-size keeps one global batch; with a batch schedule give --micro-batch-size "
                "yourself.")
    if not layout_divides(args, ctx):
        return None  # the layout rule reports it
    from rapidtrain.config.memory import activation_context, memory_estimate, with_peak
    from rapidtrain.config.resolve import (
        builtin_vocab_size,
        model_config_from_args,
        precision_of,
        tokenizer_settings_of,
    )

    vocab = builtin_vocab_size(args, tokenizer_settings_of(args))
    if not vocab:
        return None
    model, precision, layout = model_config_from_args(args, vocab), precision_of(args, ctx), layout_of(args, ctx)
    per_rank = (args.global_batch_size or args.micro_batch_size * layout.data_parallel_size) \
        // layout.data_parallel_size
    switches = switches_of(args, layout, ctx)
    memory = with_peak(memory_estimate(args, model, layout, precision, ctx, switches), model, 1, per_rank, layout,
                       switches.recompute, activation_context(model, precision, layout, switches, ctx.device_type))
    if memory.peak_bytes_per_rank <= args.memory_budget_gb * 2**30:
        return None
    stage = max(range(len(memory.stage_state_bytes)),
                key=lambda i: memory.stage_state_bytes[i] + memory.stage_activation_bytes[i])
    return (f"--auto-micro-batch-size: even micro batch 1 needs ~{memory.peak_bytes_per_rank / 2**30:.2f} GiB on "
            f"the largest rank (model state {memory.stage_state_bytes[stage] / 2**30:.2f} GiB + activations "
            f"{memory.stage_activation_bytes[stage] / 2**30:.2f} GiB) > --memory-budget-gb "
            f"{args.memory_budget_gb:g}, so the global batch cannot be kept: raise the budget, recompute "
            "(--recompute-granularity full), shard the model state (--zero-3-memory-optimization, tensor or pipeline "
            "parallelism), or shorten --seq-length.")


def profile_problem(args: Args, ctx: RunContext) -> str | None:
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


def padding_free_problem(args: Args, ctx: RunContext) -> str | None:
    """Why --padding-free cannot keep the packed sequences apart in this run; None where it can."""
    if not args.padding_free:
        return None
    if args.task != "casual_lm" or not uses_hf_model(args):
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


def attention_backend_problem(args: Args, ctx: RunContext) -> str | None:
    from rapidtrain.models.attention_backends import attention_problem

    return attention_problem(args.attention_backend, ctx.device_type, hf_config.trains_builtin_model(args),
                             args.attention_dropout, half_precision=precision_of(args, ctx).dtype != "fp32",
                             masked_by=_masked_by(args))


def _masked_by(args: Args) -> str | None:
    """The flag that makes the built-in model attend under an explicit mask, None where causality alone masks."""
    if args.reset_attention_mask:
        return "--reset-attention-mask"
    return f"--softmax-type {args.softmax_type}" if args.softmax_type != "vanilla" else None


def megatron_task_problem(args: Args, ctx: RunContext) -> str | None:
    """What Megatron's tasks (--task MNLI / RACE, rapidtrain/tasks_main.py) need and do not combine with."""
    if args.task not in arguments.MEGATRON_TASKS or args.user_script or ctx.script:
        return None
    task = f"--task {args.task}"
    if not args.train_data or not args.valid_data:
        return (f"{task} reads its files from --train-data and --valid-data (Megatron's tasks/main.py): give both "
                "(MNLI: GLUE's train.tsv and dev_matched.tsv ...; RACE: folders such as RACE/train/middle)")
    if args.epochs is None and args.train_iters is None:
        return f"{task} trains for --epochs N (Megatron's tasks/main.py); give --epochs"
    if args.model_type != "bert":
        return f"{task} fine-tunes the built-in BERT; drop --model-type {args.model_type}"
    if three_d(args) or (args.num_experts and max(args.num_experts) > 1):
        return (f"{task}: the task model (BERT with a new head) runs data-parallel here, optionally with ZeRO or "
                "FSDP; drop --tensor-model-parallel-size / --pipeline-model-parallel-size / --num-experts (or set "
                "them to 1)")
    if args.data_iterator == "dynamic-shape":
        return f"{task}: Megatron's task samples are padded to --seq-length; drop --data-iterator dynamic-shape"
    return None


def pad_vocab_problem(args: Args) -> str | None:
    """BigScience's --pad-vocab-size-to N pads to N rows, never fewer than the tokenizer's ids (as its Megatron)."""
    wanted = getattr(args, "pad_vocab_size_to", None)
    if wanted is None:
        return None
    settings = tokenizer_settings_of(args)
    try:
        vocab = tokenizer_vocab_size(settings) if settings is not None else 0
    except TokenizerSettingsError:
        return None  # a missing tokenizer file is reported by the plan, naming its flag
    if vocab <= wanted:
        return None
    return (f"--pad-vocab-size-to {wanted} is smaller than the tokenizer's vocabulary of {vocab} ids "
            f"(--tokenizer-type {settings.tokenizer_type if settings else ''}); give at least {vocab}")


def interleaved(args: Args) -> bool:
    """Several loop-ordered stages per rank under 1F1B: Megatron's interleaving, in rounds of about P micro-batches."""
    from rapidtrain.config.resolve import pipeline_schedule_of, virtual_stages_of

    return virtual_stages_of(args) > 1 and pipeline_schedule_of(args) == "1f1b"


def pipeline_split_problem(args: Args) -> str | None:
    """Why the flags' pipeline split cannot be made (config/pipeline_split.py names the flags and numbers)."""
    from rapidtrain.config.pipeline_split import SplitError
    from rapidtrain.config.resolve import pipeline_split_of

    if args.num_layers < 1 or pp_size(args) < 1:
        return None
    try:
        pipeline_split_of(args)
    except SplitError as error:
        return str(error)
    return None


def pipeline_schedule_problem(args: Args, ctx: RunContext) -> str | None:
    """Why the pipeline schedule the flags ask for cannot run this layout (None: it can)."""
    from rapidtrain.config.pipeline_split import SPLIT_BACKWARD, V_SHAPED
    from rapidtrain.config.resolve import pipeline_schedule_of, virtual_stages_of

    schedule, pp = pipeline_schedule_of(args), pp_size(args)
    flag = f"--pipeline-schedule {schedule}" if args.pipeline_schedule else "--enable-zbh1-pipeline"
    if args.enable_zbh1_pipeline and args.pipeline_schedule not in (None, "zero-bubble"):
        return (f"--enable-zbh1-pipeline asks for the zero-bubble schedule, --pipeline-schedule "
                f"{args.pipeline_schedule} for another: give one")
    if args.enable_zbh1_exact_semantics and schedule != "zero-bubble":
        return ("--enable-zbh1-exact-semantics tunes the zero-bubble schedule: give --enable-zbh1-pipeline (or "
                "--pipeline-schedule zero-bubble) with it, or drop it")
    if schedule == "1f1b":
        return None
    if pp < 2:
        return f"{flag} schedules pipeline stages: it needs --pipeline-model-parallel-size ≥ 2 (it is {pp})"
    virtual_flags = [name for name, given in (
        ("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage),
        ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank)) if given]
    if schedule in V_SHAPED and virtual_flags:
        named = virtual_stages_of(args)
        if args.num_virtual_stages_per_pipeline_rank not in (None, 2) or (
                args.num_layers_per_virtual_pipeline_stage and named != 2 and not args.pipeline_model_parallel_layout):
            return (f"{flag} runs exactly two stages per pipeline rank (a V); {' and '.join(virtual_flags)} ask(s) "
                    "for another number: drop it")
    if schedule == "gpipe" and virtual_stages_of(args) > 1:
        return f"{flag} runs one stage per pipeline rank: drop the virtual stages or choose 1f1b / zero-bubble"
    steps = accumulation_steps(args, ctx)
    if schedule == "dualpipev" and steps is not None and steps < 2 * pp:
        return (f"{flag} needs at least as many micro-batches per iteration as stages (2 × --pipeline-model-parallel-"
                f"size {pp} = {2 * pp}); the batch flags give {steps}. Raise --global-batch-size.")
    if schedule == "zero-bubble" and steps is not None and steps % max(1, steps // pp):
        return (f"{flag} runs micro-batches in rounds of --pipeline-model-parallel-size {pp}: {steps} micro-batches "
                f"per iteration are not a whole number of rounds. Make them a multiple of {pp}.")
    if schedule in SPLIT_BACKWARD:
        if args.torch_compile:
            return (f"{flag} splits each backward into input and weight gradients, which torch.distributed.pipelining "
                    "does not do for compiled stages: drop --torch-compile or choose --pipeline-schedule 1f1b")
        if tp_size(args) > 1 and layout_divides(args, ctx) and dp_size(args, ctx) > 1:
            return (f"{flag} with --tensor-model-parallel-size {tp_size(args)} and data-parallel size "
                    f"{dp_size(args, ctx)}: the split backward writes weight gradients past replicate()'s hooks, "
                    "and reducing tensor-parallel gradients over data parallelism apart from them is not in "
                    "rapidtrain; choose --pipeline-schedule 1f1b, or tensor × pipeline parallelism alone")
        from rapidtrain.config.resolve import mtp_depths

        if mtp_depths(args):
            return (f"{flag} with --mtp-num-layers {mtp_depths(args)}: the multi-token prediction loss takes a "
                    "backward of its own through the last stage, which the split backward (input, then weight "
                    "gradients) has already freed (measured: torch stops on it); choose --pipeline-schedule 1f1b")
        if chosen_partitioning(args):
            return (f"{flag} with {', '.join(flag_name(d) for d in chosen_partitioning(args))}: the split backward "
                    "writes weight gradients itself, past FSDP2's reduce-scatter hooks; choose --pipeline-schedule "
                    "1f1b or plain data parallelism")
    return None
