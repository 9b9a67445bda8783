"""The plan: what the flags resolve to, before anything starts.

Pure and frozen: layout, batch arithmetic, precision, the engine behind each switch (with the reason
when a substitute serves) and an estimate of model-state bytes per rank. `rapidtrain plan` prints it,
and every run logs it first. Batch arithmetic and precision resolution live here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rapidtrain.data.tokenizer import TokenizerSettings
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.hf_config import initialises_builtin, trains_builtin_model

if TYPE_CHECKING:
    from rapidtrain.optim.grad_scaler import LossScaleSettings
    from rapidtrain.optim.optimizers import OptimizerSettings

DeviceType = Literal["cpu", "cuda"]
Dtype = Literal["fp32", "bf16", "fp16"]

@dataclass(frozen=True)
class DeviceCapability:
    """What the device does natively, detected once (`detect_capability`); tests and `rapidtrain plan --device`
    give it instead.

    `name`: the GPU's name (torch.cuda.get_device_name) or the CPU's vector instruction set ("AVX512", "AVX2");
    `native_bf16`: bf16 arithmetic in hardware (a GPU of compute capability 8.0 or newer; a CPU with
    AVX512-BF16 or AMX), not emulated in fp32 by torch."""

    name: str = ""
    native_bf16: bool = True


def detect_capability(device_type: DeviceType) -> DeviceCapability:
    import torch

    if device_type == "cuda":
        return DeviceCapability(torch.cuda.get_device_name(), torch.cuda.is_bf16_supported(including_emulation=False))
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return DeviceCapability(torch.backends.cpu.get_cpu_capability(), bool(native))


@dataclass(frozen=True)
class RunContext:
    """What the flags alone do not say: how many processes, on which device type (and what it does natively),
    running which script (`--user-script FILE`, or a file started as `torchrun FILE` that is not one of
    rapidtrain's own)."""

    world_size: int = 1
    device_type: DeviceType = "cpu"
    script: str | None = None
    capability: DeviceCapability = field(default_factory=DeviceCapability)

    @staticmethod
    def detect(args: argparse.Namespace | None = None, script: str | None = None) -> RunContext:
        import torch

        device_type: DeviceType = "cuda" if torch.cuda.is_available() else "cpu"
        script = getattr(args, "user_script", None) or script
        capability = detect_capability(device_type)
        if "WORLD_SIZE" in os.environ:
            return RunContext(int(os.environ["WORLD_SIZE"]), device_type, script, capability)
        per_node = getattr(args, "nproc_per_node", None) or default_nproc_per_node(device_type)
        return RunContext(per_node * int(os.environ.get("NNODES", "1")), device_type, script, capability)


def default_nproc_per_node(device_type: DeviceType) -> int:
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    return 1


# ---- one place for the arithmetic the rules, the plan and the engine share ----

def data_parallel_size(world_size: int, tensor_parallel: int, pipeline_parallel: int) -> int:
    return max(world_size // max(tensor_parallel * pipeline_parallel, 1), 1)


def expand_num_experts(num_experts: list[int] | None, num_layers: int, moe_layer_freq: int = 1) -> tuple[int, ...]:
    """Per-layer expert counts: one number applies to every `moe_layer_freq`-th layer, a list to each layer."""
    if not num_experts:
        return ()
    if len(num_experts) == 1:
        freq = max(moe_layer_freq, 1)
        return tuple(num_experts[0] if i % freq == freq - 1 else 0 for i in range(num_layers))
    return tuple(num_experts)


def zero_stage(args: argparse.Namespace) -> int:
    for stage in (3, 2, 1):
        if getattr(args, f"zero_{stage}_memory_optimization"):
            return stage
    return 0


def precision_of(args: argparse.Namespace, ctx: RunContext) -> Precision:
    """The flags' precision, and for --mixed-precision what the device does natively: fp16 on CUDA (Rapidformer
    documents --mixed-precision as fp16), bf16 on a CPU with native bf16, else fp32."""
    if args.bf16:
        return Precision("bf16", "none", "--bf16: bf16 autocast, fp32 master weights, no loss scaling")
    if args.fp16:
        return Precision("fp16", _loss_scaling(args), "--fp16: fp16 autocast with loss scaling, fp32 master weights")
    if args.mixed_precision:
        if ctx.device_type == "cuda":
            return Precision("fp16", _loss_scaling(args), "--mixed-precision: fp16 autocast with dynamic loss scaling")
        cpu = ctx.capability.name or "this CPU"
        if ctx.capability.native_bf16:
            return Precision("bf16", "none", f"--mixed-precision on a CPU with native bf16 ({cpu} with AVX512-BF16 "
                             "or AMX) resolves to bf16: fp16 is not supported there (DeepSpeed refuses it, CPU fp16 "
                             "kernels are slow); bf16 needs no loss scaling")
        return Precision("fp32", "none", f"--mixed-precision on a CPU without native bf16 ({cpu}: no AVX512-BF16 "
                         f"or AMX) resolves to fp32: {EMULATED_BF16_COST}; fp16 is not supported on CPUs")
    return Precision("fp32", "none", "no precision flag: fp32")


EMULATED_BF16_COST = ("bf16 would be emulated in fp32 and be far slower, not faster (measured on an AVX2 EPYC: "
                      "0.73 s per step in fp32, more than 100 s in bf16)")


def precision_warnings(args: argparse.Namespace, ctx: RunContext, precision: Precision) -> list[str]:
    """An explicit --bf16 on a device that only emulates bf16 runs, but at a cost the user should know."""
    if precision.dtype != "bf16" or ctx.capability.native_bf16:
        return []
    if ctx.device_type == "cuda":
        return [f"--bf16 on {ctx.capability.name or 'this GPU'}, which has no native bf16 (compute capability 8.0 "
                "or newer): torch emulates it, expect steps slower than fp32; use --fp16 (loss-scaled) on this GPU"]
    return [f"--bf16 on a CPU without native bf16 ({ctx.capability.name or 'this CPU'}: no AVX512-BF16 or AMX): "
            f"{EMULATED_BF16_COST}; drop --bf16 (fp32), or use --mixed-precision, which picks fp32 here"]


def _loss_scaling(args: argparse.Namespace) -> str:
    return f"static {args.loss_scale:g}" if args.loss_scale else "dynamic"


@dataclass(frozen=True)
class Precision:
    dtype: Dtype
    loss_scaling: str  # "none", "dynamic" or "static <scale>"
    reason: str


@dataclass(frozen=True)
class Layout:
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    virtual_pipeline_stages: int = 1
    sequence_parallel: bool = False

    def rank_grid(self) -> list[list[list[int]]]:
        """Megatron order: pipeline outermost, then data, tensor innermost (tensor ranks are neighbours)."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        return [[[(p * dp + d) * tp + t for t in range(tp)] for d in range(dp)]
                for p in range(self.pipeline_parallel_size)]


@dataclass(frozen=True)
class Batches:
    micro_batch_size: int
    global_batch_size: int
    accumulation_steps: int

    @staticmethod
    def resolve(micro: int, global_batch: int | None, data_parallel: int) -> Batches:
        global_batch = global_batch or micro * data_parallel
        return Batches(micro, global_batch, global_batch // (micro * data_parallel))


@dataclass(frozen=True)
class Switches:
    """The structured decisions the Engine acts on (the engines list says them in words)."""

    partitioning: Literal["none", "oss", "sdp", "fsdp", "zero-1", "zero-2", "zero-3"] = "none"
    partitioning_engine: Literal["ddp", "zero-redundancy", "fsdp2", "deepspeed", "fairscale"] = "ddp"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    compile: Literal["none", "inductor", "ortmodule"] = "none"
    dynamic_shape: bool = False
    tf32: bool = False  # TF32 tensor cores for fp32 matmuls (--tf32 on CUDA; no effect on a CPU)
    build_on_meta: bool = False  # the built-in model is created on meta and each rank materializes its shards


@dataclass(frozen=True)
class EngineChoice:
    switch: str
    engine: str
    reason: str = ""


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes per rank (ZeRO paper accounting); activations are not included."""

    parameters: int
    total_params: int
    active_params: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    optimizer_on_cpu: bool = False

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + (0 if self.optimizer_on_cpu else self.optimizer_bytes)


# ---- each component's own settings (nothing after the plan reads the flags) ----

@dataclass(frozen=True)
class TrainingSettings:
    """How long to train, when to evaluate and when to stop early (the loop's own part of the plan)."""

    train_iters: int | None = None
    epochs: int | None = None
    eval_interval: int | None = None  # None: no periodic evaluation (fine-tuning evaluates after each epoch)
    eval_iters: int = 10
    seed: int = 1234
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None


@dataclass(frozen=True)
class CheckpointSettings:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    finetune: bool = False  # load the model only and start at iteration 0
    load_optimizer: bool = True
    load_rng: bool = True
    # On --load, the learning-rate schedule: "same" (the flags must match the saved one), "flags"
    # (--override-opt_param-scheduler) or "checkpoint" (--use-checkpoint-opt_param-scheduler).
    schedule_from: Literal["same", "flags", "checkpoint"] = "same"


@dataclass(frozen=True)
class LoggingSettings:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    peak_tflops: float | None = None  # per device, what MFU is measured against (None: no MFU in the log)
    loss_log_file: str | None = None
    peak_source: str = ""  # where the peak comes from (--peak-tflops, the known GPU's datasheet), or why none


@dataclass(frozen=True)
class DistributedSettings:
    """How the processes talk: the process-group backend per device type and the collectives' timeout.

    On CUDA the default group is "cpu:gloo,cuda:nccl" (as torchtitan's): NCCL carries device tensors, gloo the
    host ones (token counts), so no collective can meet a tensor on a device type without a backend."""

    backend: str = "gloo"
    timeout_minutes: float = 10.0


@dataclass(frozen=True)
class DataSettings:
    """Where samples come from and how they are batched and shared out.

    `source`: "demo" (the built-in corpus: pretraining with no --data-path), "indexed" (Megatron .bin/.idx
    from --data-path), "finetune" (--data-dir/--data-name) or "script" (a user script brings its own).
    """

    source: Literal["demo", "indexed", "finetune", "script"]
    data_path: tuple[str, ...] = ()
    split: str = "969, 30, 1"
    data_impl: str = "mmap"
    cache_path: str | None = None
    seq_length: int = 256
    micro_batch_size: int = 1
    num_workers: int = 2
    seed: int = 1234
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    dynamic_shape: bool = False
    data_dir: str | None = None
    data_name: str | None = None


@dataclass(frozen=True)
class ScheduleSettings:
    """Megatron's learning-rate flags, in iterations; `optim.lr_schedule` turns them into samples once the
    training length is known (fine-tuning knows it only after counting its data)."""

    lr: float = 0.0
    min_lr: float = 0.0
    decay_style: str = "linear"
    decay_iters: int | None = None
    warmup_iters: int = 0
    warmup_fraction: float | None = None
    wsd_decay_iters: int | None = None


@dataclass(frozen=True)
class Plan:
    template: str
    task: str
    layout: Layout
    batches: Batches
    precision: Precision
    engines: tuple[EngineChoice, ...]
    memory: MemoryEstimate | None
    model: ModelConfig | None
    switches: Switches = field(default_factory=Switches)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    data: DataSettings = field(default_factory=lambda: DataSettings("script"))
    tokenizer: TokenizerSettings | None = None
    optimizer: OptimizerSettings | None = None
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    loss_scale: LossScaleSettings | None = None
    clip_grad: float = 1.0
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    notes: tuple[str, ...] = field(default_factory=tuple)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    warnings: tuple[str, ...] = field(default_factory=tuple)  # printed when a run starts, before anything is built

    @property
    def train_iters(self) -> int | None:
        return self.training.train_iters

    @property
    def epochs(self) -> int | None:
        return self.training.epochs

    def engine_for(self, switch: str) -> EngineChoice | None:
        return next((c for c in self.engines if c.switch == switch), None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def describe(self) -> str:
        return describe_plan(self)


# ---- resolution ----

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
    )


def template_of(args: argparse.Namespace, ctx: RunContext) -> str:
    if ctx.script:
        return f"user script {ctx.script}"
    if args.task == "pretraining":
        return "PreTrainer (built-in model)"
    return "Finetuner (Hugging Face model)"


def layout_of(args: argparse.Namespace, ctx: RunContext) -> Layout:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    virtual = 1
    if args.num_layers_per_virtual_pipeline_stage:
        virtual = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
    return Layout(ctx.world_size, data_parallel_size(ctx.world_size, tp, pp), tp, pp,
                  args.expert_model_parallel_size, virtual, args.sequence_parallel)


def from_args(args: argparse.Namespace, ctx: RunContext) -> Plan:
    """Resolve validated flags into the Plan, once: every component's settings, the padded vocabulary of the
    built-in model included (read from the tokenizer files; the demo corpus's is known without building it)."""
    layout = layout_of(args, ctx)
    batches = Batches.resolve(args.micro_batch_size, args.global_batch_size, layout.data_parallel_size)
    precision = precision_of(args, ctx)
    tokenizer = tokenizer_settings_of(args)
    vocab_size = builtin_vocab_size(args, tokenizer)
    model = model_config_from_args(args, vocab_size) if vocab_size else None
    engines, notes = engines_for(args, ctx, layout, precision)
    memory = memory_estimate(args, model, layout, precision) if model else None
    switches = switches_of(args, layout, ctx)
    return Plan(template_of(args, ctx), args.task, layout, batches, precision, tuple(engines), memory, model,
                switches, training_settings(args), data_settings(args, ctx), tokenizer,
                optimizer_settings(args), schedule_settings(args), loss_scale_settings(args), args.clip_grad,
                checkpoint_settings(args), logging_settings(args, ctx, precision, switches.tf32), tuple(notes),
                distributed_settings(args, ctx), tuple(precision_warnings(args, ctx, precision)))


def is_pretraining(args: argparse.Namespace, ctx: RunContext) -> bool:
    """rapidtrain's own iteration-based pretraining of the built-in model (no user script)."""
    return args.task == "pretraining" and not ctx.script


def data_settings(args: argparse.Namespace, ctx: RunContext) -> DataSettings:
    from rapidtrain.arguments import uses_demo_data

    if is_pretraining(args, ctx):
        source = "demo" if uses_demo_data(args) else "indexed"
    elif ctx.script:
        source = "demo" if uses_demo_data(args) and args.task == "pretraining" else "script"
    else:
        source = "finetune"
    return DataSettings(
        source=source, data_path=tuple(args.data_path or ()), split=args.split, data_impl=args.data_impl,
        cache_path=args.data_cache_path, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        num_workers=args.num_workers, seed=args.seed, eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob,
        dynamic_shape=args.data_iterator == "dynamic-shape", data_dir=args.data_dir, data_name=args.data_name)


def tokenizer_settings_of(args: argparse.Namespace) -> TokenizerSettings | None:
    """The tokenizer of the pretraining data: the flags', or the demo corpus's; None when there is none."""
    from rapidtrain.arguments import uses_demo_data

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


def training_settings(args: argparse.Namespace) -> TrainingSettings:
    eval_interval = args.eval_interval
    if eval_interval is None and args.task == "pretraining":
        eval_interval = 1000  # Megatron's default; fine-tuning evaluates after each epoch instead
    return TrainingSettings(train_iters=args.train_iters, epochs=args.epochs, eval_interval=eval_interval,
                            eval_iters=args.eval_iters, seed=args.seed, exit_interval=args.exit_interval,
                            exit_duration_in_mins=args.exit_duration_in_mins)


def checkpoint_settings(args: argparse.Namespace) -> CheckpointSettings:
    schedule_from = "flags" if args.override_opt_param_scheduler else (
        "checkpoint" if args.use_checkpoint_opt_param_scheduler else "same")
    return CheckpointSettings(save=args.save, save_interval=args.save_interval, load=args.load,
                              finetune=args.finetune, load_optimizer=not args.no_load_optim,
                              load_rng=not args.no_load_rng, schedule_from=schedule_from)


def logging_settings(args: argparse.Namespace, ctx: RunContext, precision: Precision, tf32: bool) -> LoggingSettings:
    from rapidtrain.peak_flops import peak_flops

    peak = peak_flops(ctx.device_type, ctx.capability.name, precision.dtype, tf32, args.peak_tflops)
    return LoggingSettings(log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir,
                           peak_tflops=peak.tflops, loss_log_file=args.loss_log_file, peak_source=peak.source)


def distributed_settings(args: argparse.Namespace, ctx: RunContext) -> DistributedSettings:
    backend = args.distributed_backend or ("nccl" if ctx.device_type == "cuda" else "gloo")
    return DistributedSettings(backend="cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
                               timeout_minutes=args.distributed_timeout_minutes)


def schedule_settings(args: argparse.Namespace) -> ScheduleSettings:
    return ScheduleSettings(lr=args.lr or 0.0, min_lr=args.min_lr, decay_style=args.lr_decay_style,
                            decay_iters=args.lr_decay_iters, warmup_iters=args.lr_warmup_iters,
                            warmup_fraction=args.lr_warmup_fraction, wsd_decay_iters=args.lr_wsd_decay_iters)


def loss_scale_settings(args: argparse.Namespace) -> LossScaleSettings:
    from rapidtrain.optim.grad_scaler import LossScaleSettings

    return LossScaleSettings(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                             min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                             hysteresis=args.hysteresis)


PARTITIONING_NAMES = {
    "oss_memory_optimization": "oss", "oss_sdp_memory_optimization": "sdp", "fsdp_memory_optimization": "fsdp",
    "zero_1_memory_optimization": "zero-1", "zero_2_memory_optimization": "zero-2",
    "zero_3_memory_optimization": "zero-3",
}


def switches_of(args: argparse.Namespace, layout: Layout, ctx: RunContext) -> Switches:
    chosen = [name for dest, name in PARTITIONING_NAMES.items() if getattr(args, dest)]
    partitioning = chosen[0] if chosen else "none"
    three_d = layout.tensor_parallel_size > 1 or layout.pipeline_parallel_size > 1
    if partitioning.startswith("zero"):
        engine = "fsdp2" if three_d else "deepspeed"
    elif partitioning in ("oss", "sdp") and args.sharding_backend == "fairscale":
        engine = "fairscale"
    else:
        engine = {"oss": "zero-redundancy", "sdp": "fsdp2", "fsdp": "fsdp2"}.get(partitioning, "ddp")
    compile_with = "none"
    if args.onnx_runtime_training:
        compile_with = "ortmodule" if _ort_status()[0] else "inductor"
    elif args.torch_compile:
        compile_with = "inductor"
    return Switches(partitioning, engine, args.cpu_offload, args.checkpoint_activations, compile_with,
                    args.data_iterator == "dynamic-shape", args.tf32 and ctx.device_type == "cuda",
                    model_construction(args, ctx, layout, partitioning, engine)[0])


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


def optimizer_settings(args: argparse.Namespace) -> OptimizerSettings:
    """The optimizer's own settings; `--optimizer` (beyond Rapidformer) overrides `--optimizers`."""
    from rapidtrain.optim.optimizers import OptimizerSettings

    name = args.optimizer or args.optimizers
    if name == "adam":  # Megatron's --optimizer adam is Adam with decoupled weight decay, i.e. AdamW
        name = "adamw"
    return OptimizerSettings(name=name, lr=args.lr or 0.0, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             sgd_momentum=args.sgd_momentum)


# ---- the engine behind each switch (DESIGN.md's table) ----

PARTITIONING_ENGINES = {
    "oss_memory_optimization": "torch.distributed.optim.ZeroRedundancyOptimizer + DistributedDataParallel",
    "oss_sdp_memory_optimization": "FSDP2 fully_shard(reshard_after_forward=False)",
    "fsdp_memory_optimization": "FSDP2 fully_shard (parameters, gradients, optimizer state)",
    "zero_1_memory_optimization": "DeepSpeed ZeRO stage 1 (deepspeed.initialize, generated config)",
    "zero_2_memory_optimization": "DeepSpeed ZeRO stage 2 (deepspeed.initialize, generated config)",
    "zero_3_memory_optimization": "DeepSpeed ZeRO stage 3 (model built under deepspeed.zero.Init)",
}
FAIRSCALE_ENGINES = {
    "oss_memory_optimization": "fairscale.optim.OSS + DistributedDataParallel",
    "oss_sdp_memory_optimization": "fairscale.optim.OSS + fairscale ShardedDataParallel",
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _partitioning_choice(args: argparse.Namespace, layout: Layout) -> EngineChoice | None:
    from rapidtrain.arguments import STATE_PARTITIONING_FLAGS

    chosen = [f for f in STATE_PARTITIONING_FLAGS if getattr(args, f)]
    if not chosen:
        return None
    dest = chosen[0]
    three_d = layout.tensor_parallel_size > 1 or layout.pipeline_parallel_size > 1
    if three_d and dest in ("zero_1_memory_optimization", "zero_2_memory_optimization"):
        return EngineChoice(_flag(dest), "FSDP2 fully_shard over the data-parallel mesh dimension, "
                            "reshard_after_forward=False", "with tensor/pipeline parallelism DeepSpeed cannot wrap the "
                            "DTensor/pipeline model; FSDP2 keeps parameters unsharded between forward and backward, "
                            "so memory is ZeRO-2's (optimizer state and gradients partitioned)")
    if args.sharding_backend == "fairscale" and dest in FAIRSCALE_ENGINES:
        return EngineChoice(_flag(dest), FAIRSCALE_ENGINES[dest], "--sharding-backend fairscale")
    return EngineChoice(_flag(dest), PARTITIONING_ENGINES[dest])


def _ort_status() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None:
        return False, ("onnxruntime-training is not installed (its last release, 1.19.2, does not import "
                       "with torch 2.13)")
    try:
        from onnxruntime.training.ortmodule import ORTModule  # noqa: F401
    except Exception as error:  # any failure means it cannot serve; say why
        return False, f"onnxruntime.training does not import with this torch: {type(error).__name__}: {error}"
    return True, ""


def engines_for(args: argparse.Namespace, ctx: RunContext, layout: Layout,
                precision: Precision) -> tuple[list[EngineChoice], list[str]]:
    from rapidtrain.optim.optimizers import describe_optimizer

    engines: list[EngineChoice] = []
    notes: list[str] = []
    backend = args.distributed_backend or ("nccl" if ctx.device_type == "cuda" else "gloo")
    three_d = layout.tensor_parallel_size > 1 or layout.pipeline_parallel_size > 1
    partitioning = _partitioning_choice(args, layout)
    if layout.data_parallel_size > 1 and (partitioning is None or "DistributedDataParallel" in partitioning.engine):
        how = "composable replicate() over the data-parallel mesh dimension" if three_d else "DistributedDataParallel"
        engines.append(EngineChoice("data parallel", f"torch {how} ({backend})",
                                    "no all-reduce on accumulation micro-batches (no_sync)"))
    if partitioning:
        engines.append(partitioning)
    if args.cpu_offload:
        engines.append(EngineChoice("--cpu-offload", "DeepSpeed offload_optimizer: cpu with DeepSpeedCPUAdam"))
    if layout.tensor_parallel_size > 1:
        engines.append(EngineChoice("--tensor-model-parallel-size", "DTensor parallelize_module: column/row split of "
                                    "attention and MLP, vocab-parallel embedding and loss"
                                    + (", sequence parallel norms/dropout" if layout.sequence_parallel else "")))
    if layout.pipeline_parallel_size > 1:
        schedule = "interleaved 1F1B" if layout.virtual_pipeline_stages > 1 else \
            "1F1B (GPipe with fewer micro-batches than stages)"
        engines.append(EngineChoice("--pipeline-model-parallel-size", f"torch.distributed.pipelining, {schedule}, "
                                    "microbatches = accumulation steps"))
    if args.num_experts:
        ep = f", experts sharded over {layout.expert_parallel_size} ranks (all-to-all)" \
            if layout.expert_parallel_size > 1 else ""
        engines.append(EngineChoice("--num-experts", f"rapidtrain MoE layers: top-{args.moe_router_topk} router, "
                                    f"load-balancing loss, capacity factor {args.moe_capacity_factor:g}{ep}"))
    if precision.dtype != "fp32":
        deepspeed_own = partitioning is not None and partitioning.engine.startswith("DeepSpeed")
        engine = f"DeepSpeed {precision.dtype} engine" if deepspeed_own else f"torch.autocast({precision.dtype})"
        if precision.loss_scaling != "none":
            engine += f" + {precision.loss_scaling} loss scaling"
        if partitioning is not None and "FSDP2" in partitioning.engine and layout.data_parallel_size > 1:
            engine += (f"; FSDP2 MixedPrecisionPolicy on the transformer blocks ({precision.dtype} all-gather and "
                       "compute, fp32 reduce-scatter and accumulation; embeddings, final norm and head in fp32)")
        engines.append(EngineChoice("precision", engine, precision.reason))
    if args.checkpoint_activations:
        engines.append(EngineChoice("--checkpoint-activations", "torch.utils.checkpoint per transformer layer"
                                    if trains_builtin_model(args)
                                    else "Hugging Face gradient_checkpointing_enable()"))
    if args.onnx_runtime_training:
        usable, why = _ort_status()
        engines.append(EngineChoice("--onnx-runtime-training", "onnxruntime ORTModule" if usable
                                    else "torch.compile (inductor) as the graph optimiser", why))
    if args.torch_compile:
        engines.append(EngineChoice("--torch-compile", "torch.compile (inductor) per transformer layer"))
    if ctx.device_type == "cpu" and args.cpu_allocator_tuning:
        from rapidtrain.cpu_allocator import DESCRIPTION, glibc_version

        if glibc_version():
            engines.append(EngineChoice("CPU allocator", DESCRIPTION, "each step reuses the last step's pages "
                                        "instead of faulting them in again; --no-cpu-allocator-tuning turns it off"))
        else:
            notes.append("CPU allocator: the C library is not glibc, so malloc is left as it is")
    if args.tf32 or ctx.device_type == "cuda":
        engines.append(tf32_choice(args, ctx, precision))
    construction = construction_choice(args, ctx, layout)
    if construction is not None:
        engines.append(construction)
    if args.data_iterator == "dynamic-shape":
        engines.append(EngineChoice("--data-iterator dynamic-shape", "length-bucketed batches padded to the longest "
                                    "(multiple of 8)"))
    if args.cpu_offload and zero_stage(args) > 0 and not three_d:
        from rapidtrain.parallel.deepspeed import describe_offload_optimizer

        engines.append(EngineChoice("optimizer", describe_offload_optimizer(optimizer_settings(args))))
    else:
        engines.append(EngineChoice("optimizer", describe_optimizer(optimizer_settings(args), ctx.device_type)))
    if args.cpu_offload:
        notes.append("--cpu-offload: the optimizer comes from DeepSpeed's config (DeepSpeedCPUAdam), so --optimizers "
                     "selects Adam there")
    return engines, notes


def construction_choice(args: argparse.Namespace, ctx: RunContext, layout: Layout) -> EngineChoice | None:
    switches = switches_of(args, layout, ctx)
    on_meta, why = model_construction(args, ctx, layout, switches.partitioning, switches.partitioning_engine)
    if not why:
        return None
    if not on_meta:
        return EngineChoice("model construction", why)
    if switches.partitioning_engine == "deepspeed":
        return EngineChoice("model construction", "under deepspeed.zero.Init (each parameter partitioned as it is "
                            "created), then initialised one parameter at a time by (seed, name)",
                            f"the layout shards the model ({why}): no rank holds it whole, and the values are the "
                            "one-process ones")
    return EngineChoice("model construction", "on the meta device, split and wrapped first; each rank then "
                        "allocates only its shards and initialises them by (seed, parameter name)",
                        f"the layout shards the model ({why}): no rank holds it whole, and the values are the "
                        "one-process ones")


def tf32_choice(args: argparse.Namespace, ctx: RunContext, precision: Precision) -> EngineChoice:
    """Where --tf32 applies: every fp32 matmul of an fp32 run, only the ones autocast keeps in fp32 otherwise."""
    if ctx.device_type != "cuda":
        return EngineChoice("--tf32", "no effect", "TF32 is a tensor-core format of NVIDIA GPUs (Ampere or newer); "
                            "on a CPU fp32 matmuls stay fp32")
    if not args.tf32:
        return EngineChoice("TF32", "off: fp32 matmuls in full fp32 (PyTorch's default)", "--tf32 runs them on TF32 "
                            "tensor cores (10-bit mantissa; ~8× the fp32 peak on A100/H100, up to 3× on real models)")
    where = "every fp32 matmul" if precision.dtype == "fp32" else \
        f"the matmuls {precision.dtype} autocast keeps in fp32 (the MoE router, any op outside autocast)"
    return EngineChoice("--tf32", f"torch.backends.cuda.matmul.fp32_precision = 'tf32' and cuDNN convolutions in "
                        f"TF32: {where}")


# ---- memory per rank (ZeRO paper accounting) ----

OPTIMIZER_STATE_BYTES = {"apex_adam": 8, "apex_lamb": 8, "adamw": 8, "adam": 8, "adafactor": 0, "sgd": 4}


def memory_estimate(args: argparse.Namespace, model: ModelConfig, layout: Layout,
                    precision: Precision) -> MemoryEstimate:
    from rapidtrain.models.counting import count_parameters, expert_parameter_count

    total, active = count_parameters(model)
    # Experts are sharded over the expert-parallel ranks (and replicated over tensor-parallel ones).
    experts = expert_parameter_count(model)
    per_rank = (total - experts) / layout.tensor_parallel_size / layout.pipeline_parallel_size \
        + experts / layout.expert_parallel_size / layout.pipeline_parallel_size
    stage = zero_stage(args)
    deepspeed = stage > 0 and layout.tensor_parallel_size == layout.pipeline_parallel_size == 1
    half = precision.dtype != "fp32"
    name = args.optimizer or args.optimizers
    # DeepSpeed keeps 16-bit weights and gradients beside fp32 master weights; torch autocast keeps fp32 ones.
    weight, grad = (2, 2) if deepspeed and half else (4, 4)
    if deepspeed and args.cpu_offload:  # ZeRO-Offload keeps the reduced gradient partition in fp32 on the CPU
        grad = 4
    optimizer = OPTIMIZER_STATE_BYTES[name] + (4 if deepspeed and half else 0)
    n = layout.data_parallel_size
    shard_optimizer = stage > 0 or args.oss_memory_optimization or args.oss_sdp_memory_optimization \
        or args.fsdp_memory_optimization
    # In 3D mode ZeRO-1/2 is FSDP2 over the data-parallel dimension, which reduce-scatters gradients (ZeRO-2 memory).
    shard_grads = stage >= 2 or (stage == 1 and not deepspeed) or args.oss_sdp_memory_optimization \
        or args.fsdp_memory_optimization
    shard_params = stage == 3 or args.fsdp_memory_optimization
    return MemoryEstimate(
        parameters=int(per_rank), total_params=total, active_params=active,
        param_bytes=per_rank * weight / (n if shard_params else 1),
        grad_bytes=per_rank * grad / (n if shard_grads else 1),
        optimizer_bytes=per_rank * optimizer / (n if shard_optimizer else 1),
        optimizer_on_cpu=args.cpu_offload,
    )


# ---- printing ----

def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _training_length(t: TrainingSettings) -> str:
    length = f"{t.train_iters} iterations" if t.train_iters else f"{t.epochs or 1} epoch(s)"
    evaluation = f"evaluation every {t.eval_interval} iterations" if t.eval_interval else "evaluation after each epoch"
    return f"{length}, {evaluation}, seed {t.seed}"


def _schedule(s: ScheduleSettings, clip_grad: float) -> str:
    if s.warmup_fraction is not None:
        warmup = f"warm-up {s.warmup_fraction:g} of the decay horizon"
    else:
        warmup = f"warm-up {s.warmup_iters} iterations"
    horizon = f" over {s.decay_iters} iterations" if s.decay_iters else ""
    clipping = f"clip grad {clip_grad:g}" if clip_grad > 0 else "no clipping"
    return f"lr {s.lr:.1E} → min {s.min_lr:.1E}, {s.decay_style} decay{horizon}, {warmup}; {clipping}"


def _data_source(data: DataSettings, tokenizer: TokenizerSettings | None) -> str:
    words = {"demo": "the built-in demo corpus (no --data-path; the demo's small-model defaults apply)",
             "indexed": "Megatron indexed data " + " ".join(data.data_path),
             "finetune": f"fine-tuning set {data.data_dir or ''} {data.data_name or ''}".rstrip(),
             "script": "provided by the user script"}
    text = words[data.source]
    if tokenizer is not None and data.source != "finetune":
        text += f"; tokenizer {tokenizer.tokenizer_type}"
    return text + f"; {data.num_workers} loader workers per rank"


def describe_plan(plan: Plan) -> str:
    lay, bat = plan.layout, plan.batches
    lines = [
        f"rapidtrain plan — template: {plan.template}, task: {plan.task}",
        f"  layout: world {lay.world_size} = data {lay.data_parallel_size} × tensor {lay.tensor_parallel_size} × "
        f"pipeline {lay.pipeline_parallel_size}" + (f", expert parallel {lay.expert_parallel_size}"
                                                    if lay.expert_parallel_size > 1 else ""),
    ]
    if lay.world_size > 1 and (lay.tensor_parallel_size > 1 or lay.pipeline_parallel_size > 1):
        for stage, dp_rows in enumerate(lay.rank_grid()):
            lines.append(f"    pipeline stage {stage}: " + "  ".join(
                f"dp{d}→ranks {row}" for d, row in enumerate(dp_rows)))
    lines += [
        f"  batches: micro {bat.micro_batch_size} × accumulation steps {bat.accumulation_steps} × data parallel "
        f"{lay.data_parallel_size} = global {bat.global_batch_size}",
        "  training length: " + _training_length(plan.training),
        "  data: " + _data_source(plan.data, plan.tokenizer),
        "  schedule: " + _schedule(plan.schedule, plan.clip_grad),
        f"  precision: {plan.precision.dtype}, loss scaling {plan.precision.loss_scaling} ({plan.precision.reason})",
        "  engines:",
    ]
    for choice in plan.engines:
        lines.append(f"    {choice.switch:<30} → {choice.engine}" + (f"\n{'':36}because {choice.reason}"
                                                                        if choice.reason else ""))
    if plan.model:
        m = plan.model
        groups = f" ({m.query_groups} key/value groups)" if m.query_groups != m.num_attention_heads else ""
        lines.append(f"  model: {m.architecture}"
                     + (f" initialised from Hugging Face weights in {m.hf_weights}" if m.hf_weights else "")
                     + f": {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads{groups}, "
                     f"ffn {m.ffn_size}, seq {m.seq_length}, padded vocab {m.vocab_size}"
                     + (f", experts {list(m.num_experts)}" if m.num_experts else ""))
    if plan.memory:
        mem = plan.memory
        lines += [
            f"  parameters: {mem.total_params:,} total, {mem.active_params:,} active per token; "
            f"{mem.parameters:,} per model-parallel rank",
            f"  model-state memory per rank (estimate, ZeRO accounting): parameters {_mib(mem.param_bytes)}, "
            f"gradients {_mib(mem.grad_bytes)}, optimizer {_mib(mem.optimizer_bytes)}"
            + (" (on CPU)" if mem.optimizer_on_cpu else "") + f"; total {_mib(mem.total_bytes)}",
        ]
    ck = plan.checkpoint
    if ck.save or ck.load:
        lines.append("  checkpoints: " + "; ".join(
            ([f"save to {ck.save}" + (f" every {ck.save_interval} iterations" if ck.save_interval else "")]
             if ck.save else [])
            + ([f"load from {ck.load}" + (" (model only, --finetune)" if ck.finetune else "")] if ck.load else [])))
    lines.append(f"  distributed: process-group backend {_backends(plan.distributed.backend)}, collectives time "
                 f"out after {plan.distributed.timeout_minutes:g} minutes (--distributed-timeout-minutes)")
    lines.append("  MFU: " + (f"against {plan.logging.peak_tflops:g} TFLOP/s per device ({plan.logging.peak_source})"
                              if plan.logging.peak_tflops else f"not reported: {plan.logging.peak_source}"))
    lines += [f"  note: {n}" for n in plan.notes]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _backends(backend: str) -> str:
    if "," not in backend:
        return backend
    parts = dict(part.split(":") for part in backend.split(","))
    return ", ".join(f"{kind} tensors → {name}" for kind, name in parts.items()) + f" ({backend})"
