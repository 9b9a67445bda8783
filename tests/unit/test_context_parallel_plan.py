"""Context parallelism (Layout.context_parallel_size, Layout.cp_comm_type: p2p ring, allgather, a2a = Ulysses) in
the plan's memory and step-time estimates, on Layouts built directly (the flags are the cp branch's):
activations per rank divided by the sequence split, the exchange's buffers by comm type, the exchange's time over
the link the context group spans, gradients reduced over data × context ranks, and --auto-micro-batch-size."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rapidtrain.config.activations import ActivationContext, stage_activation_bytes
from rapidtrain.config.estimate import (
    StepInputs,
    context_exchange_seconds,
    data_parallel_seconds,
    estimate_step,
    micro_batch_seconds,
)
from rapidtrain.config.memory import auto_micro_batch_size, with_peak
from rapidtrain.config.settings import Layout, MemoryEstimate, RecomputeSettings
from rapidtrain.core.devices import device_spec
from rapidtrain.models.config import ModelConfig

# head_dim 16, 2 key/value heads
MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=64,
                    max_position_embeddings=64, vocab_size=128, swiglu=True, hidden_dropout=0.0,
                    attention_dropout=0.0, attention_kernel="sdpa_flash")
BF16 = ActivationContext.of(MODEL, "bf16", "cuda")
H100 = device_spec("NVIDIA H100 80GB HBM3")
NONE = RecomputeSettings()


def layout(world: int, data: int, tensor: int = 1, context: int = 1, comm: str = "p2p") -> Layout:
    return Layout(world, data, tensor, sequence_parallel=tensor > 1, context_parallel_size=context, cp_comm_type=comm)


def test_stage_peak_falls_with_the_sequence_split_and_the_ring_holds_least():
    """Each rank keeps its s/c tokens of every layer (config/activations.py counts a context-parallel rank's model,
    the exchange's buffers by comm type in context_parallel_bytes, measured in tests/distributed/
    test_memory_estimate.py); a small vocabulary so the layers, not the loss, make the peak."""
    model = dataclasses.replace(MODEL, seq_length=256, max_position_embeddings=256, vocab_size=32)
    whole = stage_activation_bytes(model, 2, 1, layout(1, 1), BF16, NONE)[0]
    peaks = {comm: stage_activation_bytes(model, 2, 1, layout(4, 1, context=4, comm=comm), BF16, NONE)[0]
             for comm in ("p2p", "allgather", "a2a")}
    # the gathering exchanges keep the whole sequence's K/V (a2a: Q, K, V and output for heads/c) for backward; the
    # ring keeps only its fp32 output and log-sum-exp beside the local tokens' tensors, never a received block
    # (parallel/context_parallel.py), so it keeps least, and exactly half as much at twice the split
    assert peaks["p2p"] < min(peaks["allgather"], peaks["a2a"]) < whole / 2
    ring_at_2 = stage_activation_bytes(model, 2, 1, layout(2, 1, context=2), BF16, NONE)[0]
    assert ring_at_2 == pytest.approx(2 * peaks["p2p"])
    assert stage_activation_bytes(model, 2, 1, layout(2, 1, context=2, comm="a2a"), BF16, NONE)[0] > peaks["a2a"]


def test_auto_micro_batch_size_counts_the_sequence_split():
    """The same 2 data-parallel replicas, with and without context parallelism 4: the budget that holds a micro
    batch of 2 whole sequences holds a larger one when each rank keeps a quarter of every sequence."""
    memory = MemoryEstimate(parameters=10_000, total_params=10_000, active_params=10_000, param_bytes=40_000,
                            grad_bytes=40_000, optimizer_bytes=80_000)
    plain, split = layout(2, 2), layout(8, 2, context=4, comm="a2a")
    budget = with_peak(memory, MODEL, 2, 8, plain, NONE, BF16).peak_bytes_per_rank
    args = argparse.Namespace(global_batch_size=32, micro_batch_size=16, memory_budget_gb=budget / 2**30)
    micro_plain, _ = auto_micro_batch_size(args, plain, MODEL, memory, NONE, BF16)
    micro_split, words = auto_micro_batch_size(args, split, MODEL, memory, NONE, BF16)
    # each rank keeps 16 of every sequence's 64 tokens (and Ulysses' whole-sequence buffers for a quarter of the
    # heads): a micro batch of 4 fits the budget 2 whole sequences were made for; the next divisor, 8, does not
    assert (micro_plain, micro_split) == (2, 4)
    assert with_peak(memory, MODEL, 4, 4, split, NONE, BF16).peak_bytes_per_rank <= budget
    assert with_peak(memory, MODEL, 8, 2, split, NONE, BF16).peak_bytes_per_rank > budget
    assert "context parallel 4" in words and "16 of each sequence's 64 tokens" in words


def inputs(lay: Layout, model: ModelConfig = MODEL, recompute: RecomputeSettings = NONE) -> StepInputs:
    micro_batches = 8 // lay.data_parallel_size
    return StepInputs(model, lay, 1, micro_batches, 8, "bf16", recompute, "none", 1e6, 2, 18e6)


def test_context_parallelism_splits_a_micro_batchs_work():
    """GEMMs, element-wise work and tensor-parallel all-reduces of a rank follow its s/c tokens (its queries still
    see every key: the scores' FLOPs split by c too)."""
    whole = micro_batch_seconds(inputs(layout(2, 1, tensor=2)), H100)
    split = micro_batch_seconds(inputs(layout(8, 1, tensor=2, context=4)), H100)
    for part in ("GEMMs", "tensor-parallel collectives"):
        assert split[part] == pytest.approx(whole[part] / 4), part
    # the kept bytes' passes: a quarter of the tokens', and the exchange's buffers beside them
    assert whole["element-wise (memory-bound)"] / 4 < split["element-wise (memory-bound)"] < whole[
        "element-wise (memory-bound)"]
    assert whole["context-parallel exchange"] == 0 < split["context-parallel exchange"]


def test_exchange_time_uses_the_link_the_context_group_spans():
    """One key/value head (replicated over tensor ranks): the same bytes whether TP is 4 or 8; TP 4 × CP 2 spans
    one node of 8 (NVLink, 450 GB/s), TP 8 × CP 2 two nodes (InfiniBand, 50 GB/s)."""
    model = dataclasses.replace(MODEL, num_query_groups=1)
    within = context_exchange_seconds(model, 1, layout(8, 1, tensor=4, context=2), 2, "none", H100)
    across = context_exchange_seconds(model, 1, layout(16, 1, tensor=8, context=2), 2, "none", H100)
    assert across / within == pytest.approx(450 / 50)
    # p2p: K/V of the other half of the 64 tokens (16 × 2 elements, 2 bytes) in forward, again in backward, and
    # the dK/dV accumulators all the way around the ring (back to their owners); at 80% of NVLink
    assert within == pytest.approx((2 * 0.5 + 1) * 64 * 2 * 16 * 2 / (450e9 * 0.8))
    recomputed = context_exchange_seconds(model, 1, layout(8, 1, tensor=4, context=2), 2, "full", H100)
    assert recomputed == pytest.approx(within * 5 / 4)  # full recomputation repeats the forward's exchange
    ulysses = context_exchange_seconds(model, 1, layout(8, 1, tensor=4, context=2, comm="a2a"), 2, "none", H100)
    query = 16 * 4 / 4 * 2  # bytes per token of the rank's query heads
    assert ulysses == pytest.approx(2 * 0.5 * 64 / 2 * (2 * query + 2 * 16 * 2) / (450e9 * 0.8))


def test_gradients_reduce_over_data_and_context_ranks():
    """Context-parallel ranks hold the same parameters: DP = world / (TP·PP·CP) replicas, reduced over all 16."""
    assert data_parallel_seconds(inputs(layout(16, 2, context=8)), H100) == pytest.approx(
        data_parallel_seconds(inputs(layout(16, 16)), H100))
    assert data_parallel_seconds(inputs(layout(8, 1, context=8)), H100) > 0


def test_the_estimate_says_the_exchange():
    estimate = estimate_step(inputs(layout(8, 2, context=4, comm="allgather")), H100)
    assert dict(estimate.parts)["context-parallel exchange"] > 0
    assert "context-parallel exchange" not in dict(estimate_step(inputs(layout(2, 2)), H100).parts)
