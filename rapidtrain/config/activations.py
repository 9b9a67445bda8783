"""Activation memory per rank and per pipeline stage before anything is built, after Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models").

Their count per transformer layer, in bytes of 16-bit tensors with 1-byte dropout masks, is s·b·h·(34 + 5·a·s/h):
  attention  11·s·b·h + 5·a·s²·b   input 2, Q and K 4, V 2, output projection's input 2, dropout mask 1;
                                   softmax output 2·a·s²·b, its dropout mask a·s²·b, the dropped scores 2·a·s²·b
  MLP        19·s·b·h              input 2, first linear's output 8, the activation's output 8, dropout mask 1
  two norms   4·s·b·h              their inputs
Written here in elements so it holds for any precision and shape: 16 tensors of s·b·h elements (for h = a·d, no
grouped-query attention and ffn = 4h) plus two masks, and 3 score tensors of a·s²·b when the attention kernel
keeps its scores. Under tensor parallelism of size t the Q/K/V, scores and MLP parts are split (24/t of the 34); the
norms' inputs, the masks and the two blocks' inputs (10 of them) are split only with sequence parallelism.
Selective recompute drops the scores; full recompute keeps the layer's input alone (2·s·b·h, split by t under
sequence parallelism). The last stage keeps the final norm's and head's inputs and the fp32 log-softmax of the
loss (4·s·b·V/t with a vocab-parallel loss), with the logits beside it at the peak; the first keeps the embedding
dropout's mask.

Pipelining: under 1F1B stage i keeps min(p - i, m) micro-batches in flight (stage 0 holds p: the pipeline depth);
the interleaved schedule keeps 2·(p - i - 1) + (v - 1)·p + 1 model chunks of L/(p·v) layers, which for stage 0 is
p micro-batches × (1 + (p - 1)/(p·v)).
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidtrain.config.settings import Layout, RecomputeSettings
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.loss_blocks import block_size


@dataclass(frozen=True)
class ActivationContext:
    """What decides the bytes besides the model and layout: element size, whether dropout keeps masks and how big,
    whether the attention kernel keeps its s × s scores."""

    element_bytes: int  # 2 for fp16/bf16 activations, 4 for fp32
    mask_bytes: int  # a dropout mask element: 1 on CUDA (bool), the input's size on a CPU (measured)
    hidden_dropout: bool
    scores_kept: bool  # eager attention, or SDPA's math path (a CPU with attention dropout); flash kernels keep none
    chunked_loss: bool = False  # head and loss computed together in chunks (models/chunked_loss.py)
    device_type: str = "cpu"  # the chunks' size depends on it

    @staticmethod
    def of(model: ModelConfig, dtype: str, device_type: str) -> ActivationContext:
        element = 4 if dtype == "fp32" else 2
        mask = 1 if device_type == "cuda" else element
        scores = model.attention_kernel == "eager" or (device_type == "cpu" and model.attention_dropout > 0)
        return ActivationContext(element, mask, model.hidden_dropout > 0, scores, device_type=device_type)


def layer_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext,
                granularity: str = "none", experts: int = 0) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank."""
    s, h, b = model.seq_length, model.hidden_size, micro
    t = layout.tensor_parallel_size
    split_all = t if layout.sequence_parallel else 1
    e = act.element_bytes
    if granularity == "full":
        return s * b * h * e / split_all
    kv = model.head_dim * model.query_groups
    inner = model.head_dim * model.num_attention_heads
    # fc1 and activation outputs (SwiGLU: + gate, product)
    mlp_width: float = (4 if model.swiglu else 2) * model.ffn_size
    if experts:  # top-k routed copies of each token fill capacity buffers
        mlp_width *= model.moe_router_topk * max(model.moe_capacity_factor, 1.0)
    masks = 2 * act.mask_bytes * h if act.hidden_dropout else 0
    replicated = (4 * h) * e + masks  # two norms' inputs, attention and MLP inputs, two dropout masks
    split: float = (2 * inner + 2 * kv + mlp_width) * e  # Q, K, V, attention output, the MLP's wide tensors
    if granularity == "op":  # rapidtrain's op-level policy keeps matmul, attention and collective outputs
        split = (2 * inner + 2 * kv + mlp_width / 2 + 2 * h) * e
        replicated = h * e
    per_token = replicated / split_all + split / t
    scores = 0.0
    if act.scores_kept and granularity not in ("selective", "op"):
        heads = model.num_attention_heads
        scores = heads * s * s * b * (2 * e + (act.mask_bytes if model.attention_dropout > 0 else 0)) / t
    return s * b * per_token + scores


def head_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext) -> float:
    """The last stage's: final norm's and head's inputs, the loss's fp32 log-softmax (vocab-parallel under TP), and
    the logits themselves, alive beside it while the loss is computed (measured: the peak is there)."""
    s, h, b, t = model.seq_length, model.hidden_size, micro, layout.tensor_parallel_size
    norms = 2 * s * b * h * act.element_bytes / (t if layout.sequence_parallel else 1)
    if act.chunked_loss:  # no fp32 log-softmax: the logits alone, kept when 16-bit or when one chunk holds them all
        block = block_size(model.vocab_size, s * b, act.device_type)
        kept = act.element_bytes <= 2 or block >= model.vocab_size
        # CUDA's blocks are large (models/chunked_loss.py): one block's fp32 logits are alive beside the kept ones
        # (estimated from the code, not yet measured on a GPU); a CPU's 32 MiB block is within the estimate's error.
        transient = 4 * s * b * block if act.device_type == "cuda" else 0
        return norms + (act.element_bytes * s * b * model.vocab_size if kept else 0) + transient
    return norms + (4 + act.element_bytes) * s * b * model.vocab_size / t


def embedding_bytes(model: ModelConfig, micro: int, layout: Layout, act: ActivationContext) -> float:
    """The first stage's: the embedding dropout's mask."""
    if not act.hidden_dropout:
        return 0.0
    split = layout.tensor_parallel_size if layout.sequence_parallel else 1
    return model.seq_length * micro * model.hidden_size * act.mask_bytes / split


def chunks_in_flight(stage: int, layout: Layout, micro_batches: int) -> float:
    """Model chunks whose activations stage `stage` holds at its peak, in units of the stage's whole layers
    (one micro-batch through all of them = 1)."""
    p, v = layout.pipeline_parallel_size, layout.virtual_pipeline_stages
    if v <= 1:
        return min(p - stage, micro_batches)
    chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, micro_batches * v)
    return chunks / v


def stage_activation_bytes(model: ModelConfig, micro: int, micro_batches: int, layout: Layout,
                           act: ActivationContext, recompute: RecomputeSettings) -> list[float]:
    """Activation bytes at each pipeline stage's peak, on one rank of it."""
    p = layout.pipeline_parallel_size
    per_stage = model.num_layers // p
    recomputed = len(recompute.layers_of(per_stage)) if recompute.enabled else 0
    stages = []
    for stage in range(p):
        if model.num_experts:  # layer kinds differ: count each layer (MoE models have tens of layers)
            kinds = model.num_experts[stage * per_stage:(stage + 1) * per_stage]
            layers = sum(layer_bytes(model, micro, layout, act, recompute.granularity if i < recomputed else "none",
                                     experts) for i, experts in enumerate(kinds))
        else:  # dense: two kinds at most, counted by arithmetic (a plan of 10^8 layers answers at once)
            layers = recomputed * layer_bytes(model, micro, layout, act, recompute.granularity) \
                + (per_stage - recomputed) * layer_bytes(model, micro, layout, act)
        total = chunks_in_flight(stage, layout, micro_batches) * layers
        if stage == 0:
            total += min(p, micro_batches) * embedding_bytes(model, micro, layout, act)
        if stage == p - 1:
            total += head_bytes(model, micro, layout, act)
        stages.append(total)
    return stages
