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
from typing import TYPE_CHECKING, Any, Literal

from rapidtrain.config.partitioning import PARTITIONING_SWITCHES, chosen_partitioning, zero_stage
from rapidtrain.data.tokenizer import TokenizerSettings
from rapidtrain.models.attention_backends import KERNEL_OF_NAME, AttentionSettings
from rapidtrain.models.attention_backends import resolve as resolve_attention
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.hf_config import initialises_builtin, is_megatron_checkpoint, trains_builtin_model

if TYPE_CHECKING:
    from rapidtrain.optim.grad_scaler import LossScaleSettings
    from rapidtrain.optim.optimizers import OptimizerSettings

if TYPE_CHECKING:
    from rapidtrain.models.lora import LoraSettings
    from rapidtrain.optim.optimizers import OptimizerSettings

DeviceType = Literal["cpu", "cuda"]
Dtype = Literal["fp32", "bf16", "fp16"]
OffloadTarget = Literal["none", "cpu", "nvme"]

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
        from rapidtrain.core.slurm import node_layout

        per_node = getattr(args, "nproc_per_node", None) or default_nproc_per_node(device_type)
        return RunContext(per_node * node_layout(os.environ).nnodes, device_type, script, capability)


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
    if len(num_experts) == num_layers or num_layers % len(num_experts):
        return tuple(num_experts)
    # Fewer counts than layers (DeepSpeed's and Rapidformer's pyramid, e.g. 12 counts for 24 layers): one per MoE
    # layer, MoE layers every num_layers / counts layers.
    interval, counts = num_layers // len(num_experts), iter(num_experts)
    return tuple(next(counts) if i % interval == interval - 1 else 0 for i in range(num_layers))


def zero_by_fsdp2(args: argparse.Namespace) -> bool:
    """ZeRO-1/2 served by FSDP2 over the data-parallel dimension instead of DeepSpeed: DeepSpeed's engine can
    neither wrap tensor-parallel DTensors or pipeline stages, nor reduce expert slices that differ from one
    expert-parallel rank to the next over their own group."""
    return (args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1
            or args.expert_model_parallel_size > 1)


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
class BatchSchedule:
    """A global batch that changes with the samples consumed (Megatron's two forms).

    `rampup` (--rampup-batch-size START INCREMENT SAMPLES): START, growing by INCREMENT in equal steps over
    the first SAMPLES samples up to --global-batch-size. `steps` (--step-batch-size-schedule): the batch of
    the last threshold (in samples) reached. Iterations keep --micro-batch-size; the accumulation steps change.
    """

    kind: Literal["rampup", "steps"]
    start: int = 0
    increment: int = 0
    rampup_samples: int = 0
    steps: tuple[tuple[int, int], ...] = ()  # (threshold in samples, global batch), thresholds ascending from 0

    def global_batch_at(self, consumed_samples: int, final: int) -> int:
        if self.kind == "steps":
            return [size for threshold, size in self.steps if consumed_samples >= threshold][-1]
        if consumed_samples > self.rampup_samples or final == self.start:
            return final
        # Megatron's RampupBatchsizeNumMicroBatches: increments spread evenly over the ramp-up samples.
        per_increment = self.rampup_samples / ((final - self.start) // self.increment)
        return self.start + int(consumed_samples / per_increment) * self.increment

    def sizes(self, final: int) -> list[int]:
        """Every global batch the schedule can use."""
        if self.kind == "steps":
            return [size for _, size in self.steps]
        return list(range(self.start, final + 1, self.increment)) if self.increment > 0 else [final]

    def describe(self, final: int) -> str:
        if self.kind == "steps":
            return "global batch by samples consumed: " + ", ".join(
                f"{size} from {threshold:,}" for threshold, size in self.steps)
        return (f"global batch ramps from {self.start} by {self.increment} over the first {self.rampup_samples:,} "
                f"samples to {final} (--rampup-batch-size)")


@dataclass(frozen=True)
class Batches:
    micro_batch_size: int
    global_batch_size: int  # the final (largest) one with a batch schedule
    accumulation_steps: int
    schedule: BatchSchedule | None = None
    data_parallel_size: int = 1
    micro_batch_choice: str | None = None  # how --auto-micro-batch-size chose the micro batch (None: given)

    @staticmethod
    def resolve(micro: int, global_batch: int | None, data_parallel: int,
                schedule: BatchSchedule | None = None) -> Batches:
        global_batch = global_batch or micro * data_parallel
        if schedule is not None and schedule.kind == "steps":
            global_batch = max(schedule.sizes(global_batch))  # Megatron: the schedule's largest batch
        return Batches(micro, global_batch, global_batch // (micro * data_parallel), schedule, data_parallel)

    def global_batch_at(self, consumed_samples: int) -> int:
        if self.schedule is None:
            return self.global_batch_size
        return self.schedule.global_batch_at(consumed_samples, self.global_batch_size)

    def accumulation_steps_at(self, consumed_samples: int) -> int:
        """Micro-batches of the iteration that starts after `consumed_samples` samples."""
        return self.global_batch_at(consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    def iterations_for_samples(self, samples: int) -> int:
        """Iterations of a run of `samples` samples (Megatron's update_train_iters): while the batch still
        changes every iteration counts; then whole final batches, a last partial one dropped."""
        if self.schedule is None:
            return samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= samples and not self._constant_from(consumed):
            consumed += self.global_batch_at(consumed)
            iterations += 1
        return iterations + max(samples - consumed, 0) // self.global_batch_at(consumed)

    def samples_for_iterations(self, iterations: int) -> int:
        """Samples that `iterations` iterations consume from the start."""
        consumed = 0
        for done in range(iterations):
            if self._constant_from(consumed):
                return consumed + (iterations - done) * self.global_batch_at(consumed)
            consumed += self.global_batch_at(consumed)
        return consumed

    def _constant_from(self, consumed_samples: int) -> bool:
        """The batch no longer changes after `consumed_samples` samples."""
        schedule = self.schedule
        if schedule is None:
            return True
        if schedule.kind == "steps":
            return consumed_samples >= schedule.steps[-1][0]
        return consumed_samples > schedule.rampup_samples


Partitioning = Literal["none", "oss", "sdp", "fsdp", "zero-1", "zero-2", "zero-3"]
PartitioningEngine = Literal["ddp", "zero-redundancy", "fsdp2", "deepspeed", "fairscale"]
CompileWith = Literal["none", "inductor", "ortmodule"]  # "inductor": torch.compile, with Switches.compile_backend


@dataclass(frozen=True)
class RecomputeSettings:
    """What is recomputed in backward (--recompute-granularity, --recompute-method, --recompute-num-layers and
    their Megatron aliases; applied by parallel/recompute.py).

    `granularity`: full = the whole layer (only its input is kept); selective = Megatron's core attention
    (scaled_dot_product_attention / flex_attention calls: their inputs are kept, their outputs recomputed); op =
    the whole layer under a policy that keeps the outputs of matmuls, attention kernels, collectives and random
    ops and recomputes the rest (norms, activations, element-wise ops). `method`: uniform = every layer (in
    units of one layer), block = only the first `num_layers` layers of each pipeline stage."""

    granularity: Literal["none", "full", "selective", "op"] = "none"
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = 1

    @property
    def enabled(self) -> bool:
        return self.granularity != "none"

    def layers_of(self, count: int) -> range:
        """Which of a stage's `count` layers are recomputed."""
        return range(min(self.num_layers, count)) if self.method == "block" else range(count)

    def describe(self) -> str:
        what = {"none": "nothing",
                "full": "whole transformer layers (torch.utils.checkpoint; only each layer's input is kept)",
                "selective": "the attention core only (scaled_dot_product_attention / flex_attention calls under "
                             "torch.utils.checkpoint; Megatron's selective recompute)",
                "op": "each layer at op level (create_selective_checkpoint_contexts: outputs of matmuls, attention "
                      "kernels, collectives and random ops kept; norms, activations and element-wise ops "
                      "recomputed)"}[self.granularity]
        which = (f"the first {self.num_layers} layer(s) of each pipeline stage" if self.method == "block"
                 else "every layer")
        return f"{what}, in {which}"


@dataclass(frozen=True)
class Switches:
    """The structured decisions the Engine acts on (the engines list says them in words)."""

    partitioning: Partitioning = "none"
    partitioning_engine: PartitioningEngine = "ddp"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    compile: CompileWith = "none"  # "inductor": torch.compile, with the backend below
    dynamic_shape: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend (--torch-compile-backend)
    compile_mode: str | None = None  # torch.compile's mode (--torch-compile-mode); None is torch's "default"

    deepspeed_config_file: str | None = None  # --deepspeed_config: merged into DeepSpeed's generated config

    tf32: bool = False  # TF32 tensor cores for fp32 matmuls (--tf32 on CUDA; no effect on a CPU)
    build_on_meta: bool = False  # the built-in model is created on meta and each rank materializes its shards
    cpu_allocator_tuning: bool = False  # glibc keeps freed memory on a CPU run (--no-cpu-allocator-tuning: off)
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)  # what backward recomputes


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


def read_user_config(path: str) -> dict[str, Any]:
    """The JSON object of --deepspeed_config FILE (plain data: nothing in it runs); ValueError names the file."""
    import json
    from pathlib import Path

    try:
        config = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"--deepspeed_config {path}: cannot read it ({error.strerror or error}). Give the path "
                         "of a DeepSpeed JSON config.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({error}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed_config {path}: a DeepSpeed config is a JSON object, not "
                         f"{type(config).__name__}.")
    return config


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
    # SIGTERM: "save" (with --save: a checkpoint at the end of the iteration, exit 0), "stop" (no --save but
    # --exit-signal-handler: end cleanly at the end of the iteration, exit 0), "default" (the process ends
    # at once, as in Megatron without --exit-signal-handler).
    on_sigterm: Literal["save", "stop", "default"] = "default"
    train_samples: int | None = None  # sample-based training (--train-samples); train_iters then follows from it


ScheduleFrom = Literal["same", "flags", "checkpoint"]


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
    schedule_from: ScheduleFrom = "same"
    async_save: bool = False  # --async-save: written in the background, published once every rank finished
    # --load came from --pretrained-model-name-or-path (a Megatron-format checkpoint, Rapidformer's meaning): a
    # fine-tuning template takes its model only, unless it is the run's own --save folder (a resume).
    load_is_pretrained_model: bool = False
    # --pretrained-model-name-or-path: the folder a Hugging Face fine-tune takes its model and tokenizer from.
    pretrained_model: str | None = None
    # The flags as JSON values, recorded in each checkpoint beside the plan (Megatron's checkpoints carry their
    # args; Megatron-format loading and generation read the model's shape back from them).
    flags: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoggingSettings:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    peak_tflops: float | None = None  # per device, what MFU is measured against (None: no MFU in the log)
    loss_log_file: str | None = None
    tracking: TrackingSettings | None = None  # W&B and MLflow beside TensorBoard; None: neither

    # Megatron's TensorBoard switches and extra log-line fields.
    tensorboard_queue_size: int = 1000
    timers_to_tensorboard: bool = False
    batch_size_to_tensorboard: bool = False
    validation_ppl_to_tensorboard: bool = False
    memory_to_tensorboard: bool = False
    world_size_to_tensorboard: bool = False
    learning_rate_to_tensorboard: bool = True
    loss_scale_to_tensorboard: bool = True
    params_norm: bool = False
    logging_path: str | None = None  # Rapidformer: a file that receives what the logging ranks print

    peak_source: str = ""  # where the peak comes from (--peak-tflops, the known GPU's datasheet), or why none


@dataclass(frozen=True)
class TrackingSettings:
    """Experiment trackers fed the log line's scalars, with the plan as the run's config. A tracker is on when
    its project (W&B) or experiment (MLflow) is named."""

    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None  # resolved: --wandb-save-dir, else SAVE/wandb, else None (W&B's ./wandb)
    mlflow_experiment: str | None = None
    mlflow_tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else MLflow's default
    mlflow_run_name: str | None = None


@dataclass(frozen=True)
class ProfileSettings:
    """--profile: the PyTorch profiler over steps [step_start, step_end) (iterations completed before each step,
    counted from 0 as Megatron does) on `ranks`, traces written to `trace_dir`."""

    enabled: bool = False
    step_start: int = 10
    step_end: int = 12
    ranks: tuple[int, ...] = (0,)
    trace_dir: str = "profile"


@dataclass(frozen=True)
class DistributedSettings:
    """How the processes talk: the process-group backend per device type and the collectives' timeout.

    On CUDA the default group is "cpu:gloo,cuda:nccl" (as torchtitan's): NCCL carries device tensors, gloo the
    host ones (token counts), so no collective can meet a tensor on a device type without a backend."""

    backend: str = "gloo"
    timeout_minutes: float = 10.0


DataSource = Literal["demo", "indexed", "finetune", "script"]


@dataclass(frozen=True)
class DataSettings:
    """Where samples come from and how they are batched and shared out.

    `source`: "demo" (the built-in corpus: pretraining with no --data-path), "indexed" (Megatron .bin/.idx
    from --data-path), "finetune" (--data-dir/--data-name) or "script" (a user script brings its own).
    """

    source: DataSource
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
    # Megatron's separate splits (--train-data-path ...): indexed data per split instead of --split of --data-path.
    split_paths: tuple[tuple[str, ...] | None, ...] | None = None
    keep_last: bool = False  # fine-tuning: keep an epoch's last, incomplete micro-batch
    mmap_warmup: bool = False
    # casual_lm fine-tuning: each micro-batch is one row of its sequences back to back (--padding-free).
    padding_free: bool = False


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
    # Sample-based training (--train-samples): the horizon, warm-up and WSD phase in samples.
    decay_samples: int | None = None
    warmup_samples: int = 0
    wsd_decay_samples: int | None = None


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
    optimizer: OptimizerSettings | None = None  # what builds the optimizer (its implementation follows the layout)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    loss_scale: LossScaleSettings | None = None
    clip_grad: float = 1.0
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    notes: tuple[str, ...] = field(default_factory=tuple)
    lora: LoraSettings | None = None  # adapters and k-bit base of a Hugging Face fine-tune (None: not one)
    zero: ZeroSettings | None = None  # DeepSpeed ZeRO's settings (None: DeepSpeed does not serve this layout)
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    warnings: tuple[str, ...] = field(default_factory=tuple)  # printed when a run starts, before anything is built
    attention: AttentionSettings = field(default_factory=AttentionSettings)  # --attention-backend's kernel

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
        moe_residual=args.mlp_type == "residual",
        attention_kernel=KERNEL_OF_NAME[getattr(args, "attention_backend", "auto")],
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
    precision = precision_of(args, ctx)
    tokenizer = tokenizer_settings_of(args)
    vocab_size = builtin_vocab_size(args, tokenizer)
    model = model_config_from_args(args, vocab_size) if vocab_size else None
    switches = switches_of(args, layout, ctx)
    memory = memory_estimate(args, model, layout, precision, ctx, switches) if model else None
    # The micro batch is chosen before the batch arithmetic, which every later setting follows.
    micro, choice, global_batch = args.micro_batch_size, None, args.global_batch_size
    if args.auto_micro_batch_size and model and memory and args.memory_budget_gb:
        micro, choice = auto_micro_batch_size(args, layout, model, precision, memory, switches.recompute)
        # Without --global-batch-size the flags mean --micro-batch-size × data parallel: keep that batch.
        global_batch = global_batch or args.micro_batch_size * layout.data_parallel_size
    batches = dataclasses.replace(Batches.resolve(micro, global_batch, layout.data_parallel_size,
                                                  batch_schedule_of(args)), micro_batch_choice=choice)
    engines, notes = engines_for(args, ctx, layout, precision, switches, model)
    notes += getattr(args, "compat_notes", [])  # Megatron's and Rapidformer's meanings applied to these flags
    from rapidtrain.config.meanings import hugging_face_notes

    notes += hugging_face_notes(args, has_script=bool(ctx.script))
    if args.padding_free and ctx.script:
        notes.append("--padding-free: rapidtrain's casual_lm task packs its own micro-batches; a user script's "
                     "collate_fn decides how its batches are built (rapidtrain.tasks.base.FlattenCollator packs "
                     "them the same way)")
    warnings = precision_warnings(args, ctx, precision) + size_multiple_warnings(model, batches, precision, ctx)
    return Plan(template_of(args, ctx), args.task, layout, batches, precision, tuple(engines), memory, model,
                switches, training_settings(args, batches),
                dataclasses.replace(data_settings(args, ctx), micro_batch_size=batches.micro_batch_size), tokenizer,
                optimizer_settings(args, layout, switches), schedule_settings(args), loss_scale_settings(args),
                args.clip_grad, checkpoint_settings(args, vocab_size),
                logging_settings(args, ctx, precision, switches.tf32), tuple(notes),
                lora_settings(args), zero_settings(args, layout, ctx), profile_settings(args),
                distributed_settings(args, ctx), tuple(warnings),
                attention_settings(args))


def attention_settings(args: argparse.Namespace) -> AttentionSettings:
    return resolve_attention(getattr(args, "attention_backend", "auto"), args.reset_attention_mask)



def activation_bytes_per_sample(model: ModelConfig, precision: Precision, recompute: RecomputeSettings) -> int:
    """Estimated activation bytes one sample keeps for backward on one rank: per layer ~17 activations of s × h
    elements (Korthikanti et al.'s 34·s·h bytes at 16 bits, with fused attention that keeps no s × s scores;
    op-level recompute keeps ~11 of them, full recompute the layer input), plus the loss's log-softmax."""
    element = 4 if precision.dtype == "fp32" else 2
    s, h = model.seq_length, model.hidden_size
    per_layer = {"none": 17, "selective": 16, "op": 11, "full": 1}[recompute.granularity] * s * h * element
    recomputed = len(recompute.layers_of(model.num_layers))
    layers = recomputed * per_layer + (model.num_layers - recomputed) * 17 * s * h * element
    return layers + s * model.vocab_size * 4  # the fp32 log-softmax the loss keeps (measured: ~1.2× this)


def auto_micro_batch_size(args: argparse.Namespace, layout: Layout, model: ModelConfig, precision: Precision,
                          memory: MemoryEstimate, recompute: RecomputeSettings) -> tuple[int, str]:
    """The largest micro batch (at most --micro-batch-size) dividing global / data-parallel that fits the budget
    (--memory-budget-gb) as model state + micro × per-sample activations, and the arithmetic in words; 1 when none
    fits (the rules refuse that case)."""
    per_rank = (args.global_batch_size or args.micro_batch_size * layout.data_parallel_size) \
        // layout.data_parallel_size
    budget = args.memory_budget_gb * 2**30
    per_sample = activation_bytes_per_sample(model, precision, recompute)
    fitting = [m for m in range(min(args.micro_batch_size, per_rank), 0, -1)
               if per_rank % m == 0 and memory.total_bytes + m * per_sample <= budget]
    micro = fitting[0] if fitting else 1
    return micro, (f"--auto-micro-batch-size: {micro}, the largest divisor of {per_rank} (global / data parallel) "
                   f"up to --micro-batch-size {args.micro_batch_size} with model state {_mib(memory.total_bytes)} + "
                   f"{micro} × {_mib(per_sample)} activations per sample (estimate, recompute "
                   f"{recompute.granularity}) = {_mib(memory.total_bytes + micro * per_sample)} within "
                   f"--memory-budget-gb {args.memory_budget_gb:g}")


def size_multiple_warnings(model: ModelConfig | None, batches: Batches, precision: Precision,
                           ctx: RunContext) -> list[str]:
    """fp16/bf16 matmuls run on tensor cores (and AMX tiles) at full speed when their dimensions are multiples of
    8; on NVIDIA Ampere or newer (native bf16: compute capability 8.0+) of 64. The batch enters the matmuls as
    micro batch × sequence length rows, so that product is checked, not the micro batch alone (a micro batch of 1
    with a sequence of 2048 is as fast as any)."""
    if precision.dtype == "fp32" or model is None:
        return []
    multiple = 64 if ctx.device_type == "cuda" and ctx.capability.native_bf16 else 8
    tokens = batches.micro_batch_size * model.seq_length
    sizes = {"--hidden-size": model.hidden_size, "padded vocabulary": model.vocab_size,
             "--seq-length": model.seq_length,
             f"--micro-batch-size {batches.micro_batch_size} × --seq-length {model.seq_length} =": tokens}
    odd = [f"{name} {value}" for name, value in sizes.items() if value % multiple]
    if not odd:
        return []
    where = "on an NVIDIA Ampere or newer GPU" if multiple == 64 else "for tensor cores"
    return [f"{', '.join(odd)}: not a multiple of {multiple}; {precision.dtype} matmuls run fastest {where} when "
            f"these sizes are multiples of {multiple} (--make-vocab-size-divisible-by pads the vocabulary)"]


def is_pretraining(args: argparse.Namespace, ctx: RunContext) -> bool:
    """rapidtrain's own iteration-based pretraining of the built-in model (no user script)."""
    return args.task == "pretraining" and not ctx.script


def data_settings(args: argparse.Namespace, ctx: RunContext) -> DataSettings:
    from rapidtrain.config.arguments import uses_demo_data

    if is_pretraining(args, ctx):
        source: DataSource = "demo" if uses_demo_data(args) else "indexed"
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
        dynamic_shape=args.data_iterator == "dynamic-shape", data_dir=args.data_dir, data_name=args.data_name,
        split_paths=split_paths_of(args), keep_last=args.keep_last, mmap_warmup=args.mmap_warmup,
        padding_free=args.padding_free)


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
                            on_sigterm="save" if args.save else ("stop" if args.exit_signal_handler else "default"))


def checkpoint_settings(args: argparse.Namespace, vocab_size: int | None = None) -> CheckpointSettings:
    schedule_from: ScheduleFrom = "flags" if args.override_opt_param_scheduler else (
        "checkpoint" if args.use_checkpoint_opt_param_scheduler else "same")
    pretrained = is_megatron_checkpoint(args) and args.load == args.pretrained_model_name_or_path \
        and args.load != args.save
    return CheckpointSettings(save=args.save, save_interval=args.save_interval, load=args.load,
                              finetune=args.finetune, load_optimizer=not args.no_load_optim,
                              load_rng=not args.no_load_rng, schedule_from=schedule_from,
                              async_save=getattr(args, "async_save", False), load_is_pretrained_model=pretrained,
                              pretrained_model=args.pretrained_model_name_or_path,
                              flags=recorded_flags(args, vocab_size))


def recorded_flags(args: argparse.Namespace, vocab_size: int | None) -> dict[str, Any]:
    """The flags as plain JSON values, with the built-in model's padded vocabulary (as Megatron's args carry it)."""
    from rapidtrain.config.arguments import flag_values

    flags = json.loads(json.dumps(flag_values(args), default=str))
    if vocab_size:
        flags["padded_vocab_size"] = vocab_size
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
        logging_path=args.logging_path)


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
        compile_with = "ortmodule" if _ort_status()[0] else "inductor"
    elif args.torch_compile:
        compile_with = "inductor"
    recompute = recompute_of(args)
    return Switches(partitioning, engine, args.cpu_offload, recompute.enabled, compile_with,
                    args.data_iterator == "dynamic-shape", compile_backend=args.torch_compile_backend,
                    compile_mode=args.torch_compile_mode, deepspeed_config_file=args.deepspeed_config,
                    tf32=args.tf32 and ctx.device_type == "cuda",
                    build_on_meta=model_construction(args, ctx, layout, partitioning, engine)[0],
                    cpu_allocator_tuning=args.cpu_allocator_tuning and ctx.device_type == "cpu",
                    recompute=recompute)



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
    return RecomputeSettings(granularity, method, args.recompute_num_layers or 1)


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


def load_in_bits(args: argparse.Namespace) -> Literal[4, 8] | None:
    return 4 if args.load_in_4bit else 8 if args.load_in_8bit else None


def lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    """The adapters' and k-bit base's settings of a Hugging Face fine-tune (None for the built-in models)."""
    if trains_builtin_model(args):
        return None
    from rapidtrain.models.lora import LoraSettings

    return LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                        target_modules=tuple(args.lora_target_modules or ()), load_in_bits=load_in_bits(args))


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


def experts_sharded_by_fsdp2(layout: Layout, second_dims: tuple[int, ...]) -> bool:
    """Under FSDP2 (FSDP, SDP, ZeRO-1/2 through FSDP2) with expert parallelism, whether the expert slices are
    fully_shard-ed over the ranks holding the same experts (torchtitan's way), on their second dimension
    (`second_dims`: the experts' hidden and FFN sizes; dimension 0 is expert parallelism's).

    Not when no other rank holds them (data parallel = EP: nothing to shard), nor under tensor parallelism,
    where they are replicated DTensors on the tensor-parallel mesh, nor when a second dimension does not
    divide evenly (FSDP2 splits only dimension 0 unevenly): they then stay out of FSDP2 and are all-reduced
    over their group."""
    holders = layout.data_parallel_size // layout.expert_parallel_size
    return (layout.expert_parallel_size > 1 and layout.tensor_parallel_size == 1 and holders > 1
            and all(size % holders == 0 for size in second_dims))


def expert_second_dims(model: ModelConfig | None) -> tuple[int, ...]:
    """The experts' second dimensions (w1, w_gate, b2: hidden; w2, b1: FFN); () when the model is not known."""
    return (model.hidden_size, model.ffn_size) if model is not None else ()


def _expert_partitioning_note(dest: str, layout: Layout, model: ModelConfig | None) -> str:
    """How a partitioning switch treats the expert slices, which differ from one expert-parallel rank to the next."""
    dp, ep = layout.data_parallel_size, layout.expert_parallel_size
    if dest == "oss_memory_optimization":
        return ("expert slices stay out of ZeroRedundancyOptimizer's partitioning (it broadcasts each parameter from "
                "its owner over all data-parallel ranks, and each expert-parallel rank holds other experts): every "
                "rank's local optimizer steps its own slices, whose gradients are all-reduced over the "
                f"{dp // ep} ranks holding the same experts")
    if experts_sharded_by_fsdp2(layout, expert_second_dims(model)):
        return (f"expert slices (1/{ep} of each MoE layer's experts) are fully_shard-ed on their second dimension over "
                f"the {dp // ep} ranks holding the same experts, gradients averaged over all {dp} data-parallel ranks")
    if layout.tensor_parallel_size > 1:
        why = "under tensor parallelism"
    elif dp == ep:
        why = f"no other rank holds the same experts (data parallel {dp} = expert parallel {ep})"
    else:
        why = (f"their second dimensions {expert_second_dims(model)} (hidden, FFN) do not split evenly over the "
               f"{dp // ep} ranks holding the same experts")
    return (f"expert slices (1/{ep} of each MoE layer's experts) stay out of FSDP2: {why}; their gradients are "
            "averaged by the expert all-reduce")


def _partitioning_choice(args: argparse.Namespace, layout: Layout, model: ModelConfig | None) -> EngineChoice | None:
    chosen = chosen_partitioning(args)
    if not chosen:
        return None
    dest = chosen[0]
    experts = _expert_partitioning_note(dest, layout, model) if layout.expert_parallel_size > 1 else ""
    if zero_by_fsdp2(args) and dest in ("zero_1_memory_optimization", "zero_2_memory_optimization"):
        splits = [name for name, size in (("tensor", layout.tensor_parallel_size),
                                          ("pipeline", layout.pipeline_parallel_size)) if size > 1]
        cannot = [f"wrap the {'/'.join(splits)}-parallel model"] if splits else []
        if layout.expert_parallel_size > 1:
            cannot.append("reduce expert slices over their own group")
        return EngineChoice(_flag(dest), "FSDP2 fully_shard over the data-parallel mesh dimension, "
                            "reshard_after_forward=False", f"DeepSpeed cannot {' or '.join(cannot)}; FSDP2 keeps "
                            "parameters unsharded between forward and backward, so memory is ZeRO-2's (optimizer "
                            "state and gradients partitioned)" + (f"; {experts}" if experts else ""))
    if args.sharding_backend == "fairscale" and dest in FAIRSCALE_ENGINES:
        return EngineChoice(_flag(dest), FAIRSCALE_ENGINES[dest], "--sharding-backend fairscale")
    return EngineChoice(_flag(dest), PARTITIONING_ENGINES[dest], experts)


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


def engines_for(args: argparse.Namespace, ctx: RunContext, layout: Layout, precision: Precision,
                switches: Switches, model: ModelConfig | None = None) -> tuple[list[EngineChoice], list[str]]:
    from rapidtrain.optim.optimizers import describe_optimizer

    engines: list[EngineChoice] = []
    notes: list[str] = []
    backend = args.distributed_backend or ("nccl" if ctx.device_type == "cuda" else "gloo")
    three_d = layout.tensor_parallel_size > 1 or layout.pipeline_parallel_size > 1
    partitioning = _partitioning_choice(args, layout, model)
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
        residual = (", PR-MoE (--mlp-type residual): a dense MLP beside the experts, mixed in by learned per-token "
                    "coefficients" if args.mlp_type == "residual" else "")
        engines.append(EngineChoice("--num-experts", f"rapidtrain MoE layers: top-{args.moe_router_topk} router, "
                                    f"load-balancing loss, capacity factor {args.moe_capacity_factor:g}{ep}{residual}"))
    if precision.dtype != "fp32":
        deepspeed_own = partitioning is not None and partitioning.engine.startswith("DeepSpeed")
        engine = f"DeepSpeed {precision.dtype} engine" if deepspeed_own else f"torch.autocast({precision.dtype})"
        if precision.loss_scaling != "none":
            engine += f" + {precision.loss_scaling} loss scaling"
        if partitioning is not None and "FSDP2" in partitioning.engine and layout.data_parallel_size > 1:
            engine += (f"; FSDP2 MixedPrecisionPolicy on the transformer blocks ({precision.dtype} all-gather and "
                       "compute, fp32 reduce-scatter and accumulation; embeddings, final norm and head in fp32)")
        engines.append(EngineChoice("precision", engine, precision.reason))
    engines += recompute_choices(args)
    if args.onnx_runtime_training:
        usable, why = _ort_status()
        engines.append(EngineChoice("--onnx-runtime-training", "onnxruntime ORTModule" if usable
                                    else f"{describe_compile(args)} as the graph optimiser", why))
    lora = lora_settings(args)
    if lora is not None and lora.load_in_bits:
        from rapidtrain.models.lora import describe_quantization

        engines.append(EngineChoice(f"--load-in-{lora.load_in_bits}bit",
                                    describe_quantization(lora.load_in_bits, precision.dtype)))
    if lora is not None and lora.rank > 0:
        engines.append(EngineChoice("--lora-rank", lora.describe()))
    attention = attention_settings(args)
    if "attention_backend" in getattr(args, "given_flags", ()) or attention.document_ids:
        engines.append(EngineChoice("--attention-backend", *attention.describe(trains_builtin_model(args))))
    if args.torch_compile:
        engines.append(EngineChoice("--torch-compile", f"{describe_compile(args)} per transformer layer"))
    if ctx.device_type == "cpu" and args.cpu_allocator_tuning:
        from rapidtrain.core.cpu_allocator import DESCRIPTION, glibc_version

        if glibc_version():
            engines.append(EngineChoice("CPU allocator", DESCRIPTION, "each step reuses the last step's pages "
                                        "instead of faulting them in again; --no-cpu-allocator-tuning turns it off"))
        else:
            notes.append("CPU allocator: the C library is not glibc, so malloc is left as it is")
    if args.tf32 or ctx.device_type == "cuda":
        engines.append(tf32_choice(args, ctx, precision))
    construction = construction_choice(args, ctx, layout, switches)
    if construction is not None:
        engines.append(construction)
    if args.data_iterator == "dynamic-shape":
        how = "length-bucketed batches padded to the longest (multiple of 8)"
        if is_pretraining(args, ctx) and args.model_type == "gpt":
            how = "one document per sample (not packed, cut at --seq-length + 1 tokens), " + how
        elif is_pretraining(args, ctx):
            how = "BERT samples bucketed by length, each micro-batch cut to its longest (multiple of 8)"
        engines.append(EngineChoice("--data-iterator dynamic-shape", how))
    if args.padding_free:
        engines.append(EngineChoice("--padding-free", "each micro-batch's sequences concatenated into one row "
                                    "(no padding; its length varies per step), position ids restarting at 0 per "
                                    "sequence, no attention mask and use_cache=False, so transformers' "
                                    "create_causal_mask detects the packed sequences and keeps attention within "
                                    "each; no loss across a sequence boundary (flash_attention_2 runs each "
                                    "sequence alone; eager and sdpa mask one [row, row] block, whose cost grows "
                                    "with the row's length squared)",
                                    "--padding-free: no compute or memory spent on padded tokens"))
    if args.mmap_warmup:
        engines.append(EngineChoice("--mmap-warmup", "every .bin/.idx file of the data read once before training"))
    if (args.cpu_offload or args.nvme_offload_dir) and zero_stage(args) > 0 and not zero_by_fsdp2(args):
        from rapidtrain.optim.optimizers import describe_offload_optimizer

        engines.append(EngineChoice("optimizer", describe_offload_optimizer(optimizer_settings(args))))
    else:
        settings = optimizer_settings(args, layout, switches)
        engines.append(EngineChoice("optimizer", describe_optimizer(settings, ctx.device_type),
                                    "the layout's parameters are " + ("DTensors (tensor parallel / FSDP2 / "
                                    "replicate)" if settings.dtensor_parameters else "plain tensors")))
    if args.cpu_offload:
        notes.append("--cpu-offload: the optimizer comes from DeepSpeed's config (DeepSpeedCPUAdam), so --optimizers "
                     "selects Adam there")
    return engines, notes


def recompute_choices(args: argparse.Namespace) -> list[EngineChoice]:
    recompute = recompute_of(args)
    if not recompute.enabled:
        return []
    if args.checkpoint_activations and recompute.granularity == "full" and recompute.method == "uniform":
        hf_own = not trains_builtin_model(args)
        return [EngineChoice("--checkpoint-activations", "Hugging Face gradient_checkpointing_enable()" if hf_own
                             else "torch.utils.checkpoint per transformer layer")]
    given = [flag for flag, dest in (("--recompute-granularity", "recompute_granularity"),
                                     ("--recompute-activations", "recompute_activations"),
                                     ("--activations-checkpoint-method", "activations_checkpoint_method"),
                                     ("--checkpoint-activations", "checkpoint_activations"))
             if getattr(args, dest)]
    return [EngineChoice(given[0], f"recompute {recompute.granularity}: {recompute.describe()}")]


def construction_choice(args: argparse.Namespace, ctx: RunContext, layout: Layout,
                        switches: Switches) -> EngineChoice | None:
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

def optimizer_state_bytes_per_parameter(model: ModelConfig, settings: OptimizerSettings, device_type: str) -> float:
    """The chosen implementation's state per parameter, from the model's real tensor shapes (Adafactor's
    factored rows and columns, 8-bit blocks and the small tensors they leave in fp32)."""
    from rapidtrain.optim.optimizers import resolve_optimizer
    from rapidtrain.optim.state_bytes import optimizer_state_bytes

    shapes = parameter_shape_counts(model)
    total = sum(math.prod(shape) * count for shape, count in shapes.items())
    return optimizer_state_bytes(resolve_optimizer(settings, device_type).state, shapes) / max(total, 1)


def parameter_shape_counts(model: ModelConfig) -> dict[tuple[int, ...], int]:
    """How many parameter tensors of each shape the built-in model has, from a one-layer model of each layer kind
    built on the meta device (shapes only, nothing allocated; layers of one kind count alike, so a plan of
    10^8 layers answers at once)."""
    from collections import Counter

    import torch

    from rapidtrain.models import build_model

    kinds = Counter(model.num_experts) if model.num_experts else Counter({0: model.num_layers})
    counts: Counter[tuple[int, ...]] = Counter()
    for index, (experts, layers) in enumerate(kinds.items()):
        one_layer = dataclasses.replace(model, num_layers=1, num_experts=(experts,) if model.num_experts else ())
        with torch.device("meta"):
            built = build_model(one_layer, seed=None)
        for name, param in built.named_parameters():
            in_layer = name.startswith("layers.")
            if in_layer or index == 0:  # the embedding, head and norms once
                counts[tuple(param.shape)] += layers if in_layer else 1
    return dict(counts)


def memory_estimate(args: argparse.Namespace, model: ModelConfig, layout: Layout,
                    precision: Precision, ctx: RunContext, switches: Switches | None = None) -> MemoryEstimate:
    from rapidtrain.models.counting import count_parameters, expert_parameter_count

    total, active = count_parameters(model)
    # Experts are sharded over the expert-parallel ranks (and replicated over tensor-parallel ones).
    experts = expert_parameter_count(model)
    shared = (total - experts) / layout.tensor_parallel_size / layout.pipeline_parallel_size
    own_experts = experts / layout.expert_parallel_size / layout.pipeline_parallel_size
    stage = zero_stage(args)
    deepspeed = stage > 0 and not zero_by_fsdp2(args)
    half = precision.dtype != "fp32"
    # DeepSpeed keeps 16-bit weights and gradients beside fp32 master weights; torch autocast keeps fp32 ones.
    weight, grad = (2, 2) if deepspeed and half else (4, 4)
    if deepspeed and (args.cpu_offload or args.nvme_offload_dir):  # the reduced fp32 gradient partition is on the CPU
        grad = 4
        state = 8.0  # DeepSpeedCPUAdam: fp32 moments
    else:
        settings = optimizer_settings(args, layout, switches or switches_of(args, layout, ctx))
        state = optimizer_state_bytes_per_parameter(model, settings, ctx.device_type)
    optimizer = state + (4 if deepspeed and half else 0)
    n = layout.data_parallel_size
    shard_optimizer = stage > 0 or args.oss_memory_optimization or args.oss_sdp_memory_optimization \
        or args.fsdp_memory_optimization
    # In 3D mode ZeRO-1/2 is FSDP2 over the data-parallel dimension, which reduce-scatters gradients (ZeRO-2 memory).
    shard_grads = stage >= 2 or (stage == 1 and not deepspeed) or args.oss_sdp_memory_optimization \
        or args.fsdp_memory_optimization
    shard_params = stage == 3 or args.fsdp_memory_optimization
    # Under expert parallelism FSDP2 shards the expert slices over the ranks holding the same experts, if at all;
    # OSS leaves them whole on each rank (see _expert_partitioning_note).
    fsdp2 = args.oss_sdp_memory_optimization or args.fsdp_memory_optimization or (stage in (1, 2) and not deepspeed)
    sharded = fsdp2 and experts_sharded_by_fsdp2(layout, expert_second_dims(model))
    expert_ranks = n // layout.expert_parallel_size if sharded else 1

    def per_rank(nbytes: float, sharded: bool) -> float:
        return shared * nbytes / (n if sharded else 1) + own_experts * nbytes / (expert_ranks if sharded else 1)

    return MemoryEstimate(
        parameters=int(shared + own_experts), total_params=total, active_params=active,
        param_bytes=per_rank(weight, shard_params), grad_bytes=per_rank(grad, shard_grads),
        optimizer_bytes=per_rank(optimizer, shard_optimizer),
        optimizer_on_cpu=bool(args.cpu_offload or args.nvme_offload_dir),
        params_offloaded="nvme" if args.nvme_offload_dir else "cpu" if args.cpu_offload_params else "none",
    )


# ---- printing ----

def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


ON_SIGTERM = {
    "save": "save a checkpoint at the end of the iteration, exit 0 (a repeated SIGTERM cannot cut the save)",
    "stop": "stop at the end of the iteration and exit 0, nothing saved (--exit-signal-handler without --save)",
    "default": "the process ends at once, nothing saved (give --save, or --exit-signal-handler to stop cleanly)",
}


def _training_length(t: TrainingSettings) -> str:
    length = f"{t.train_iters} iterations" if t.train_iters else f"{t.epochs or 1} epoch(s)"
    if t.train_samples is not None:
        length = f"{t.train_samples:,} samples (--train-samples) = {t.train_iters} iterations"
    evaluation = f"evaluation every {t.eval_interval} iterations" if t.eval_interval else "evaluation after each epoch"
    return f"{length}, {evaluation}, seed {t.seed}"


def _schedule(s: ScheduleSettings, clip_grad: float) -> str:
    if s.warmup_fraction is not None:
        warmup = f"warm-up {s.warmup_fraction:g} of the decay horizon"
    elif s.decay_samples is not None:
        warmup = f"warm-up {s.warmup_samples:,} samples"
    else:
        warmup = f"warm-up {s.warmup_iters} iterations"
    horizon = f" over {s.decay_iters} iterations" if s.decay_iters else ""
    if s.decay_samples is not None:
        horizon = f" over {s.decay_samples:,} samples"
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
        *([f"  micro batch: {bat.micro_batch_choice}"] if bat.micro_batch_choice else []),
        f"  batches: micro {bat.micro_batch_size} × accumulation steps {bat.accumulation_steps} × data parallel "
        f"{lay.data_parallel_size} = global {bat.global_batch_size}"
        + (f"; {bat.schedule.describe(bat.global_batch_size)}, the accumulation steps following it"
           if bat.schedule else ""),
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
            f"  model-state memory per rank (estimate, ZeRO accounting): parameters {_mib(mem.param_bytes)}"
            + (f" (offloaded to {mem.params_offloaded})" if mem.params_offloaded != "none" else "") + ", "
            f"gradients {_mib(mem.grad_bytes)}, optimizer {_mib(mem.optimizer_bytes)}"
            + (" (on CPU)" if mem.optimizer_on_cpu else "") + f"; total {_mib(mem.total_bytes)}",
        ]
    ck = plan.checkpoint
    if ck.save or ck.load:
        lines.append("  checkpoints: " + "; ".join(
            ([f"save to {ck.save}" + (f" every {ck.save_interval} iterations" if ck.save_interval else "")]
             if ck.save else [])
            + ([f"load from {ck.load}" + (" (model only, --finetune)" if ck.finetune else "")] if ck.load else [])))
        if ck.async_save and ck.save:
            lines.append("    async save: written by a background thread (torch.distributed.checkpoint async_save) "
                         "from a copy in host memory; published once every rank has finished writing")
    lines += _reporting_lines(plan)
    lines.append("  on SIGTERM: " + ON_SIGTERM[plan.training.on_sigterm])
    lines.append(f"  distributed: process-group backend {_backends(plan.distributed.backend)}, collectives time "
                 f"out after {plan.distributed.timeout_minutes:g} minutes (--distributed-timeout-minutes)")
    lines.append("  MFU: " + (f"against {plan.logging.peak_tflops:g} TFLOP/s per device ({plan.logging.peak_source})"
                              if plan.logging.peak_tflops else f"not reported: {plan.logging.peak_source}"))
    lines += [f"  note: {n}" for n in plan.notes]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _reporting_lines(plan: Plan) -> list[str]:
    """Where the run's scalars, config and traces go, beyond the log line."""
    lines, log = [], plan.logging
    if log.tensorboard_dir:
        lines.append(f"  tensorboard: scalars and the plan in {log.tensorboard_dir}")
    tracking = log.tracking
    if tracking and tracking.wandb_project:
        lines.append(f"  weights & biases: project {tracking.wandb_project}"
                     + (f", run {tracking.wandb_exp_name}" if tracking.wandb_exp_name else "")
                     + f", files in {tracking.wandb_save_dir or './wandb'} (WANDB_MODE=offline: no network)")
    if tracking and tracking.mlflow_experiment:
        where = tracking.mlflow_tracking_uri or "$MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db)"
        lines.append(f"  mlflow: experiment {tracking.mlflow_experiment}"
                     + (f", run {tracking.mlflow_run_name}" if tracking.mlflow_run_name else "") + f" at {where}")
    profile = plan.profile
    if profile.enabled:
        lines.append(f"  profiler: PyTorch profiler on ranks {list(profile.ranks)} over iterations "
                     f"{profile.step_start + 1}-{profile.step_end}, traces in {profile.trace_dir}"
                     " (a CUDA memory snapshot beside them on GPUs)")
    return lines


def _backends(backend: str) -> str:
    if "," not in backend:
        return backend
    parts = dict(part.split(":") for part in backend.split(","))
    return ", ".join(f"{kind} tensors → {name}" for kind, name in parts.items()) + f" ({backend})"
