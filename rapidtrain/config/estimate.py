"""The plan as a performance model: the expected seconds per iteration of a layout on a known GPU, and where
they go (GEMMs, memory-bound element-wise work, tensor-parallel collectives, the pipeline bubble, pipeline
sends, data-parallel collectives, the optimizer step).

One iteration on the slowest pipeline stage (the last: it also runs the head):
  (m + (p - 1)/v) × one micro-batch's time on a stage      the 1F1B pipeline with its bubble (p - 1)/(v·m)
  + data-parallel gradient collectives, not overlapped      as Megatron-LM (2021) reduces after backward
  + the optimizer step, bound by memory bandwidth
A micro-batch's time on a stage: its GEMM FLOPs at GEMM_EFFICIENCY of the 16-bit peak, its element-wise work as
NON_GEMM_PASSES passes over the activation bytes a layer keeps (Korthikanti et al.'s count) at the memory
bandwidth, the tensor-parallel all-reduces (sequence parallelism's all-gather and reduce-scatter move the same
bytes) over NVLink, and the activations sent to the next stage over InfiniBand.

Calibrated: GEMM_EFFICIENCY alone, on Narayanan et al. 2021's Table 1 (A100); the test reproduces each row within
±15%. Other GPUs are assumed to reach the same share of their peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rapidtrain.config.activations import ActivationContext, layer_bytes
from rapidtrain.config.settings import Layout, Plan, RecomputeSettings, StepEstimate
from rapidtrain.core.devices import DeviceSpec, device_spec, known_device_names
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.counting import model_flops_per_iteration

GEMM_EFFICIENCY = 0.62  # share of the 16-bit peak a large GEMM reaches (fitted to Narayanan et al.: rows within ±9%)
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


def layer_forward_flops(model: ModelConfig, tokens: int, experts: int = 0) -> float:
    """One layer's forward GEMM FLOPs for `tokens` tokens, the attention square computed whole (as kernels
    without causal block skipping do; Narayanan et al.'s count)."""
    h, f, s = model.hidden_size, model.ffn_size, model.seq_length
    inner, kv = model.head_dim * model.num_attention_heads, model.head_dim * model.query_groups
    projections = 2 * tokens * h * (2 * inner + 2 * kv)
    scores = 4 * tokens * s * inner
    mlp = (3 if model.gated_linear_unit else 2) * 2 * tokens * h * f
    if experts:
        mlp = model.moe_router_topk * mlp + 2 * tokens * h * experts
    return projections + scores + mlp


def recompute_flops(model: ModelConfig, tokens: int, granularity: str) -> float:
    """Extra forward work backward does: the whole layer (full), the attention core (selective)."""
    if granularity == "full":
        return layer_forward_flops(model, tokens)
    if granularity == "selective":
        return 4 * tokens * model.seq_length * model.head_dim * model.num_attention_heads
    return 0.0


def all_reduce_seconds(nbytes: float, ranks: int, gb_per_s: float) -> float:
    """A ring all-reduce: each rank sends and receives 2·(n - 1)/n of the bytes."""
    return 2 * (ranks - 1) / ranks * nbytes / (gb_per_s * 1e9) if ranks > 1 else 0.0


def micro_batch_seconds(inputs: StepInputs, spec: DeviceSpec) -> dict[str, float]:
    """One micro-batch's forward and backward on the last pipeline stage (its layers and the head), per part."""
    model, layout = inputs.model, inputs.layout
    t, p, cp = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.context_parallel_size
    whole = model
    if cp > 1:  # a context-parallel rank computes its part of the sequence (its queries over every key: ~1/CP)
        model = dataclasses.replace(model, seq_length=model.seq_length // cp)
    tokens = inputs.micro_batch_size * model.seq_length
    layers = model.num_layers // p
    kinds = list(model.num_experts[-layers:]) if model.num_experts else [0] * min(layers, 1)
    layer_flops = sum(layer_forward_flops(model, tokens, e) for e in kinds) / len(kinds)
    recomputed = len(inputs.recompute.layers_of(layers)) if inputs.recompute.enabled else 0
    flops = (3 * layers * layer_flops + recomputed * recompute_flops(model, tokens, inputs.recompute.granularity)
             + 3 * 2 * tokens * model.hidden_size * model.vocab_size) / t
    act = ActivationContext.of(model, inputs.dtype, "cuda")
    kept = layer_bytes(model, inputs.micro_batch_size, layout, act)
    element = 4 if inputs.dtype == "fp32" else 2
    intra = spec.intra_node_gb_per_s if t <= spec.gpus_per_node else spec.inter_node_gb_per_s
    reductions = 4 + (2 if inputs.recompute.granularity == "full" else 0)  # per layer: 2 forward, 2 backward
    tp = layers * reductions * all_reduce_seconds(tokens * model.hidden_size * element, t, intra)
    expert_layers = sum(1 for e in kinds if e) * layers / len(kinds)
    ep = layout.expert_parallel_size
    a2a = expert_layers * 4 * (ep - 1) / ep * tokens * model.hidden_size * element * model.moe_router_topk \
        / (spec.intra_node_gb_per_s * 1e9) if ep > 1 else 0.0
    sends = 2 * tokens * model.hidden_size * element / t / (spec.inter_node_gb_per_s * 1e9) if p > 1 else 0.0
    return {"GEMMs": flops / (spec.peak_tflops_16bit * 1e12 * GEMM_EFFICIENCY),
            "element-wise (memory-bound)": NON_GEMM_PASSES * layers * kept / (spec.hbm_gb_per_s * 1e9),
            "tensor-parallel collectives": tp, "expert all-to-all": a2a, "pipeline sends": sends,
            "context-parallel exchange": context_parallel_seconds(whole, inputs, layers, element, spec)}


def context_parallel_seconds(model: ModelConfig, inputs: StepInputs, layers: int, element: int,
                             spec: DeviceSpec) -> float:
    """Per micro-batch, the attention exchange of a context-parallel rank's layers, forward and backward, at the
    intra-node link (not overlapped with compute): p2p and allgather move the other ranks' K/V (and their gradients
    back), a2a four all-to-alls of Q, K, V and the output each way."""
    layout = inputs.layout
    cp, t = layout.context_parallel_size, layout.tensor_parallel_size
    if cp == 1:
        return 0.0
    tokens = inputs.micro_batch_size * model.seq_length  # the whole sequence's
    kv = 2 * model.head_dim * model.query_groups
    if layout.cp_comm_type == "a2a":
        moved = 2 * (cp - 1) / cp * tokens / cp * (2 * model.head_dim * model.num_attention_heads + kv)
    else:
        moved = 2 * (cp - 1) / cp * tokens * kv
    return layers * moved * element / t / (spec.intra_node_gb_per_s * 1e9)


def data_parallel_seconds(inputs: StepInputs, spec: DeviceSpec) -> float:
    """Gradient all-reduce (ZeRO-1/2, OSS, SDP: reduce-scatter + all-gather, the same bytes; ZeRO-3 and FSDP
    gather the parameters once more for backward) over NVLink when the group fits a node, else InfiniBand."""
    layout = inputs.layout
    d = layout.data_context_parallel_size  # context-parallel ranks reduce gradients with the data-parallel ones
    within_node = d * layout.tensor_parallel_size <= spec.gpus_per_node
    bandwidth = spec.intra_node_gb_per_s if within_node else spec.inter_node_gb_per_s
    seconds = all_reduce_seconds(inputs.params_per_rank * inputs.grad_bytes, d, bandwidth)
    return seconds * (1.5 if inputs.partitioning in ("zero-3", "fsdp") else 1.0)


def estimate_step(inputs: StepInputs, spec: DeviceSpec) -> StepEstimate:
    layout, model = inputs.layout, inputs.model
    p, v, m = layout.pipeline_parallel_size, layout.virtual_pipeline_stages, inputs.micro_batches
    per_micro = micro_batch_seconds(inputs, spec)
    micro = sum(per_micro.values())
    parts = [(name, m * seconds) for name, seconds in per_micro.items() if seconds]
    if p > 1:
        parts.append((f"pipeline bubble (p - 1)/(v·m) = {p - 1}/({v}·{m})", (p - 1) / v * micro))
    parts.append(("data-parallel collectives", data_parallel_seconds(inputs, spec)))
    parts.append(("optimizer step", 2 * inputs.state_bytes_per_rank / (spec.hbm_gb_per_s * 1e9)))
    seconds = sum(part for _, part in parts)
    model_flops = model_flops_per_iteration(model, inputs.global_batch_size)
    tflops = model_flops / seconds / layout.world_size / 1e12
    hardware = hardware_flops(inputs) / seconds / layout.world_size / 1e12
    return StepEstimate(spec.name, seconds, tflops, tflops / spec.peak_tflops_16bit, hardware,
                        tuple((name, part) for name, part in parts if part > 0), assumptions(spec))


def hardware_flops(inputs: StepInputs) -> float:
    """GEMM FLOPs one iteration runs on all ranks, recomputation included."""
    model, tokens = inputs.model, inputs.global_batch_size * inputs.model.seq_length
    kinds = list(model.num_experts) or [0] * model.num_layers
    layers = sum(3 * layer_forward_flops(model, tokens, e) for e in kinds)
    share = len(inputs.recompute.layers_of(model.num_layers // inputs.layout.pipeline_parallel_size)) \
        / max(model.num_layers // inputs.layout.pipeline_parallel_size, 1) if inputs.recompute.enabled else 0
    extra = share * model.num_layers * recompute_flops(model, tokens, inputs.recompute.granularity)
    return layers + extra + 3 * 2 * tokens * model.hidden_size * model.vocab_size


def assumptions(spec: DeviceSpec) -> tuple[str, ...]:
    return (f"{spec.name}: {spec.peak_tflops_16bit:g} TFLOP/s dense 16-bit peak, {spec.hbm_gb_per_s:,.0f} GB/s "
            f"memory, {spec.link_names}, {spec.gpus_per_node} GPUs per node",
            f"GEMMs at {GEMM_EFFICIENCY:.0%} of peak (one constant, fitted to Narayanan et al. 2021's A100 table)",
            f"element-wise work: {NON_GEMM_PASSES} passes over the activation bytes each layer keeps",
            "collectives: ring all-reduce at the link's bandwidth, not overlapped with compute; data loading, "
            "kernel launches and stragglers not counted")
