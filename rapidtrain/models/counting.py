"""Parameter and FLOP counts of the built-in models from their settings alone (no model is built),
for the plan's memory estimate and the log line's TFLOP/s."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Literal

from rapidtrain.models.config import ModelConfig

Shape = tuple[int, ...]
# A parameter tensor's role: a matrix (weight decay), a vector (a norm's or a bias: no weight decay), or one of the
# experts' stacked tensors (sharded by expert parallelism): "expert" matrices, "expert_bias" vectors.
Role = Literal["matrix", "vector", "expert", "expert_bias"]
Tensors = list[tuple[Shape, Role]]


def _linear(fan_in: int, fan_out: int, bias: bool = True) -> Tensors:
    """nn.Linear's weight [out, in] and bias [out]."""
    weight: Tensors = [((fan_out, fan_in), "matrix")]
    return weight + ([((fan_out,), "vector")] if bias else [])


def _norm(config: ModelConfig, size: int | None = None, layer_norm: bool = False) -> Tensors:
    """A LayerNorm has a weight and a bias, an RMSNorm a weight only (`layer_norm`: a LayerNorm whatever
    --normalization, as BLOOM's embedding norm)."""
    size = size or config.hidden_size
    return [((size,), "vector")] * (1 if config.normalization == "RMSNorm" and not layer_norm else 2)


def _mlp(config: ModelConfig, ffn_size: int | None = None) -> Tensors:
    """The dense MLP: fc1 (and the gated unit's gate) h → f, fc2 f → h, with biases unless disabled (`ffn_size`:
    another f, as the shared experts')."""
    h, f, bias = config.hidden_size, ffn_size or config.ffn_size, config.add_bias_linear
    return _linear(h, f, bias) * (2 if config.gated_linear_unit else 1) + _linear(f, h, bias)


def _experts(config: ModelConfig, experts: int) -> Tensors:
    """The experts of one MoE layer as stacked tensors, expert first, in Experts' order: w1 [E, h, f], (gated: w_gate
    [E, h, f],) b1 [E, f], (gated: b_gate [E, f],) w2 [E, f, h], b2 [E, h] (no biases with --disable-bias-linear);
    f the routed experts' size."""
    h, f, e, bias = config.hidden_size, config.expert_ffn_size, experts, config.add_bias_linear
    gated = 2 if config.gated_linear_unit else 1
    tensors: Tensors = [((e, h, f), "expert")] * gated
    tensors += [((e, f), "expert_bias")] * gated if bias else []
    return tensors + [((e, f, h), "expert")] + ([((e, h), "expert_bias")] if bias else [])


def _latent_attention(config: ModelConfig) -> Tensors:
    """Multi-head latent attention's, in its modules' order: q_proj, or q_down, its norm and q_up; kv_down, its norm,
    kv_up; o_proj (the norms with --qk-layernorm; only o_proj has a bias)."""
    h, heads, rank = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
    query, rope = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim), config.qk_pos_emb_head_dim
    norms = config.qk_layernorm
    if config.q_lora_rank is None:
        tensors = _linear(h, query, bias=False)
    else:
        q_rank = config.q_lora_rank
        tensors = _linear(h, q_rank, False) + (_norm(config, q_rank) if norms else []) + _linear(q_rank, query, False)
    tensors += _linear(h, rank + rope, False) + (_norm(config, rank) if norms else [])
    tensors += _linear(rank, heads * (config.qk_head_dim + config.v_head_dim), False)
    return tensors + _linear(heads * config.v_head_dim, h, config.add_bias_linear)


def _attention(config: ModelConfig) -> Tensors:
    if config.multi_latent_attention:
        return _latent_attention(config)
    h, d = config.hidden_size, config.head_dim
    queries, keys = d * config.num_attention_heads, d * config.query_groups
    tensors = _linear(h, queries, config.qkv_bias) + 2 * _linear(h, keys, config.qkv_bias)
    tensors += _linear(queries, h, config.add_bias_linear)
    tensors += 2 * _norm(config, d) if config.qk_layernorm else []  # shared by the heads: head_dim-sized
    return tensors + ([((config.num_attention_heads,), "vector")] if config.softmax_type == "learnable" else [])


def _embedding(config: ModelConfig) -> Tensors:
    """The embedding module's: words, BLOOM's LayerNorm on them, positions, token types, post-norm's norm."""
    h = config.hidden_size
    tensors: Tensors = [((config.vocab_size, h), "matrix")]
    if config.embed_layernorm:
        tensors += _norm(config, layer_norm=True)
    if config.position_embedding_type == "learned_absolute":
        tensors.append(((config.max_position_embeddings, h), "matrix"))
    if config.num_tokentypes:
        tensors.append(((config.num_tokentypes, h), "matrix"))
    return tensors + (_norm(config) if config.post_layernorm else [])


def _head(config: ModelConfig) -> Tensors:
    """After the layers: the final norm (pre-norm models), the output weight when untied (tied, the embedding counts
    once), BERT's masked-LM head (dense, norm, decoder) and its pooler and binary head."""
    h, vocab = config.hidden_size, config.vocab_size
    tensors: Tensors = [] if config.post_layernorm else _norm(config)
    output: Tensors = [] if config.tie_embeddings else [((vocab, h), "matrix")]
    if config.model_type != "bert":
        return tensors + output
    tensors += _linear(h, h) + _norm(config) + output + [((vocab,), "vector")]
    return tensors + (_linear(h, h) + _linear(h, 2) if config.bert_binary_head else [])


def _layers_by_experts(config: ModelConfig) -> dict[int, int]:
    """{experts per layer (0 = dense): how many layers}: layers of one kind count alike, so counts take time
    per kind, not per layer (`rapidtrain plan --num-layers 100000000` answers at once)."""
    if not config.num_experts:
        return {0: config.num_layers}
    return dict(Counter(config.num_experts))


def _layer(config: ModelConfig, experts: int) -> Tensors:
    """One transformer layer's, in its modules' order: ln1, attention, ln2, then the dense MLP, or the router, the
    experts, (PR-MoE) the residual MLP and its two mixing coefficients, and the shared experts (and their gate)."""
    tensors = _norm(config) + _attention(config) + _norm(config)
    if not experts:
        return tensors + _mlp(config)
    router: Tensors = _linear(config.hidden_size, experts, config.moe_router_bias)
    tensors += router + _experts(config, experts)
    tensors += _mlp(config) + _linear(config.hidden_size, 2) if config.moe_residual else []
    shared = config.moe_shared_expert_intermediate_size
    if shared:
        tensors += _mlp(config, shared) + (_linear(config.hidden_size, 1, bias=False)
                                           if config.moe_shared_expert_gate else [])
    return tensors


def _mtp_depth(config: ModelConfig) -> Tensors:
    """One multi-token prediction depth's (models/mtp.py): its two input norms, the [h, 2h] projection, a layer of
    the last layer's kind and its final norm."""
    h = config.hidden_size
    return (_norm(config) * 2 + _linear(2 * h, h, bias=False)
            + _layer(config, config.experts_in_layer(config.num_layers - 1)) + _norm(config))


def _mtp(config: ModelConfig) -> Tensors:
    return _mtp_depth(config) * config.mtp_num_layers if config.model_type == "gpt" else []


def layer_shapes(config: ModelConfig, experts: int) -> tuple[list[Shape], list[Shape]]:
    """(shared, expert) parameter shapes of one layer with `experts` experts (0: a dense MLP, no expert shapes)."""
    tensors = _layer(config, experts)
    return ([shape for shape, role in tensors if not role.startswith("expert")],
            [shape for shape, role in tensors if role.startswith("expert")])


def parameter_order(config: ModelConfig) -> Iterator[tuple[Shape, Role]]:
    """Every parameter tensor of the built-in model in `model.parameters()` order (tied weights once), with its role:
    what an optimizer's parameter groups and ZeroRedundancyOptimizer's partition see. One entry per tensor: for a
    model of 10^8 layers use parameter_shapes."""
    yield from _embedding(config)
    for layer in range(config.num_layers):
        yield from _layer(config, config.experts_in_layer(layer))
    yield from _head(config)
    yield from _mtp(config)


def _outside_layers(config: ModelConfig) -> list[Shape]:
    """Outside the transformer layers: embedding, head and multi-token prediction's depths (their experts'
    share is added to expert_parameter_count apart)."""
    return [shape for shape, _ in _embedding(config) + _head(config) + _mtp(config)]


def parameter_shapes(config: ModelConfig) -> dict[Shape, int]:
    """How many parameter tensors of each shape the built-in model has, from its settings alone (no model is
    built; a test compares it with the built model's parameters over the space of settings)."""
    counts: Counter[Shape] = Counter(_outside_layers(config))
    for experts, layers in _layers_by_experts(config).items():
        for shape, _ in _layer(config, experts):
            counts[shape] += layers
    return dict(counts)


def _elements(shapes: list[Shape]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def expert_parameter_count(config: ModelConfig) -> int:
    """Parameters of all MoE layers' experts (not routers): what expert parallelism shards."""
    mtp_experts = [shape for shape, role in _mtp(config) if role.startswith("expert")]
    return _elements(mtp_experts) + sum(layers * _elements(layer_shapes(config, experts)[1])
                                        for experts, layers in _layers_by_experts(config).items())


def pipeline_unit_parameters(config: ModelConfig) -> tuple[int, list[int], int, int]:
    """(embedding, each transformer layer, final norm, output matrix) parameters, as DeepSpeed's `parameters`
    partitioning weighs Megatron-DeepSpeed's layer list (a tied head is an EmbeddingPipe of its own, counted again)."""
    def elements(tensors: Tensors) -> int:
        return _elements([shape for shape, _ in tensors])

    kinds = {experts: elements(_layer(config, experts)) for experts in _layers_by_experts(config)}
    embedding = elements(_embedding(config))
    return (embedding, [kinds[config.experts_in_layer(i)] for i in range(config.num_layers)], elements(_norm(config)),
            embedding if config.tie_embeddings else config.vocab_size * config.hidden_size)


def count_parameters(config: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters; active counts only the top-k experts of each MoE layer.

    Equals `sum(p.numel() for p in build_model(config).parameters())` for the total.
    """
    total = active = _elements(_outside_layers(config))
    last = config.experts_in_layer(config.num_layers - 1) if config.mtp_num_layers and config.num_layers else 0
    if last and config.model_type == "gpt":  # the depths' MoE layers: only the top k of their experts are active
        depth_experts = _elements(layer_shapes(config, last)[1])
        active -= config.mtp_num_layers * (depth_experts - config.moe_router_topk * depth_experts // last)
    for experts, layers in _layers_by_experts(config).items():
        shared, stacked = layer_shapes(config, experts)
        one_expert = _elements(stacked) // experts if experts else 0
        total += layers * (_elements(shared) + _elements(stacked))
        active += layers * (_elements(shared) + config.moe_router_topk * one_expert)
    return total, active


def megatron_gpt_flops(
    global_batch_size: int, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int
) -> float:
    """Megatron's closed form for a dense GPT with ffn = 4h: 72·B·s·L·h²·(1 + s/(12h) + V/(12·L·h))."""
    b, s, layers, h, v = global_batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 72 * b * s * layers * h**2 * (1 + s / (12 * h) + v / (12 * layers * h))


def model_flops_per_iteration(
    config: ModelConfig, global_batch_size: int, seq_length: int | None = None
) -> int:
    """Matmul FLOPs of one iteration's forward and backward (backward = 2 × forward; recomputation
    for activation checkpointing is not counted, as Megatron's model FLOPs).

    Forward, with N = B·s tokens, a = heads·head_dim (= h unless --kv-channels), g = query groups·head_dim (= a without
    grouped-query attention), f = ffn size, 2 FLOPs per multiply-add:
      q and o projections, k and v     2 · 2·N·h·a + 2 · 2·N·h·g        = 8·N·h²  (g = a = h)
      scores Q·Kᵀ and probs·V          2 · 2·N·s·a, halved for causal GPT (only the lower triangle
                                       is needed)                        = 2·N·s·h  (GPT), 4·N·s·h (BERT)
                                       (a sliding window w: 2 · 2·N·a·(w - w²/2s) in its layers)
      dense MLP fc1 + fc2              2 · 2·N·h·f                      = 16·N·h² for f = 4h
                                       (SwiGLU: 3 · 2·N·h·f, the gate is a third matrix)
      multi-head latent attention      2·N·in·out for each of its matrices (q_proj or q_down + q_up,
                                       kv_down, kv_up, o_proj); scores over heads·(qk + rotary) dims,
                                       probs·V over heads·v_head_dim
      MoE layer                        k experts per token: k · that (with the experts' f), plus the router
                                       2·N·h·E, the shared experts (a dense MLP of their f) and their gate 2·N·h,
                                       PR-MoE's dense MLP and coefficients 2·N·h·2
      logits                           2·N·h·V
      multi-token prediction           per depth: the [h, 2h] projection 2·N·2h·h, a layer of the last layer's
                                       kind (scores as one layer's), the logits again
      BERT heads                       MLM dense 2·N·h², pooler 2·B·h², binary head 2·B·h·2
    Dense GPT with f = 4h: forward = 24·N·L·h² + 2·N·L·s·h + 2·N·h·V
      = 24·B·s·L·h²·(1 + s/(12h) + V/(12·L·h)); times 3 for forward + backward is Megatron's 72·(...).
    Capacity padding and dropped tokens are not counted: the routed top-k work is.
    """
    s = seq_length or config.seq_length
    b, h, f = global_batch_size, config.hidden_size, config.ffn_size
    tokens = b * s
    inner: float = config.head_dim * config.num_attention_heads
    groups = config.head_dim * config.query_groups
    projections = 2 * 2 * tokens * h * int(inner) + 2 * 2 * tokens * h * groups
    if config.multi_latent_attention:
        projections, inner = _latent_attention_flops(config, tokens)
    forward = 2 * tokens * h * config.vocab_size + _score_flops(config, tokens, s, inner)
    matrices = 3 if config.gated_linear_unit else 2

    def layer(experts: int) -> int:
        mlp = matrices * 2 * tokens * h * f
        if experts:
            shared = config.moe_shared_expert_intermediate_size or 0
            mlp = (config.moe_router_topk * matrices * 2 * tokens * h * config.expert_ffn_size
                   + 2 * tokens * h * experts + matrices * 2 * tokens * h * shared
                   + (2 * tokens * h if shared and config.moe_shared_expert_gate else 0)
                   + (mlp + 2 * tokens * h * 2 if config.moe_residual else 0))
        return projections + mlp

    for experts, layers in _layers_by_experts(config).items():
        forward += layers * layer(experts)
    if config.mtp_num_layers and config.model_type == "gpt":  # each depth: [h, 2h] projection, a layer, the head
        one_layer_scores = _score_flops(config, tokens, s, inner) // max(config.num_layers, 1)
        depth = (2 * tokens * 2 * h * h + layer(config.experts_in_layer(config.num_layers - 1)) + one_layer_scores
                 + 2 * tokens * h * config.vocab_size)
        forward += config.mtp_num_layers * depth
    if config.model_type == "bert":
        forward += 2 * tokens * h * h
        if config.bert_binary_head:
            forward += 2 * b * h * h + 2 * b * h * 2
    return 3 * forward


def _latent_attention_flops(config: ModelConfig, tokens: int) -> tuple[int, float]:
    """Multi-head latent attention's projection FLOPs per layer (every matrix of _latent_attention, 2·N·in·out), and
    the width its scores count with: Q·Kᵀ over heads·(qk_head_dim + qk_pos_emb_head_dim), probs·V over
    heads·v_head_dim, so _score_flops's 4·N·keys·width takes their mean."""
    matrices = [shape for shape, role in _latent_attention(config) if role == "matrix"]
    projections = sum(2 * tokens * shape[0] * shape[1] for shape in matrices)
    heads = config.num_attention_heads
    width = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim) / 2
    return projections, width


def _score_flops(config: ModelConfig, tokens: int, s: int, inner: float) -> int:
    """Q·Kᵀ and probs·V of every layer: 2 · 2 FLOPs per query, key and head dimension, with the keys a query sees
    on average: s (BERT), s/2 (causal), w - w²/2s with a sliding window w < s (the first w queries see fewer)."""
    if config.model_type != "gpt":
        return int(4 * tokens * s * inner * config.num_layers)
    window = config.sliding_window
    full = config.num_layers
    if window is not None and window < s:
        full = config.num_layers // config.window_skip_freq if config.window_skip_freq else 0
    windowed_keys = 0.0 if window is None else window - window * window / (2 * s)
    return int(4 * tokens * inner * (full * s / 2 + (config.num_layers - full) * windowed_keys))


def gpt_flops_per_iteration(config: ModelConfig, global_batch_size: int) -> int:
    """FLOPs per iteration under the name Megatron's logging uses; see model_flops_per_iteration."""
    return model_flops_per_iteration(config, global_batch_size)


# Rows per expert group are rounded up to a multiple of at least this many where the grouped matmuls run oneDNN's
# per-shape kernels (16-bit on a CPU: models/moe.py's `pads_expert_groups`, `bucketed_counts`).
GROUP_ROWS_MULTIPLE = 32


def padded_rows(assignments: int, num_experts: int, multiple: int = GROUP_ROWS_MULTIPLE) -> int:
    """Rows that hold every bucketed group of `assignments` rows over `num_experts` experts (a static bound, no host
    read of the counts): Σ (bucketed - count) ≤ Σ max(multiple, count / 8). The grouped experts' buffers have this
    many rows, so the plan counts them (config/activations.py's `routed_rows_per_token`)."""
    return assignments + assignments // 8 + num_experts * multiple
