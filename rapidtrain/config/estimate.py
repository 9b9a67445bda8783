"""The plan as a performance model: the expected seconds per iteration of a layout on a known GPU, and where
they go (GEMMs, memory-bound element-wise work, tensor-parallel collectives, the context-parallel exchange, the
pipeline bubble, pipeline sends, data-parallel collectives, the optimizer step).

One iteration on the slowest pipeline stage (the last: it also runs the head):
  m × (1 + bubble) × one micro-batch's time on a stage     the schedule's bubble (pipeline_split.bubble_fraction:
                                                            1F1B (p - 1)/(v·m), zero bubble a third of it, ...)
  + data-parallel gradient collectives, not overlapped      as Megatron-LM (2021) reduces after backward
  + the optimizer step, bound by memory bandwidth
A micro-batch's time on a stage (its s/c tokens of each sequence under context parallelism c): its GEMM FLOPs at
gemm_efficiency(h/t) of the 16-bit peak, its element-wise work as NON_GEMM_PASSES passes over the activation bytes a
layer keeps (Korthikanti et al.'s count) at the memory bandwidth, the tensor-parallel all-reduces (sequence
parallelism's all-gather and reduce-scatter move the same bytes) and the context-parallel K/V exchange over the
link their group spans, and the activations sent to the next stage over InfiniBand; every link at
COLLECTIVE_EFFICIENCY of its bandwidth.

Calibrated on published runs (published_runs.json; tests/unit/test_published_runs.py prints each one's error):
GEMM_EFFICIENCY and GEMM_HALF_WIDTH are fitted (least maximum error, scripts/calibrate_step_model.py) to
Narayanan et al. 2021's Table 1 (ten A100 runs, 1.7B to 1T), Korthikanti et al. 2022's Table 5 (22B to 1T on
A100, full and selective recomputation) and Llama 3 405B's two 8k-token rows (H100, Table 4 of Meta's paper):
all within 12%. Held out, as checks: MT-NLG 530B (Megatron-DeepSpeed's 2021 pipeline engine: estimated 20-23%
under what it took), BLOOM 176B (within 1%) and Llama 3's 128k-token row under context parallelism 16 (4%
under). COLLECTIVE_EFFICIENCY is not fitted (a free fit drives it to 0.45, far below what NCCL measures,
absorbing what the GEMM constants should): it is NCCL's usual share of the link. Each GPU is assumed to reach the
same share of its own peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rapidtrain.config.activations import ActivationContext, layer_bytes
from rapidtrain.config.pipeline_split import bubble_fraction
from rapidtrain.config.settings import Layout, Plan, RecomputeSettings, StepEstimate
from rapidtrain.core.devices import DeviceSpec, device_spec, known_device_names
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.counting import model_flops_per_iteration

GEMM_EFFICIENCY = 0.77  # share of the 16-bit peak wide GEMMs reach (fitted)
GEMM_HALF_WIDTH = 350.0  # the per-rank hidden width h/t at which GEMMs reach half of GEMM_EFFICIENCY (fitted)
COLLECTIVE_EFFICIENCY = 0.8  # share of a link's bandwidth a ring collective or a send reaches (NCCL's bus
# bandwidth on NVLink and InfiniBand is 75-90% of the link's; not fitted)
REFERENCES = ("Narayanan et al. 2021 Table 1 (A100, 1.7B-1T), Korthikanti et al. 2022 Table 5 (A100, 22B-1T), "
              "Llama 3 405B at 8k tokens (H100)")
NON_GEMM_PASSES = 4  # element-wise traffic per kept activation byte: written and read in forward, read and its
# gradient written in backward (a bound from the kernels' shape, not fitted)


@dataclass(frozen=True)
class StepInputs:
    """What the step time depends on, taken from the Plan (the test of the paper's table states its own)."""

    model: ModelConfig
    layout: Layout
    micro_batch_size: int
    micro_batches: int  # per iteration and data-parallel rank (the accumulation steps)
    global_batch_size: int
    dtype: str
    recompute: RecomputeSettings
    partitioning: str  # none, oss, sdp, fsdp, zero-1/2/3
    params_per_rank: float
    grad_bytes: float  # per parameter, as reduced over data parallelism
    state_bytes_per_rank: float  # model states the optimizer step reads and writes


def inputs_of(plan: Plan) -> StepInputs | None:
    if plan.model is None or plan.memory is None:
        return None
    memory = plan.memory
    return StepInputs(plan.model, plan.layout, plan.batches.micro_batch_size, plan.batches.accumulation_steps,
                      plan.batches.global_batch_size, plan.precision.dtype, plan.switches.recompute,
                      plan.switches.partitioning, memory.parameters,
                      memory.grad_bytes / max(memory.parameters, 1),
                      memory.total_bytes - memory.engine_bytes)  # the step touches no reduce bucket


def plan_estimate(plan: Plan, device_type: str, device_name: str) -> StepEstimate | None:
    """The Plan's step-time estimate on `device_name`, or a StepEstimate saying why there is none."""
    inputs = inputs_of(plan)
    if inputs is None:
        return None
    if device_type != "cuda":
        return StepEstimate(reason="not estimated on a CPU (no table of CPU GEMM and link speeds); plan for GPUs "
                                   f"with --device cuda --device-name NAME ({known_device_names()})")
    spec = device_spec(device_name)
    if spec is None:
        named = repr(device_name) if device_name else "this GPU (give --device-name)"
        return StepEstimate(reason=f"not estimated: {named} is not in the table of GPUs ({known_device_names()})")
    return estimate_step(inputs, spec)


def keys_attended(model: ModelConfig) -> float:
    """Keys each query's kernel computes against: the whole sequence for eager attention, which materializes the
    square (Narayanan et al.'s count) and for BERT; half of it for a causal GPT under flash-style kernels (SDPA,
    cuDNN, flex), which skip the blocks above the diagonal. Under context parallelism a rank's queries still see
    the whole sequence's keys (load-balanced chunks), so this does not change with it."""
    if model.attention_kernel == "eager" or model.model_type != "gpt":
        return float(model.seq_length)
    return model.seq_length / 2


def layer_forward_flops(model: ModelConfig, tokens: float, experts: int = 0) -> float:
    """One layer's forward GEMM FLOPs for `tokens` tokens (a rank's: s/c of each sequence under context
    parallelism), the attention scores over keys_attended."""
    h, f = model.hidden_size, model.ffn_size
    inner, kv = model.head_dim * model.num_attention_heads, model.head_dim * model.query_groups
    projections = 2 * tokens * h * (2 * inner + 2 * kv)
    scores = 4 * tokens * keys_attended(model) * inner
    mlp = (3 if model.gated_linear_unit else 2) * 2 * tokens * h * f
    if experts:
        mlp = model.moe_router_topk * mlp + 2 * tokens * h * experts
    return projections + scores + mlp


def recompute_flops(model: ModelConfig, tokens: float, granularity: str) -> float:
    """Extra forward work backward does: the whole layer (full), the attention core (selective)."""
    if granularity == "full":
        return layer_forward_flops(model, tokens)
    if granularity == "selective":
        return 4 * tokens * keys_attended(model) * model.head_dim * model.num_attention_heads
    return 0.0


def gemm_efficiency(width: float) -> float:
    """The share of the 16-bit peak a layer's GEMMs reach when each rank's slice of the hidden size is `width`
    (h/t): GEMM_EFFICIENCY for wide matrices, less for narrow ones, whose tiles fill fewer of the GPU's
    multiprocessors per wave and spend more of their time loading operands (half of it at GEMM_HALF_WIDTH)."""
    return GEMM_EFFICIENCY * width / (width + GEMM_HALF_WIDTH)


def link_seconds(nbytes: float, gb_per_s: float) -> float:
    """Bytes each rank sends over a link, at the share of its bandwidth collectives reach."""
    return nbytes / (gb_per_s * 1e9 * COLLECTIVE_EFFICIENCY)


def all_reduce_seconds(nbytes: float, ranks: int, gb_per_s: float) -> float:
    """A ring all-reduce: each rank sends and receives 2·(n - 1)/n of the bytes."""
    return link_seconds(2 * (ranks - 1) / ranks * nbytes, gb_per_s) if ranks > 1 else 0.0


def group_bandwidth(spec: DeviceSpec, span: int) -> float:
    """The link a group of ranks `span` GPUs wide in the rank order (tensor ranks innermost, then context, then
    data: Megatron's order) talks over: NVLink when the span fits a node, InfiniBand otherwise."""
    return spec.intra_node_gb_per_s if span <= spec.gpus_per_node else spec.inter_node_gb_per_s


def context_exchange_seconds(model: ModelConfig, micro_batch_size: int, layout: Layout, element: int,
                             recompute: str, spec: DeviceSpec) -> float:
    """One layer's attention exchange for one micro-batch under context parallelism of size c, over the link the
    context group spans (Layout.cp_comm_type):
    - p2p (ring): the other (c - 1)/c of the sequence's K/V in forward, and in backward the K/V again and the dK/dV
      accumulators c steps around the ring (each returns to its block's owner: all of the sequence's);
    - allgather: the other (c - 1)/c of the sequence's K/V in forward, and in backward the K/V again and their
      gradients (reduce-scattered), the count the step-time model was calibrated with (Llama 3's all-gather CP);
    - a2a (Ulysses): all-to-alls of Q, K, V in and the output back, (c - 1)/c of the rank's s/c tokens of each,
      in forward and again in backward.
    Full recomputation runs the forward's exchange once more. Not overlapped with attention (an upper bound for
    the ring, which overlaps in Transformer Engine)."""
    c, t = layout.context_parallel_size, layout.tensor_parallel_size
    if c == 1:
        return 0.0
    share = (c - 1) / c
    kv = 2 * model.head_dim * max(model.query_groups // t, 1) * element  # bytes per token of the rank's K and V
    tokens = micro_batch_size * model.seq_length
    forwards = 2 if recompute == "full" else 1
    if layout.cp_comm_type == "a2a":
        query = model.head_dim * model.num_attention_heads / t * element
        nbytes = (forwards + 1) * share * tokens / c * (2 * query + kv)
    elif layout.cp_comm_type == "allgather":
        nbytes = (forwards + 2) * share * tokens * kv
    else:
        nbytes = (forwards + 1) * share * tokens * kv + tokens * kv
    return link_seconds(nbytes, group_bandwidth(spec, t * c))


def micro_batch_seconds(inputs: StepInputs, spec: DeviceSpec) -> dict[str, float]:
    """One micro-batch's forward and backward on the last pipeline stage (its layers and the head), per part."""
    model, layout = inputs.model, inputs.layout
    t, p = layout.tensor_parallel_size, layout.pipeline_parallel_size
    tokens = inputs.micro_batch_size * model.seq_length / layout.context_parallel_size  # this rank's
    layers = -(-model.num_layers // p)  # the slowest stage has the larger share of an uneven split
    kinds = list(model.num_experts[-layers:]) if model.num_experts else [0] * min(layers, 1)
    layer_flops = sum(layer_forward_flops(model, tokens, e) for e in kinds) / len(kinds)
    recomputed = len(inputs.recompute.layers_of(layers)) if inputs.recompute.enabled else 0
    again = recompute_flops(model, tokens, inputs.recompute.counted_granularity)
    flops = (3 * layers * layer_flops + recomputed * again + 3 * 2 * tokens * model.hidden_size * model.vocab_size) / t
    act = ActivationContext.of(model, inputs.dtype, "cuda")
    # layer_bytes counts a context-parallel rank's model: its part of the sequence (config/activations.py)
    local = dataclasses.replace(model, seq_length=model.seq_length // layout.context_parallel_size)
    kept = layer_bytes(local, inputs.micro_batch_size, layout, act)
    element = 4 if inputs.dtype == "fp32" else 2
    intra = group_bandwidth(spec, t)
    reductions = 4 + (2 if inputs.recompute.counted_granularity == "full" else 0)  # per layer: 2 forward, 2 backward
    tp = layers * reductions * all_reduce_seconds(tokens * model.hidden_size * element, t, intra)
    expert_layers = sum(1 for e in kinds if e) * layers / len(kinds)
    ep = layout.expert_parallel_size
    a2a = link_seconds(expert_layers * 4 * (ep - 1) / ep * tokens * model.hidden_size * element
                       * model.moe_router_topk, spec.intra_node_gb_per_s) if ep > 1 else 0.0
    sends = link_seconds(2 * tokens * model.hidden_size * element / t, spec.inter_node_gb_per_s) if p > 1 else 0.0
    exchange = layers * context_exchange_seconds(model, inputs.micro_batch_size, layout, element,
                                                 inputs.recompute.counted_granularity, spec)
    return {"GEMMs": flops / (spec.peak_tflops_16bit * 1e12 * gemm_efficiency(model.hidden_size / t)),
            "element-wise (memory-bound)": NON_GEMM_PASSES * layers * kept / (spec.hbm_gb_per_s * 1e9),
            "tensor-parallel collectives": tp, "context-parallel exchange": exchange, "expert all-to-all": a2a,
            "pipeline sends": sends}


def data_parallel_seconds(inputs: StepInputs, spec: DeviceSpec) -> float:
    """Gradient all-reduce (ZeRO-1/2, OSS, SDP: reduce-scatter + all-gather, the same bytes; ZeRO-3 and FSDP
    gather the parameters once more for backward) over NVLink when the group fits a node, else InfiniBand. The
    context-parallel ranks hold the same parameters and computed gradients of other tokens, so the reduction runs
    over data × context parallel ranks (DP = world / (TP·PP·CP) replicas, each c ranks wide)."""
    layout = inputs.layout
    ranks = layout.data_parallel_size * layout.context_parallel_size
    bandwidth = group_bandwidth(spec, ranks * layout.tensor_parallel_size)
    seconds = all_reduce_seconds(inputs.params_per_rank * inputs.grad_bytes, ranks, bandwidth)
    return seconds * (1.5 if inputs.partitioning in ("zero-3", "fsdp") else 1.0)


def pipeline_bubble(layout: Layout, micro_batches: int, micro_seconds: float) -> tuple[str, float]:
    """The pipeline's idle time per iteration, in words and seconds: the share of the m micro-batches' time the
    schedule that runs leaves idle (pipeline_split.bubble_fraction: 1F1B over v virtual stages fills and drains
    p - 1 stage-slots of a micro-batch's time divided by v, Narayanan et al. 2021 section 2.2; zero bubble a third)."""
    p, v, m = layout.pipeline_parallel_size, layout.virtual_pipeline_stages, micro_batches
    bubble = bubble_fraction(layout.pipeline_schedule, p, m, v)
    return f"pipeline bubble ({layout.pipeline_schedule}) {bubble:.1%} of {m} micro-batches", bubble * m * micro_seconds


def estimate_step(inputs: StepInputs, spec: DeviceSpec) -> StepEstimate:
    layout, model = inputs.layout, inputs.model
    per_micro = micro_batch_seconds(inputs, spec)
    parts = [(name, inputs.micro_batches * seconds) for name, seconds in per_micro.items() if seconds]
    if layout.pipeline_parallel_size > 1:
        parts.append(pipeline_bubble(layout, inputs.micro_batches, sum(per_micro.values())))
    parts.append(("data-parallel collectives", data_parallel_seconds(inputs, spec)))
    parts.append(("optimizer step", 2 * inputs.state_bytes_per_rank / (spec.hbm_gb_per_s * 1e9)))
    seconds = sum(part for _, part in parts)
    model_flops = model_flops_per_iteration(model, inputs.global_batch_size)
    tflops = model_flops / seconds / layout.world_size / 1e12
    hardware = hardware_flops(inputs) / seconds / layout.world_size / 1e12
    return StepEstimate(spec.name, seconds, tflops, tflops / spec.peak_tflops_16bit, hardware,
                        tuple((name, part) for name, part in parts if part > 0),
                        assumptions(spec, model.hidden_size / layout.tensor_parallel_size))


def hardware_flops(inputs: StepInputs) -> float:
    """GEMM FLOPs one iteration runs on all ranks, recomputation included."""
    model, tokens = inputs.model, inputs.global_batch_size * inputs.model.seq_length
    kinds = list(model.num_experts) or [0] * model.num_layers
    layers = sum(3 * layer_forward_flops(model, tokens, e) for e in kinds)
    stage = model.num_layers // inputs.layout.pipeline_parallel_size
    share = len(inputs.recompute.layers_of(stage)) / max(stage, 1) if inputs.recompute.enabled else 0
    extra = share * model.num_layers * recompute_flops(model, tokens, inputs.recompute.counted_granularity)
    return layers + extra + 3 * 2 * tokens * model.hidden_size * model.vocab_size


def assumptions(spec: DeviceSpec, width: float) -> tuple[str, ...]:
    return (f"{spec.name}: {spec.peak_tflops_16bit:g} TFLOP/s dense 16-bit peak, {spec.hbm_gb_per_s:,.0f} GB/s "
            f"memory, {spec.link_names}, {spec.gpus_per_node} GPUs per node",
            f"GEMMs at {gemm_efficiency(width):.0%} of peak for a hidden slice of {width:g} per rank "
            f"({GEMM_EFFICIENCY:.0%} × w/(w + {GEMM_HALF_WIDTH:g}), fitted to {REFERENCES}; published_runs.json "
            "lists each run and its error)",
            f"element-wise work: {NON_GEMM_PASSES} passes over the activation bytes each layer keeps",
            f"collectives and sends at {COLLECTIVE_EFFICIENCY:.0%} of the link's bandwidth, not overlapped with "
            "compute; data loading, kernel launches and stragglers not counted")
