"""The Plan and the settings dataclasses each component is handed from it: frozen, built once by
`config.plan.from_args`, read by everything after the flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rapidtrain.config.pipeline_split import rank_of_stage
from rapidtrain.data.tokenizer import TokenizerSettings
from rapidtrain.data.weighted_splits import WeightedGroup
from rapidtrain.models.attention_backends import AttentionSettings
from rapidtrain.models.config import ModelConfig

if TYPE_CHECKING:
    from rapidtrain.core.device_probe import Probe
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
        """The machine's answer: from the operating system where that is certain (core/device_probe.py: a process
        that plans but does not train never initialises CUDA), else from torch."""
        from rapidtrain.core.device_probe import probe

        found = probe()
        device_type: DeviceType
        if found is not None:
            device_type = "cuda" if found.device_type == "cuda" else "cpu"
            capability = DeviceCapability(found.name, found.native_bf16)
        else:
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            capability = detect_capability(device_type)
        script = getattr(args, "user_script", None) or script
        if "WORLD_SIZE" in os.environ:
            return RunContext(int(os.environ["WORLD_SIZE"]), device_type, script, capability)
        from rapidtrain.core.slurm import node_layout

        per_node = getattr(args, "nproc_per_node", None) or default_nproc_per_node(device_type, found)
        return RunContext(per_node * node_layout(os.environ).nnodes, device_type, script, capability)


def default_nproc_per_node(device_type: str, found: Probe | None = None) -> int:
    """One process per visible GPU, else one; `found`: the device probe's answer when the caller has it."""
    if device_type == "cuda":
        from rapidtrain.core.device_probe import probe

        found = found or probe()
        if found is not None:
            return found.device_count
        import torch

        return torch.cuda.device_count()
    return 1


def data_parallel_size(world_size: int, tensor_parallel: int, pipeline_parallel: int, context_parallel: int = 1) -> int:
    """Megatron's DP = world / (TP × PP × CP): context-parallel ranks share one micro-batch (each a part of its
    sequence), so they are not data-parallel ranks."""
    return max(world_size // max(tensor_parallel * pipeline_parallel * context_parallel, 1), 1)


def context_parallel_of(args: argparse.Namespace) -> tuple[int, str]:
    """(context-parallel size, comm type) of the flags: --ds-sequence-parallel-size N is Ulysses, CP N over a2a;
    --cp-comm-type's one value (a per-layer list repeating it; the rules refuse differing values)."""
    ulysses = getattr(args, "ds_sequence_parallel_size", 1) or 1
    if ulysses > 1:
        return ulysses, "a2a"
    comm = getattr(args, "cp_comm_type", None) or ["p2p"]
    comm = [comm] if isinstance(comm, str) else comm
    return getattr(args, "context_parallel_size", 1) or 1, comm[0]


def rope_type_of(args: argparse.Namespace) -> str:
    """--rope-type, whose default is YaRN with --multi-latent-attention (Megatron-Core's MLA config) and plain rope
    otherwise; YaRN of factor 1 (--rotary-scaling-factor's default) is plain rope, so only a stretch makes it so."""
    return args.rope_type or ("yarn" if args.multi_latent_attention and args.rotary_scaling_factor != 1 else "rope")


def expand_num_experts(num_experts: list[int] | None, num_layers: int, moe_layer_freq: int = 1) -> tuple[int, ...]:
    """Per-layer expert counts: one number applies to every `moe_layer_freq`-th layer from the first (Megatron-Core's
    --moe-layer-freq N: layers 0, N, 2N, ...; Megatron-DeepSpeed's --expert-interval, which counts from layer N-1,
    becomes a per-layer list first: surface_meanings.py), a list to each layer."""
    if not num_experts:
        return ()
    if len(num_experts) == 1:
        freq = max(moe_layer_freq, 1)
        return tuple(num_experts[0] if i % freq == 0 else 0 for i in range(num_layers))
    if len(num_experts) == num_layers or num_layers % len(num_experts):
        return tuple(num_experts)
    # Fewer counts than layers (DeepSpeed's and Rapidformer's pyramid, e.g. 12 counts for 24 layers): one per MoE
    # layer, MoE layers every num_layers / counts layers.
    interval, counts = num_layers // len(num_experts), iter(num_experts)
    return tuple(next(counts) if i % interval == interval - 1 else 0 for i in range(num_layers))


@dataclass(frozen=True)
class Precision:
    dtype: Dtype
    loss_scaling: str  # "none", "dynamic" or "static <scale>"
    reason: str


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Megatron's default split: the same number of layers on every stage (the rules refuse a remainder)."""
    return (num_layers // stages,) * stages


@dataclass(frozen=True)
class Layout:
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    virtual_pipeline_stages: int = 1
    sequence_parallel: bool = False
    # Transformer layers per pipeline stage in model order (config/pipeline_split.py); () before it is known
    stage_layers: tuple[int, ...] = ()
    pipeline_schedule: str = "1f1b"  # config/pipeline_split.py's SCHEDULES
    # --context-parallel-size (or --ds-sequence-parallel-size: Ulysses, comm type "a2a"): each micro-batch's
    # sequence split over this many ranks, attention exchanged across them (parallel/context_parallel.py).
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"  # p2p (ring), allgather, a2a (Ulysses)

    @property
    def data_context_parallel_size(self) -> int:
        """Ranks holding the same weights and reducing gradients together: Megatron's dp_cp group (every CP rank
        has a gradient from its part of the sequence)."""
        return self.data_parallel_size * self.context_parallel_size

    def layers_of_stage(self, stage: int, num_layers: int) -> range:
        """The indices of the transformer layers stage `stage` runs (the names the full model gives them)."""
        counts = self.stage_layers or even_split(num_layers, self.pipeline_parallel_size * self.virtual_pipeline_stages)
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def head_rank(self) -> int:
        """The pipeline rank of the last stage (the head and the loss): the last rank, or the first on a V."""
        p = self.pipeline_parallel_size
        return rank_of_stage(p * self.virtual_pipeline_stages - 1, p, self.pipeline_schedule)

    def layers_per_rank(self, num_layers: int) -> list[int]:
        """Transformer layers each pipeline rank holds (all its stages)."""
        p = self.pipeline_parallel_size
        counts = self.stage_layers or even_split(num_layers, p * self.virtual_pipeline_stages)
        ranks = [0] * p
        for stage, layers in enumerate(counts):
            ranks[rank_of_stage(stage, p, self.pipeline_schedule)] += layers
        return ranks

    def rank_grid(self) -> list[list[list[int]]]:
        """Megatron order: pipeline outermost, then data, context, tensor innermost (tensor ranks are neighbours,
        context ranks next). The middle index is the data × context coordinate d · CP + c (d alone without CP)."""
        tp, dpcp = self.tensor_parallel_size, self.data_context_parallel_size
        return [[[(p * dpcp + d) * tp + t for t in range(tp)] for d in range(dpcp)]
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


# Megatron-Core's --recompute-modules (selective recompute) and what each recomputes in the built-in models
RECOMPUTE_MODULE_MEANINGS = {
    "core_attn": "the attention core (scaled_dot_product_attention / flex_attention calls)",
    "moe_act": "the experts' activation (the gated unit or GELU between their two projections)",
    "layernorm": "the two norms (before attention and before the MLP)",
    "mla_up_proj": "MLA's up projections (q_up_proj, kv_up_proj)",
    "mlp": "the dense MLP",
    "moe": "the MoE layer (router, dispatch, experts, combine)",
    "shared_experts": "the MoE layer's shared experts",
}


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
    # --moe-layer-recompute: each MoE layer under torch.utils.checkpoint, in the layers not recomputed whole
    moe_layers: bool = False
    # --cpu-offloading: the saved activations of the first this many layers of each stage kept in host memory
    offload_layers: int = 0
    # --recompute-modules under selective recompute (Megatron-Core's): what of each layer is recomputed
    modules: tuple[str, ...] = ("core_attn",)

    @property
    def enabled(self) -> bool:
        return self.granularity != "none"

    @property
    def counted_granularity(self) -> str:
        """The granularity the activation and time models count: selective recompute without the attention core
        in --recompute-modules keeps the core's tensors (its other modules' savings are not counted: the plan
        then states more memory than runs, never less)."""
        if self.granularity == "selective" and "core_attn" not in self.modules:
            return "none"
        return self.granularity

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
        if self.granularity == "selective" and self.modules != ("core_attn",):
            what = ", ".join(RECOMPUTE_MODULE_MEANINGS[m] for m in self.modules if m != "mla_up_proj") + (
                " (torch.utils.checkpoint around each; Megatron-Core's --recompute-modules)")
        which = (f"the first {self.num_layers} layer(s) of each pipeline stage" if self.method == "block"
                 else "every layer")
        text = f"{what}, in {which}" if self.enabled else ""
        if self.offload_layers:
            offload = (f"activations of the first {self.offload_layers} layer(s) of each pipeline stage kept in "
                       "host memory (torch.autograd.graph.save_on_cpu: copied out in forward, back in backward; "
                       "--cpu-offloading)")
            text = f"{text}; {offload}" if text else offload
        if self.moe_layers_recomputed:
            moe = ("each MoE layer whole (torch.utils.checkpoint: router, dispatch, experts and combine recomputed; "
                   "--moe-layer-recompute)")
            text = f"{text}; and {moe}" if text else moe
        return text

    @property
    def moe_layers_recomputed(self) -> bool:
        """--moe-layer-recompute adds something unless every layer is recomputed whole already."""
        return self.moe_layers and not (self.granularity == "full" and self.method == "uniform")


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
    # A CPU run's intra-op threads per rank, set at start (torch.set_num_threads); 0: left as they are (a GPU run,
    # or OMP_NUM_THREADS given, which torch already follows).
    cpu_threads: int = 0
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
    # The zero_optimization keys above whose flags were left at their defaults: a --deepspeed_config value wins.
    defaulted: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineChoice:
    switch: str
    engine: str
    reason: str = ""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank before anything is built: model states by the ZeRO paper's accounting (`param_bytes`,
    `grad_bytes`, `optimizer_bytes`: the average rank's), and per pipeline stage the model states (the first stage
    holds the embedding, the last the head) and the activations at its peak (Korthikanti et al. 2022, see
    config/activations.py); `peak_bytes_per_rank` is the largest rank's sum (its stage's, plus its optimizer share
    beyond the average where ranks differ)."""

    parameters: int
    total_params: int
    active_params: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    # Each data-parallel rank's optimizer state where they differ (OSS gives ranks whole tensors: memory.py's
    # oss_optimizer_bytes_by_rank); () when every rank holds the average
    optimizer_bytes_by_rank: tuple[float, ...] = ()
    # Beyond the ZeRO accounting, what the engine keeps on the device by its design (DeepSpeed's reduce buckets,
    # ZeRO-2's whole gradients of the parameters a partition touches, ZeRO-3's persistent and gathered
    # parameters: config/memory.py's deepspeed_engine_bytes; FSDP2's gathered parameters: fsdp2_gathered_bytes),
    # on the average stage, and per pipeline stage where that is known (else in proportion to its parameters)
    engine_bytes: float = 0.0
    engine_bytes_by_stage: tuple[float, ...] = ()
    # FSDP2's (and composable replicate()'s, data parallelism beside TP) whole (unsharded) fp32 gradients of
    # this rank's model-parallel share, accumulated apart from .grad while gradient sync
    # is off between the micro-batches of one iteration (accumulation, pipelining), on the average stage; held only
    # when an iteration has more than one micro-batch per rank (with_peak adds them then)
    accumulated_grad_bytes: float = 0.0
    optimizer_on_cpu: bool = False
    params_offloaded: OffloadTarget = "none"  # ZeRO-3 parameter partitions in host memory or on NVMe
    stage_state_bytes: tuple[float, ...] = ()  # model states on one rank of each pipeline stage (on the device)
    stage_activation_bytes: tuple[float, ...] = ()  # activations kept at each stage's peak, on one rank of it
    peak_bytes_per_rank: float = 0.0  # the largest rank's model states + activations (0: not estimated)

    @property
    def total_bytes(self) -> float:
        params = 0 if self.params_offloaded != "none" else self.param_bytes
        return params + self.grad_bytes + (0 if self.optimizer_on_cpu else self.optimizer_bytes) + self.engine_bytes


@dataclass(frozen=True)
class StepEstimate:
    """The expected time of one iteration on the plan's GPUs and where it goes (config/estimate.py), or why there
    is none (`reason`, with the times left at 0). TFLOP/s and MFU count model FLOPs (no recomputation), as the
    log line does; `hardware_tflops_per_device` counts what runs, recomputation included."""

    device: str = ""
    seconds_per_iteration: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    hardware_tflops_per_device: float = 0.0
    parts: tuple[tuple[str, float], ...] = ()  # (what, seconds per iteration) in the order they add up
    assumptions: tuple[str, ...] = ()
    reason: str = ""  # why nothing is estimated ("" when estimated)


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
    exit_signal: str = "SIGTERM"  # --exit-signal: a second signal that stops the run as SIGTERM does
    train_samples: int | None = None  # sample-based training (--train-samples); train_iters then follows from it
    # --calculate-per-token-loss: the forward step must return (loss sum, token count); a mean loss stops the run
    per_token_loss: bool = False


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
    # --pretrained-checkpoint of Megatron's tasks (--task MNLI/RACE): the rapidtrain BERT checkpoint whose encoder
    # and pooler the task's model starts from (its head is new); --load stays the task run's own resume folder.
    pretrained_checkpoint: str | None = None
    # --load names another tool's checkpoint (Megatron-LM, DeepSpeed): what it is, for the plan; None for rapidtrain's.
    load_format: str | None = None
    # --universal-checkpoint (Megatron-DeepSpeed): --load reads the DeepSpeed universal checkpoint `latest_universal`
    # names (ds_to_universal's output) instead of the one `latest` names.
    universal_checkpoint: bool = False
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
    show_library_warnings: bool = False  # core/library_warnings.py: every library message, repeats included

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


# Megatron-LM's tasks/main.py: the built-in BERT fine-tuned from a rapidtrain BERT checkpoint (tasks_main.py).
MEGATRON_TASKS = ("MNLI", "RACE")
DataSource = Literal["demo", "indexed", "finetune", "script", "task"]


@dataclass(frozen=True)
class DataSettings:
    """Where samples come from and how they are batched and shared out.

    `source`: "demo" (the built-in corpus: pretraining with no --data-path), "indexed" (Megatron .bin/.idx
    from --data-path), "finetune" (--data-dir/--data-name), "script" (a user script brings its own) or "task"
    (Megatron's tasks/main.py: --task MNLI/RACE files in --train-data / --valid-data).
    """

    source: DataSource
    data_path: tuple[str, ...] = ()
    split: str = "969, 30, 1"
    data_impl: str = "mmap"
    cache_path: str | None = None
    seq_length: int = 256
    micro_batch_size: int = 1
    num_workers: int = 2
    # Page-locked batches, so that the copy to a GPU runs beside the computation (a CPU run has nothing to copy).
    pin_memory: bool = False
    loader_reason: str = ""  # why these workers and pinning (the plan says it)
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
    # BigScience's --*-weighted-split-paths: (train, valid, test) named groups, each a blend of document ranges.
    weighted_splits: tuple[tuple[WeightedGroup, ...], ...] | None = None
    # Pai's raw JSON kinds (--dataset LLama-Pretrain-Raw): split_paths name JSON files, samples max_padding_length
    raw_json: str | None = None
    max_padding_length: int | None = None
    # Pai's SFT idxmap (--dataset MMAP --train-mode finetune): each document 2 x seq_length ids, tokens then labels
    idxmap_sft: bool = False
    keep_last: bool = False  # fine-tuning: keep an epoch's last, incomplete micro-batch
    mmap_warmup: bool = False
    # casual_lm fine-tuning: each micro-batch is one row of its sequences back to back (--padding-free).
    padding_free: bool = False
    # Megatron's tasks (--task MNLI/RACE): the task's training files, and the validation files each scored apart.
    train_data: tuple[str, ...] = ()
    valid_data: tuple[str, ...] = ()


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
    warmup_init: float = 0.0  # --lr-warmup-init: where the warm-up starts
    wsd_decay_style: str = "linear"  # --lr-wsd-decay-style: the WSD phase's shape
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
    estimate: StepEstimate | None = None  # the expected step time (None: no built-in model to estimate)
    # A user script's own model (not the built-in one), as built: "class, N parameters" (Engine.compose sets it)
    script_model: str | None = None

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
