"""The plan: what the flags resolve to, before anything starts.

Pure and frozen: layout, batch arithmetic, precision, the engine behind each switch (with the reason
when a substitute serves) and an estimate of model-state bytes per rank. `rapidtrain plan` prints it,
and every run logs it first. Batch arithmetic and precision resolution live here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rapidtrain.models.config import ModelConfig

if TYPE_CHECKING:
    from rapidtrain.optim.optimizers import OptimizerSettings
    from rapidtrain.tasks.lora import LoraSettings

DeviceType = Literal["cpu", "cuda"]
Dtype = Literal["fp32", "bf16", "fp16"]
OffloadTarget = Literal["none", "cpu", "nvme"]

FINETUNE_TASKS = ("sequence_classification", "token_classification", "question_answering", "masked_lm",
                  "casual_lm", "seq2seq_lm")


@dataclass(frozen=True)
class RunContext:
    """What the flags alone do not say: how many processes and on which device type."""

    world_size: int = 1
    device_type: DeviceType = "cpu"

    @staticmethod
    def detect(args: argparse.Namespace | None = None) -> RunContext:
        import torch

        device_type: DeviceType = "cuda" if torch.cuda.is_available() else "cpu"
        if "WORLD_SIZE" in os.environ:
            return RunContext(int(os.environ["WORLD_SIZE"]), device_type)
        per_node = getattr(args, "nproc_per_node", None) or default_nproc_per_node(device_type)
        return RunContext(per_node * int(os.environ.get("NNODES", "1")), device_type)


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


def precision_of(args: argparse.Namespace, device_type: DeviceType) -> Precision:
    if args.bf16:
        return Precision("bf16", "none", "--bf16: bf16 autocast, fp32 master weights, no loss scaling")
    if args.fp16:
        return Precision("fp16", _loss_scaling(args), "--fp16: fp16 autocast with loss scaling, fp32 master weights")
    if args.mixed_precision:
        if device_type == "cuda":
            return Precision("fp16", _loss_scaling(args), "--mixed-precision: fp16 autocast with dynamic loss scaling")
        return Precision("bf16", "none", "--mixed-precision on CPU resolves to bf16: fp16 is not supported there "
                         "(DeepSpeed refuses it, CPU fp16 kernels are slow); bf16 needs no loss scaling")
    return Precision("fp32", "none", "no precision flag: fp32")


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
    compile: Literal["none", "inductor", "ortmodule"] = "none"  # "inductor": torch.compile, with the backend below
    dynamic_shape: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend (--torch-compile-backend)
    compile_mode: str | None = None  # torch.compile's mode (--torch-compile-mode); None is torch's "default"


@dataclass(frozen=True)
class ZeroSettings:
    """DeepSpeed ZeRO's own part of the plan: communication overlap and bucket sizes (elements), stage-3
    prefetching and persistence, where optimizer state and parameters are offloaded (ZeRO-Offload, ZeRO-Infinity),
    pinned host buffers, and the threads DeepSpeedCPUAdam steps with (None where it does not run)."""

    stage: int
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    offload_optimizer: OffloadTarget = "none"
    offload_params: OffloadTarget = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    cpu_adam_threads: int | None = None


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
    params_offloaded: OffloadTarget = "none"  # ZeRO-3 parameter partitions in host memory or on NVMe

    @property
    def total_bytes(self) -> float:
        params = 0 if self.params_offloaded != "none" else self.param_bytes
        return params + self.grad_bytes + (0 if self.optimizer_on_cpu else self.optimizer_bytes)


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
    train_iters: int | None = None
    epochs: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    optimizer: OptimizerSettings | None = None  # what builds the optimizer (its implementation follows the layout)
    lora: LoraSettings | None = None  # adapters and k-bit base of a Hugging Face fine-tune (None: not one)
    zero: ZeroSettings | None = None  # DeepSpeed ZeRO's settings (None: DeepSpeed does not serve this layout)

    @property
    def state_partitioning(self) -> str:
        for choice in self.engines:
            if choice.switch.endswith("-memory-optimization"):
                return choice.switch
        return "none"

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
    )


def template_of(args: argparse.Namespace) -> str:
    if args.user_script:
        return f"user script {args.user_script}"
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


def from_args(args: argparse.Namespace, ctx: RunContext, vocab_size: int | None = None) -> Plan:
    """Resolve validated flags into a Plan. `vocab_size` is the padded vocabulary of the built-in model."""
    layout = layout_of(args, ctx)
    batches = Batches.resolve(args.micro_batch_size, args.global_batch_size, layout.data_parallel_size)
    precision = precision_of(args, ctx.device_type)
    builtin = not args.pretrained_model_name_or_path
    model = model_config_from_args(args, vocab_size) if builtin and vocab_size else None
    switches = switches_of(args, layout)
    optimizer = optimizer_settings(args, layout, switches)
    engines, notes = engines_for(args, ctx, layout, precision)
    memory = memory_estimate(args, model, layout, precision, ctx.device_type) if model else None
    return Plan(template_of(args), args.task, layout, batches, precision, tuple(engines), memory, model,
                switches, args.train_iters, args.epochs, tuple(notes), optimizer, lora_settings(args),
                zero_settings(args, layout, ctx))


PARTITIONING_NAMES = {
    "oss_memory_optimization": "oss", "oss_sdp_memory_optimization": "sdp", "fsdp_memory_optimization": "fsdp",
    "zero_1_memory_optimization": "zero-1", "zero_2_memory_optimization": "zero-2",
    "zero_3_memory_optimization": "zero-3",
}


def switches_of(args: argparse.Namespace, layout: Layout) -> Switches:
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
                    args.data_iterator == "dynamic-shape", args.torch_compile_backend, args.torch_compile_mode)


def parameters_are_dtensors(layout: Layout, switches: Switches) -> bool:
    """Whether the optimizer receives DTensor parameters: tensor parallelism, FSDP2 (FSDP, SDP, ZeRO-1/2 with
    TP/PP) and composable `replicate` (data parallel beside pipeline stages) make them; one process, DDP,
    ZeroRedundancyOptimizer, FairScale and DeepSpeed hand over plain tensors."""
    if layout.tensor_parallel_size > 1:
        return True
    sharded_or_replicated = switches.partitioning_engine == "fsdp2" or layout.pipeline_parallel_size > 1
    return layout.data_parallel_size > 1 and sharded_or_replicated


def optimizer_settings(args: argparse.Namespace, layout: Layout | None = None, switches: Switches | None = None):
    """The optimizer's own settings; `--optimizer` (beyond Rapidformer) overrides `--optimizers`. With the
    layout, they say whether the parameters are DTensors (the implementation is chosen from that)."""
    from rapidtrain.optim.optimizers import OptimizerSettings

    name = args.optimizer or args.optimizers
    if name == "adam":  # Megatron's --optimizer adam is Adam with decoupled weight decay, i.e. AdamW
        name = "adamw"
    dtensors = layout is not None and switches is not None and parameters_are_dtensors(layout, switches)
    return OptimizerSettings(name=name, lr=args.lr or 0.0, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             sgd_momentum=args.sgd_momentum, dtensor_parameters=dtensors)


def uses_deepspeed(args: argparse.Namespace, layout: Layout) -> bool:
    """ZeRO switches are served by DeepSpeed unless tensor/pipeline parallelism asks for FSDP2 instead."""
    return zero_stage(args) > 0 and layout.tensor_parallel_size == layout.pipeline_parallel_size == 1


def cores_per_rank(local_ranks: int) -> int:
    """This machine's usable cores shared among the node's ranks (at least one each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores // max(local_ranks, 1), 1)


def cpu_adam_threads(ctx: RunContext) -> int:
    """DeepSpeedCPUAdam's OpenMP threads: an explicit OMP_NUM_THREADS other than torchrun's default of 1, else
    the cores per rank (torchrun sets 1, which would leave the offloaded optimizer step on one core)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 1:
        return int(given)
    nodes = int(os.environ.get("NNODES", "1"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", max(ctx.world_size // max(nodes, 1), 1)))
    return cores_per_rank(local_ranks)


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
    )


def _threads(count: int) -> str:
    return f"{count} OpenMP thread" + ("s" if count != 1 else "")


def describe_zero(zero: ZeroSettings) -> str:
    parts = [f"overlap_comm {zero.overlap_comm}", f"contiguous gradients {zero.contiguous_gradients}",
             f"reduce bucket {zero.reduce_bucket_size:,}"]
    if zero.stage == 3:
        parts += [f"prefetch bucket {zero.stage3_prefetch_bucket_size:,}",
                  f"parameters under {zero.stage3_param_persistence_threshold:,} elements stay gathered",
                  f"at most {zero.stage3_max_live_parameters:,} live parameters"]
    else:
        parts.append(f"allgather bucket {zero.allgather_bucket_size:,}")
    return "DeepSpeed ZeRO: " + ", ".join(parts) + " (bucket sizes in elements)"


def load_in_bits(args: argparse.Namespace) -> int | None:
    return 4 if args.load_in_4bit else 8 if args.load_in_8bit else None


def lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    """The adapters' and k-bit base's settings of a Hugging Face fine-tune (None for the built-in models)."""
    if not args.pretrained_model_name_or_path:
        return None
    from rapidtrain.tasks.lora import LoraSettings

    return LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                        target_modules=tuple(args.lora_target_modules or ()), load_in_bits=load_in_bits(args))


def lr_schedule_settings(args: argparse.Namespace, global_batch_size: int, train_iters: int):
    """The schedule's own settings, in samples (Megatron semantics)."""
    from rapidtrain.optim.lr_schedule import lr_schedule_from_iters

    return lr_schedule_from_iters(
        lr=args.lr, min_lr=args.min_lr, style=args.lr_decay_style, train_iters=train_iters,
        lr_decay_iters=args.lr_decay_iters, lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_fraction=args.lr_warmup_fraction, global_batch_size=global_batch_size,
        lr_wsd_decay_iters=args.lr_wsd_decay_iters)


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


def describe_compile(args: argparse.Namespace) -> str:
    return f"torch.compile(backend={args.torch_compile_backend!r}, mode={args.torch_compile_mode or 'default'!r})"


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
    zero = zero_settings(args, layout, ctx)
    if zero is not None:
        engines.append(EngineChoice("ZeRO communication", describe_zero(zero)))
    pinned = "pinned host buffers" if zero is not None and zero.pin_memory else "no pinned buffers (CPU run)"
    if args.cpu_offload:
        threads = f", {_threads(zero.cpu_adam_threads)} per rank" if zero and zero.cpu_adam_threads else ""
        engines.append(EngineChoice("--cpu-offload", f"DeepSpeed offload_optimizer: cpu with DeepSpeedCPUAdam{threads}"
                                    f", {pinned}", "DeepSpeedCPUAdam steps with the cores per rank (or "
                                    "OMP_NUM_THREADS when set above 1), not torchrun's single thread"))
    if args.cpu_offload_params:
        engines.append(EngineChoice("--cpu-offload-params", f"DeepSpeed ZeRO-3 offload_param: cpu, {pinned}",
                                    "each rank's parameter partition lives in host memory and is gathered to the "
                                    "device layer by layer"))
    if args.nvme_offload_dir:
        threads = f", DeepSpeedCPUAdam on {_threads(zero.cpu_adam_threads)}" if zero and zero.cpu_adam_threads else ""
        engines.append(EngineChoice("--nvme-offload-dir", "DeepSpeed ZeRO-Infinity: offload_optimizer and "
                                    f"offload_param to nvme at {args.nvme_offload_dir} (async_io){threads}, {pinned}",
                                    "parameter shards of at least DeepSpeed's 1 MiB I/O block are swapped to files; "
                                    "smaller ones stay in host memory"))
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
        engines.append(EngineChoice("precision", engine, precision.reason))
    if args.checkpoint_activations:
        engines.append(EngineChoice("--checkpoint-activations", "torch.utils.checkpoint per transformer layer"
                                    if not args.pretrained_model_name_or_path
                                    else "Hugging Face gradient_checkpointing_enable()"))
    if args.onnx_runtime_training:
        usable, why = _ort_status()
        engines.append(EngineChoice("--onnx-runtime-training", "onnxruntime ORTModule" if usable
                                    else f"{describe_compile(args)} as the graph optimiser", why))
    lora = lora_settings(args)
    if lora is not None and lora.load_in_bits:
        from rapidtrain.tasks.lora import describe_quantization

        engines.append(EngineChoice(f"--load-in-{lora.load_in_bits}bit",
                                    describe_quantization(lora.load_in_bits, precision.dtype)))
    if lora is not None and lora.rank > 0:
        engines.append(EngineChoice("--lora-rank", lora.describe()))
    if args.torch_compile:
        engines.append(EngineChoice("--torch-compile", f"{describe_compile(args)} per transformer layer"))
    if ctx.device_type == "cpu" and args.cpu_allocator_tuning:
        from rapidtrain.cpu_allocator import DESCRIPTION, glibc_version

        if glibc_version():
            engines.append(EngineChoice("CPU allocator", DESCRIPTION, "each step reuses the last step's pages "
                                        "instead of faulting them in again; --no-cpu-allocator-tuning turns it off"))
        else:
            notes.append("CPU allocator: the C library is not glibc, so malloc is left as it is")
    if args.data_iterator == "dynamic-shape":
        engines.append(EngineChoice("--data-iterator dynamic-shape", "length-bucketed batches padded to the longest "
                                    "(multiple of 8)"))
    if (args.cpu_offload or args.nvme_offload_dir) and zero_stage(args) > 0 and not three_d:
        from rapidtrain.parallel.deepspeed import describe_offload_optimizer

        engines.append(EngineChoice("optimizer", describe_offload_optimizer(optimizer_settings(args))))
    else:
        settings = optimizer_settings(args, layout, switches_of(args, layout))
        engines.append(EngineChoice("optimizer", describe_optimizer(settings, ctx.device_type),
                                    "the layout's parameters are " + ("DTensors (tensor parallel / FSDP2 / "
                                    "replicate)" if settings.dtensor_parameters else "plain tensors")))
    if args.cpu_offload:
        notes.append("--cpu-offload: the optimizer comes from DeepSpeed's config (DeepSpeedCPUAdam), so --optimizers "
                     "selects Adam there")
    return engines, notes


# ---- memory per rank (ZeRO paper accounting) ----

def optimizer_state_bytes_per_parameter(model: ModelConfig, settings: OptimizerSettings, device_type: str) -> float:
    """The chosen implementation's state per parameter, from the model's real tensor shapes (Adafactor's
    factored rows and columns, 8-bit blocks and the small tensors they leave in fp32)."""
    import torch

    from rapidtrain.models import build_model
    from rapidtrain.optim.optimizers import resolve_optimizer
    from rapidtrain.optim.state_bytes import optimizer_state_bytes

    with torch.device("meta"):  # shapes only: nothing is allocated or initialised
        shapes = [tuple(p.shape) for p in build_model(model, seed=None).parameters()]
    total = sum(math.prod(shape) for shape in shapes)
    return optimizer_state_bytes(resolve_optimizer(settings, device_type).state, shapes) / max(total, 1)


def memory_estimate(args: argparse.Namespace, model: ModelConfig, layout: Layout,
                    precision: Precision, device_type: str = "cpu") -> MemoryEstimate:
    from rapidtrain.models.counting import count_parameters, expert_parameter_count

    total, active = count_parameters(model)
    # Experts are sharded over the expert-parallel ranks (and replicated over tensor-parallel ones).
    experts = expert_parameter_count(model)
    per_rank = (total - experts) / layout.tensor_parallel_size / layout.pipeline_parallel_size \
        + experts / layout.expert_parallel_size / layout.pipeline_parallel_size
    stage = zero_stage(args)
    deepspeed = stage > 0 and layout.tensor_parallel_size == layout.pipeline_parallel_size == 1
    half = precision.dtype != "fp32"
    # DeepSpeed keeps 16-bit weights and gradients beside fp32 master weights; torch autocast keeps fp32 ones.
    weight, grad = (2, 2) if deepspeed and half else (4, 4)
    if deepspeed and (args.cpu_offload or args.nvme_offload_dir):  # the reduced fp32 gradient partition is on the CPU
        grad = 4
        state = 8.0  # DeepSpeedCPUAdam: fp32 moments
    else:
        settings = optimizer_settings(args, layout, switches_of(args, layout))
        state = optimizer_state_bytes_per_parameter(model, settings, device_type)
    optimizer = state + (4 if deepspeed and half else 0)
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
        optimizer_on_cpu=bool(args.cpu_offload or args.nvme_offload_dir),
        params_offloaded="nvme" if args.nvme_offload_dir else "cpu" if args.cpu_offload_params else "none",
    )


# ---- printing ----

def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


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
        "  training length: " + (f"{plan.train_iters} iterations" if plan.train_iters else f"{plan.epochs} epochs"),
        f"  precision: {plan.precision.dtype}, loss scaling {plan.precision.loss_scaling} ({plan.precision.reason})",
        "  engines:",
    ]
    for choice in plan.engines:
        lines.append(f"    {choice.switch:<30} → {choice.engine}" + (f"\n{'':36}because {choice.reason}"
                                                                        if choice.reason else ""))
    if plan.model:
        m = plan.model
        lines.append(f"  model: {m.model_type} {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
                     f"heads, seq {m.seq_length}, padded vocab {m.vocab_size}"
                     + (f", experts {list(m.num_experts)}" if m.num_experts else ""))
    if plan.memory:
        mem = plan.memory
        lines += [
            f"  parameters: {mem.total_params:,} total, {mem.active_params:,} active per token; "
            f"{mem.parameters:,} per model-parallel rank",
            f"  model-state memory per rank (estimate, ZeRO accounting): parameters {_mib(mem.param_bytes)}"
            + (f" (offloaded to {mem.params_offloaded})" if mem.params_offloaded != "none" else "") + ", "
            f"gradients {_mib(mem.grad_bytes)}, optimizer {_mib(mem.optimizer_bytes)}"
            + (" (on CPU)" if mem.optimizer_on_cpu else "") + f"; total {_mib(mem.total_bytes)}",
        ]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
