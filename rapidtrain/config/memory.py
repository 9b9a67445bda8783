"""Memory per rank before anything is built: model states by the ZeRO paper's accounting, activations per
sample, and the micro batch that fits a memory budget."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING

from rapidtrain.config.activations import ActivationContext, WeightCopies, stage_activation_bytes
from rapidtrain.config.partitioning import zero_stage
from rapidtrain.config.resolve import optimizer_settings, switches_of, zero_by_fsdp2
from rapidtrain.config.settings import (
    Batches,
    Layout,
    MemoryEstimate,
    Precision,
    RecomputeSettings,
    RunContext,
    Switches,
)
from rapidtrain.core.errors import UserError
from rapidtrain.models.attention_backends import short_kernel_runs
from rapidtrain.models.config import ModelConfig

if TYPE_CHECKING:
    from rapidtrain.optim.optimizers import OptimizerSettings
    from rapidtrain.optim.state_bytes import StateKind


def stage_parameter_shares(model: ModelConfig, pipeline_parallel: int,
                           layers_per_rank: list[int] | None = None, head_rank: int = -1) -> list[float]:
    """Each pipeline stage's parameters over the average stage's (the model's total / p): the first stage holds
    the embeddings, the last the final norm and the head (with tied embeddings, beyond one stage, its own copy
    of the word embedding), the others only their layers — the same number each, or `layers_per_rank` of an
    uneven split (each layer's own parameters, the multi-token-prediction depths on the last)."""
    from rapidtrain.models.counting import count_parameters, pipeline_unit_parameters

    if pipeline_parallel == 1:
        return [1.0]
    total = count_parameters(model)[0]
    embedding, head = edge_parameters(model)
    outside = total - embedding - head + (model.vocab_size * model.hidden_size if model.tie_embeddings else 0)
    average = total / pipeline_parallel
    if layers_per_rank is not None and len(set(layers_per_rank)) > 1:
        per_layer = pipeline_unit_parameters(model)[1]
        starts = [sum(layers_per_rank[:r]) for r in range(pipeline_parallel)]
        held = [float(sum(per_layer[start:start + n])) for start, n in zip(starts, layers_per_rank, strict=True)]
        held[-1] += outside - sum(per_layer)  # the MTP depths
        shares = [layers / average for layers in held]
    else:
        shares = [outside / pipeline_parallel / average] * pipeline_parallel
    shares[0] += embedding / average
    if head_rank % pipeline_parallel == 0 and model.tie_embeddings:  # a V: the head shares the embedding itself
        head -= model.vocab_size * model.hidden_size
    shares[head_rank] += head / average  # the last stage's rank (rank 0 on a V schedule)
    return shares


def edge_parameters(model: ModelConfig) -> tuple[int, int]:
    """(first stage's, last stage's) parameters outside the layers when pipelined: the embeddings; the final norm
    (its weight) and an output matrix, a tied embedding's own copy or the untied head."""
    from rapidtrain.models.counting import count_parameters

    edges = count_parameters(dataclasses.replace(model, num_layers=0, num_experts=()))[0]
    h, vocab = model.hidden_size, model.vocab_size
    return edges - (0 if model.tie_embeddings else vocab * h) - h, h + vocab * h


def loss_is_chunked(model: ModelConfig, layout: Layout, switches: Switches) -> bool:
    """Whether the built-in model computes head and loss in chunks (models/chunked_loss.py): GPT only (BERT's
    masked-LM head has its dense layer and norm before the decoder), and not when tensor parallelism (a DTensor
    weight and the vocab-parallel loss) or ZeRO-3's gathering hooks transform the head. FSDP2 gathers the head's
    weight into a plain Parameter before the forward that uses it, so it runs chunked (the memory test checks this
    claim against what ran, per layout)."""
    return model.model_type == "gpt" and layout.tensor_parallel_size == 1 and switches.partitioning != "zero-3"


def weight_copies(precision: Precision, layout: Layout, switches: Switches) -> WeightCopies:
    """Which fp32 weights the run copies to 16 bits for its matmuls (config/activations.py's WeightCopies). FSDP2
    applies only over more than one data-parallel rank; with one, the weights stay fp32 under autocast."""
    if precision.dtype == "fp32" or switches.partitioning_engine == "deepspeed":
        return "none"
    fsdp2 = switches.partitioning_engine == "fsdp2" and layout.data_context_parallel_size > 1
    return "head_and_experts" if fsdp2 else "all"


def bf16_weight_copies(precision: Precision, layout: Layout, switches: Switches) -> bool:
    """Whether the linear layers compute with bf16 copies of their weights kept by the step instead of autocast's
    per-forward casts (parallel/low_precision_weights.py): bf16 in one process, eager. Data, tensor and pipeline
    parallelism keep autocast (DDP and FSDP2 reduce the parameters' own gradients, TP/PP transform the layers, and
    DeepSpeed's bf16 engine keeps 16-bit weights of its own); so does --torch-compile, whose compiled graph fuses the
    casts into its kernels. The peak memory is the same either way (one 16-bit copy of the layers' matrices: held by
    autocast and backward during the step, or kept between steps), so the estimate does not change."""
    return (precision.dtype == "bf16" and layout.world_size == 1 and switches.compile == "none"
            and switches.partitioning_engine not in ("deepspeed", "fairscale"))


def flat_optimizer_step(model: ModelConfig | None, precision: Precision, layout: Layout, switches: Switches,
                        optimizer: OptimizerSettings | None, device_type: str) -> bool:
    """Whether the optimizer steps on flat buffers of parameters, gradients and moments (optim/flat_buffers.py):
    one process, the built-in dense model, torch's fused Adam/AdamW built from the flags, no loss scaling."""
    from rapidtrain.optim.optimizers import runs_on_flat_buffers

    return optimizer is not None and runs_on_flat_buffers(
        optimizer, device_type, one_process=layout.world_size == 1,
        builtin_dense_model=model is not None and not any(model.num_experts),
        loss_scaling=precision.loss_scaling != "none",
        own_engine=switches.partitioning_engine in ("deepspeed", "fairscale"))


def activation_context(model: ModelConfig, precision: Precision, layout: Layout, switches: Switches,
                       device_type: str) -> ActivationContext:
    """What the activation bytes depend on besides the shapes, for this model, precision, layout and engine."""
    act = dataclasses.replace(ActivationContext.of(model, precision.dtype, device_type),
                              chunked_loss=loss_is_chunked(model, layout, switches),
                              weight_copies=weight_copies(precision, layout, switches))
    if short_attention_planned(model, precision, layout, device_type):
        act = dataclasses.replace(act, scores_kept=True, scores_upcast=False, short_attention=True)
    return act


def short_attention_planned(model: ModelConfig, precision: Precision, layout: Layout, device_type: str) -> bool:
    """Whether the built-in model's attention runs rapidtrain's short-sequence kernel (models/attention.py's
    short_attention) in training: --attention-backend auto on a CPU, in bf16 over at most SHORT_KERNEL_MAX_KEYS keys
    or with attention dropout (models/attention_backends.py's short_kernel_runs). Under
    context parallelism only Ulysses (a2a) calls it, over the whole sequence; the ring computes its own blocks and
    all-gathered keys outnumber the local queries. `model` is the whole sequence's."""
    cp = layout.context_parallel_size
    if cp > 1 and layout.cp_comm_type != "a2a":
        return False
    return short_kernel_runs(model.attention_kernel, device_type, precision.dtype, model.seq_length,
                             model.seq_length, model.attention_dropout > 0, model.position_embedding_type == "alibi",
                             model.softmax_type != "vanilla")


def with_peak(memory: MemoryEstimate, model: ModelConfig, micro: int, micro_batches: int, layout: Layout,
              recompute: RecomputeSettings, act: ActivationContext) -> MemoryEstimate:
    """`memory` with each pipeline stage's model states and activations, and the largest rank's peak."""
    activations = stage_activation_bytes(model, micro, micro_batches, layout, act, recompute)
    shares = stage_parameter_shares(model, layout.pipeline_parallel_size, layout.layers_per_rank(model.num_layers)
                                    if layout.stage_layers else None, layout.head_rank())
    # What the engine holds per stage where it is known (FSDP2's gathered parameters), else in proportion.
    engine = memory.engine_bytes_by_stage or tuple(memory.engine_bytes * share for share in shares)
    # FSDP2 accumulates whole gradients until the last micro-batch's backward reduce-scatters them (measured: the
    # last of two pipeline stages held them beside its second micro-batch's activations).
    accumulated = memory.accumulated_grad_bytes if micro_batches > 1 else 0.0
    states = [(memory.total_bytes - memory.engine_bytes + accumulated) * share + held
              for share, held in zip(shares, engine, strict=True)]
    # OSS's ranks hold different optimizer shares: the peak is the largest's.
    uneven = max(memory.optimizer_bytes_by_rank) - memory.optimizer_bytes \
        if memory.optimizer_bytes_by_rank and not memory.optimizer_on_cpu else 0.0
    peak = max(state + kept for state, kept in zip(states, activations, strict=True)) + uneven
    return dataclasses.replace(memory, stage_state_bytes=tuple(states), stage_activation_bytes=tuple(activations),
                               peak_bytes_per_rank=peak)


def auto_micro_batch_size(args: argparse.Namespace, layout: Layout, model: ModelConfig, memory: MemoryEstimate,
                          recompute: RecomputeSettings, act: ActivationContext) -> tuple[int, str]:
    """The largest micro batch (at most --micro-batch-size) dividing global / data-parallel whose largest rank
    (model states + activations of the micro-batches its pipeline stage keeps in flight, under the layout's tensor,
    sequence and context parallelism and recompute) fits --memory-budget-gb; 1 when none fits (the rules refuse
    that case). Context parallelism of size c leaves each rank s/c tokens of every sequence (with its K/V exchange
    buffers, config/activations.py), so a larger micro batch fits; its ranks share their samples, so the data-
    parallel size that divides the global batch is world / (TP·PP·CP). Returns it and the arithmetic in words."""
    per_rank = (args.global_batch_size or args.micro_batch_size * layout.data_parallel_size) \
        // layout.data_parallel_size
    budget = args.memory_budget_gb * 2**30

    def peak(micro: int) -> MemoryEstimate:
        return with_peak(memory, model, micro, per_rank // micro, layout, recompute, act)

    fitting = [m for m in range(min(args.micro_batch_size, per_rank), 0, -1)
               if per_rank % m == 0 and peak(m).peak_bytes_per_rank <= budget]
    micro = fitting[0] if fitting else 1
    chosen = peak(micro)
    stage = max(range(len(chosen.stage_state_bytes)),
                key=lambda i: chosen.stage_state_bytes[i] + chosen.stage_activation_bytes[i])
    where = f" (pipeline stage {stage}, the largest)" if layout.pipeline_parallel_size > 1 else ""
    c = layout.context_parallel_size
    if c > 1:
        where += (f" with {model.seq_length // c:,} of each sequence's {model.seq_length:,} tokens (context parallel "
                  f"{c}, {layout.cp_comm_type} exchange)")
    return micro, (f"--auto-micro-batch-size: {micro}, the largest divisor of {per_rank} (global / data parallel) "
                   f"up to --micro-batch-size {args.micro_batch_size} whose largest rank{where} holds model state "
                   f"{mib_text(chosen.stage_state_bytes[stage])} + activations "
                   f"{mib_text(chosen.stage_activation_bytes[stage])} (estimate, recompute {recompute.granularity}) "
                   f"= {mib_text(chosen.peak_bytes_per_rank)} within --memory-budget-gb {args.memory_budget_gb:g}")


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


def bucket_warnings(args: argparse.Namespace, memory: MemoryEstimate | None) -> list[str]:
    """DeepSpeed ZeRO-1/2 allocates its reduce buckets at --zero-reduce-bucket-size elements whatever the model
    (500 million by default, two with --zero-overlap-comm): a bucket larger than the model's whole gradient never
    fills, and its memory is spent for nothing."""
    stage = zero_stage(args)
    if memory is None or stage not in (1, 2) or zero_by_fsdp2(args) or not args.zero_contiguous_gradients:
        return []
    if args.zero_reduce_bucket_size <= memory.parameters:
        return []
    buckets = 2 if args.zero_overlap_comm else 1
    return [f"--zero-reduce-bucket-size {args.zero_reduce_bucket_size:,}: DeepSpeed's reduce bucket holds more "
            f"gradient elements than the model has parameters ({memory.parameters:,}), so it never fills, yet each "
            f"rank allocates {buckets} × {args.zero_reduce_bucket_size:,} elements for it "
            f"(overlap_comm {args.zero_overlap_comm}); --zero-reduce-bucket-size {memory.parameters} is enough"]


def optimizer_state_bytes_per_parameter(model: ModelConfig, settings: OptimizerSettings, device_type: str) -> float:
    """The chosen implementation's state per parameter, from the model's real tensor shapes (Adafactor's
    factored rows and columns, 8-bit blocks and the small tensors they leave in fp32)."""
    from rapidtrain.optim.optimizers import resolve_optimizer
    from rapidtrain.optim.state_bytes import optimizer_state_bytes

    shapes = parameter_shape_counts(model)
    total = sum(math.prod(shape) * count for shape, count in shapes.items())
    if settings.name == "muon":  # Muon: one fp32 momentum per matrix element; AdamW: two moments and a step
        from rapidtrain.optim.muon import muon_parameter_counts
        from rapidtrain.optim.state_bytes import FP32, SCALAR

        (_, muon_elements), (adamw_tensors, adamw_elements) = muon_parameter_counts(model)
        return (FP32 * muon_elements + 2 * FP32 * adamw_elements + SCALAR * adamw_tensors) / max(total, 1)
    return optimizer_state_bytes(resolve_optimizer(settings, device_type).state, shapes) / max(total, 1)


# Beyond this many parameter tensors OSS's partition is not simulated (the average stands): a model of that many
# tensors has layers enough that any one tensor is a sliver of a rank's share.
OSS_SIMULATED_TENSORS = 1_000_000


def oss_optimizer_bytes_by_rank(model: ModelConfig, kind: StateKind, data_parallel: int) -> tuple[float, ...]:
    """Each data-parallel rank's optimizer state under --oss-memory-optimization, or () when not simulated.

    ZeroRedundancyOptimizer gives whole tensors to ranks by torch's own rule: each parameter group's tensors,
    largest first, each to the rank holding the fewest elements so far (the lowest rank on a tie); a rank keeps
    the state of its own tensors. A large word embedding makes one rank's share far above the average (GPT-2
    small on 8 ranks: the embedding alone is 2.5 times an even share)."""
    import heapq

    from rapidtrain.models.counting import parameter_order, parameter_shapes
    from rapidtrain.optim.state_bytes import shared_state_bytes, tensor_state_bytes

    if sum(parameter_shapes(model).values()) > OSS_SIMULATED_TENSORS:
        return ()
    decay: list[tuple[int, ...]] = []
    no_decay: list[tuple[int, ...]] = []  # optim/optimizers.py's param_groups: norms and biases
    for shape, role in parameter_order(model):
        (no_decay if role in ("vector", "expert_bias") else decay).append(shape)
    filled = [(0, rank) for rank in range(data_parallel)]  # (elements so far, rank): a heap
    state = [float(shared_state_bytes(kind))] * data_parallel
    for group in (decay, no_decay):
        for shape in sorted(group, key=lambda shape: -math.prod(shape)):  # stable, as torch's sort
            elements, rank = heapq.heappop(filled)
            state[rank] += tensor_state_bytes(kind, shape)
            heapq.heappush(filled, (elements + math.prod(shape), rank))
    return tuple(state)


def parameter_shape_counts(model: ModelConfig) -> dict[tuple[int, ...], int]:
    """How many parameter tensors of each shape the built-in model has (from its settings: nothing is built, so a
    plan of 10^8 layers answers at once and the plan needs no torch)."""
    from rapidtrain.models.counting import parameter_shapes

    shapes = parameter_shapes(model)
    if any(math.prod(shape) * 4 >= 2**63 for shape in shapes):
        raise UserError(f"--hidden-size {model.hidden_size} (vocabulary "
                        f"{model.vocab_size}): a weight matrix of this model has more elements than a tensor can "
                        "address (2^63 bytes). Give sizes a device can hold (GPT-3 175B uses --hidden-size "
                        "12288).")
    return shapes


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
    by_rank: tuple[float, ...] = ()
    # Model state is partitioned over the ranks that reduce gradients together: data × context parallel.
    one_model_per_rank = layout.data_context_parallel_size == layout.world_size and layout.expert_parallel_size == 1
    # (--decoupled-lr splits the embedding and output into groups of their own: not simulated, the average stands)
    # (FairScale's OSS assigns tensors in order, not largest first: not simulated either)
    engine_name = (switches or switches_of(args, layout, ctx)).partitioning_engine
    oss = engine_name == "zero-redundancy"
    if oss and one_model_per_rank and layout.data_context_parallel_size > 1 and settings.decoupled is None:
        from rapidtrain.optim.optimizers import resolve_optimizer

        kind = resolve_optimizer(settings, ctx.device_type).state
        by_rank = oss_optimizer_bytes_by_rank(model, kind, layout.data_context_parallel_size)
    # DeepSpeed's optimizer steps an fp32 copy of this rank's partition, beside the model's weights even in fp32.
    optimizer = state + (4 if deepspeed else 0)
    n = layout.data_context_parallel_size
    shard_optimizer = stage > 0 or args.oss_memory_optimization or args.oss_sdp_memory_optimization \
        or args.fsdp_memory_optimization
    # In 3D mode ZeRO-1/2 is FSDP2 over the data-parallel dimension, which reduce-scatters gradients (ZeRO-2 memory).
    shard_grads = stage >= 2 or (stage == 1 and not deepspeed) or args.oss_sdp_memory_optimization \
        or args.fsdp_memory_optimization
    # Under expert parallelism FSDP2 shards the expert slices over the ranks holding the same experts, if at all;
    # OSS leaves them whole on each rank (see _expert_partitioning_note).
    fsdp2 = args.oss_sdp_memory_optimization or args.fsdp_memory_optimization or (stage in (1, 2) and not deepspeed)
    # FSDP2 stores every unit's parameters sharded, whether or not it reshards them after forward (its gathered
    # copies are counted apart: fsdp2_gathered_bytes).
    shard_params = stage == 3 or fsdp2
    # Data parallelism beside tensor parallelism is composable replicate() (parallel/data_parallel.py): FSDP2's
    # machinery, which accumulates whole gradients apart from .grad as FSDP2 does (measured under TP 2 and, before
    # pipeline stages took DDP, PP 2).
    replicated = not deepspeed and not fsdp2 and engine_name != "fairscale" and layout.tensor_parallel_size > 1
    sharded = fsdp2 and experts_sharded_by_fsdp2(layout, expert_second_dims(model))
    expert_ranks = n // layout.expert_parallel_size if sharded else 1
    engine_by_stage: tuple[float, ...] = ()
    if deepspeed:
        engine = deepspeed_engine_bytes(args, model, stage, n, weight, grad)
    elif fsdp2 and n > 1:
        engine_by_stage = fsdp2_gathered_bytes(model, layout, precision, args.fsdp_memory_optimization, sharded)
        engine = sum(engine_by_stage) / len(engine_by_stage)
    elif replicated and n > 1:
        # replicate() wraps the whole model (or stage) as one root unit: its "unsharded" fp32 parameters are a copy
        # of the replicated ones, made at the first forward and kept to the end of backward (measured). Experts
        # stay out of it.
        engine = 4.0 * shared
    else:
        engine = 0.0

    def per_rank(nbytes: float, sharded: bool) -> float:
        return shared * nbytes / (n if sharded else 1) + own_experts * nbytes / (expert_ranks if sharded else 1)

    return MemoryEstimate(
        parameters=int(shared + own_experts), total_params=total, active_params=active,
        param_bytes=per_rank(weight, shard_params), grad_bytes=per_rank(grad, shard_grads),
        engine_bytes=engine, engine_bytes_by_stage=engine_by_stage,
        accumulated_grad_bytes=4 * (shared + own_experts) if (fsdp2 or replicated) and n > 1 else 0.0,
        optimizer_bytes=per_rank(optimizer, shard_optimizer), optimizer_bytes_by_rank=by_rank,
        optimizer_on_cpu=bool(args.cpu_offload or args.nvme_offload_dir),
        params_offloaded="nvme" if args.nvme_offload_dir else "cpu" if args.cpu_offload_params else "none",
    )


def fsdp2_gathered_bytes(model: ModelConfig, layout: Layout, precision: Precision, resharded: bool,
                         experts_sharded: bool) -> tuple[float, ...]:
    """The whole parameters FSDP2 all-gathers beside its shards at the peak (the loss), per pipeline stage: the root
    unit's (embeddings on the first stage; final norm and head on the last) in fp32 from the first forward to the
    end of backward; the blocks' in their MixedPrecisionPolicy dtype (parallel/data_parallel.py), under
    --fsdp-memory-optimization only the block being computed (each is resharded after its forward), otherwise (SDP,
    ZeRO-1/2 through FSDP2) every block of the stage, kept from its forward to its backward. Expert slices count
    when FSDP2 shards them, in fp32 (their units have no MixedPrecisionPolicy); tensor parallelism gathers only its
    own slices."""
    from rapidtrain.models.counting import count_parameters, expert_parameter_count

    total = count_parameters(model)[0]
    root = count_parameters(dataclasses.replace(model, num_layers=0, num_experts=()))[0]
    experts = expert_parameter_count(model)
    layers = max(model.num_layers, 1)
    block_bytes = 4 if precision.dtype == "fp32" else 2
    block = (total - root - experts) / layers * block_bytes
    block += experts / layout.expert_parallel_size / layers * 4 if experts_sharded else 0.0
    held = block * (1 if resharded else model.num_layers / layout.pipeline_parallel_size)
    p = layout.pipeline_parallel_size
    embedding, head = edge_parameters(model)
    edges = [float(root)] if p == 1 else [float(embedding)] + [0.0] * (p - 2) + [float(head)]
    return tuple((edge * 4 + held) / layout.tensor_parallel_size for edge in edges)


def deepspeed_engine_bytes(args: argparse.Namespace, model: ModelConfig, stage: int, data_parallel: int,
                           weight: int, grad: int) -> float:
    """Bytes of weights (`weight` each) and gradients (`grad` each) a DeepSpeed ZeRO rank keeps beyond the ZeRO
    paper's share (TP = PP = 1, so the model is whole here), by DeepSpeed's design, on a GPU as on a CPU:
    - ZeRO-1/2 with contiguous gradients stage the gradients in reduce buckets of --zero-reduce-bucket-size
      elements, two with --zero-overlap-comm (double buffering), from the first gradient of backward (when nearly
      all activations are still kept) to its end: 2 × 500 million elements by default, 2 GB in 16-bit;
    - ZeRO-2 keeps the whole gradient of every parameter its partition of the flattened model touches: the
      partition (total / N) plus the two tensors straddling its ends, at most the two largest (the word
      embedding when it spans partitions: then the ranks it spans each hold all of its gradient), capped at the
      whole model;
    - ZeRO-3 keeps parameters of at most --zero-stage3-param-persistence-threshold elements whole on every rank
      (besides their partition), keeps one reduce bucket for the whole run, and at the peak (the loss) holds
      the gathered head, the largest tensor (its prefetch of the next modules is left out: at most
      --zero-stage3-prefetch-bucket-size elements, not in flight at the loss)."""
    sizes = [(math.prod(shape), count) for shape, count in parameter_shape_counts(model).items()]
    total = sum(size * count for size, count in sizes)
    largest = sorted((size for size, count in sizes for _ in range(min(count, 2))), reverse=True)
    if stage == 3:
        persistent = sum(size * count for size, count in sizes
                         if size <= args.zero_stage3_param_persistence_threshold)
        gathered = persistent + largest[0] if data_parallel > 1 else 0
        return gathered * weight + args.zero_reduce_bucket_size * grad
    buckets = (2 if args.zero_overlap_comm else 1) * args.zero_reduce_bucket_size if args.zero_contiguous_gradients \
        else 0
    partition = total / data_parallel
    touched = min(total, partition + sum(largest[:2])) - partition if stage == 2 else 0.0
    return (buckets + touched) * grad


def experts_sharded_by_fsdp2(layout: Layout, second_dims: tuple[int, ...]) -> bool:
    """Under FSDP2 (FSDP, SDP, ZeRO-1/2 through FSDP2) with expert parallelism, whether the expert slices are
    fully_shard-ed over the ranks holding the same experts (torchtitan's way), on their second dimension
    (`second_dims`: the experts' hidden and FFN sizes; dimension 0 is expert parallelism's).

    Not when no other rank holds them (data parallel = EP: nothing to shard), nor under tensor parallelism,
    where they are replicated DTensors on the tensor-parallel mesh, nor when a second dimension does not
    divide evenly (FSDP2 splits only dimension 0 unevenly): they then stay out of FSDP2 and are all-reduced
    over their group."""
    holders = layout.data_context_parallel_size // layout.expert_parallel_size  # the expert_dp ranks
    return (layout.expert_parallel_size > 1 and layout.tensor_parallel_size == 1 and holders > 1
            and all(size % holders == 0 for size in second_dims))


def expert_second_dims(model: ModelConfig | None) -> tuple[int, ...]:
    """The experts' second dimensions (w1, w_gate, b2: hidden; w2, b1, b_gate: FFN); () when the model is not known."""
    return (model.hidden_size, model.ffn_size) if model is not None else ()


def mib_text(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"
