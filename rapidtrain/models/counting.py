"""Parameter and FLOP counts of the built-in models from their settings alone (no model is built),
for the plan's memory estimate and the log line's TFLOP/s."""

from __future__ import annotations

from collections import Counter

from rapidtrain.models.config import ModelConfig


def _linear(fan_in: int, fan_out: int, bias: bool = True) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def _norm(config: ModelConfig, size: int | None = None) -> int:
    """A LayerNorm has a weight and a bias, an RMSNorm a weight only."""
    return (size or config.hidden_size) * (1 if config.normalization == "RMSNorm" else 2)


def _expert_parameters(config: ModelConfig) -> int:
    """One expert (or the dense MLP): fc1 and fc2 (and the SwiGLU gate), with biases unless disabled."""
    h, f, bias = config.hidden_size, config.ffn_size, config.add_bias_linear
    matrices = 3 if config.swiglu else 2
    return matrices * h * f + ((2 if config.swiglu else 1) * f + h if bias else 0)


def _attention_parameters(config: ModelConfig) -> int:
    h, d = config.hidden_size, config.head_dim
    queries, keys = d * config.num_attention_heads, d * config.query_groups
    qk_norms = 2 * _norm(config, d) if config.qk_layernorm else 0  # shared by the heads: head_dim-sized
    return (
        _linear(h, queries, config.qkv_bias)
        + 2 * _linear(h, keys, config.qkv_bias)
        + _linear(queries, h, config.add_bias_linear)
        + qk_norms
    )


def _embedding_and_head_parameters(config: ModelConfig) -> int:
    h, vocab = config.hidden_size, config.vocab_size
    count = vocab * h + _norm(config)  # word embeddings + final norm (post-norm: the embedding norm instead)
    if config.position_embedding_type == "learned_absolute":
        count += config.max_position_embeddings * h
    if config.embed_layernorm:
        count += 2 * h  # BLOOM's LayerNorm on the word embeddings (weight and bias, whatever --normalization)
    count += config.num_tokentypes * h
    if not config.tie_embeddings:
        count += vocab * h  # the output layer's own weight; tied, the embedding counts once
    if config.model_type == "bert":
        count += _linear(h, h) + _norm(config) + vocab  # MLM head: dense, norm, decoder bias
        if config.bert_binary_head:
            count += _linear(h, h) + _linear(h, 2)  # pooler, binary head
    return count


def _layers_by_experts(config: ModelConfig) -> dict[int, int]:
    """{experts per layer (0 = dense): how many layers}: layers of one kind count alike, so counts take time
    per kind, not per layer (`rapidtrain plan --num-layers 100000000` answers at once)."""
    if not config.num_experts:
        return {0: config.num_layers}
    return dict(Counter(config.num_experts))


def _layer_parameters_of_kind(config: ModelConfig, experts: int) -> tuple[int, int]:
    """(total, active) parameters of one layer with `experts` experts (0: dense MLP)."""
    shared = 2 * _norm(config) + _attention_parameters(config)
    if not experts:
        mlp = _expert_parameters(config)
        return shared + mlp, shared + mlp
    router = config.hidden_size * experts
    total = shared + router + experts * _expert_parameters(config)
    active = shared + router + config.moe_router_topk * _expert_parameters(config)
    return total, active


def expert_parameter_count(config: ModelConfig) -> int:
    """Parameters of all MoE layers' experts (not routers): what expert parallelism shards."""
    experts = sum(kind * layers for kind, layers in _layers_by_experts(config).items())
    return experts * _expert_parameters(config)


def count_parameters(config: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters; active counts only the top-k experts of each MoE layer.

    Equals `sum(p.numel() for p in build_model(config).parameters())` for the total.
    """
    shared = _embedding_and_head_parameters(config)
    total = active = shared
    for kind, layers in _layers_by_experts(config).items():
        layer_total, layer_active = _layer_parameters_of_kind(config, kind)
        total, active = total + layers * layer_total, active + layers * layer_active
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
      MoE layer                        k experts per token: k · that, plus the router 2·N·h·E
      logits                           2·N·h·V
      BERT heads                       MLM dense 2·N·h², pooler 2·B·h², binary head 2·B·h·2
    Dense GPT with f = 4h: forward = 24·N·L·h² + 2·N·L·s·h + 2·N·h·V
      = 24·B·s·L·h²·(1 + s/(12h) + V/(12·L·h)); times 3 for forward + backward is Megatron's 72·(...).
    Capacity padding and dropped tokens are not counted: the routed top-k work is.
    """
    s = seq_length or config.seq_length
    b, h, f = global_batch_size, config.hidden_size, config.ffn_size
    tokens = b * s
    inner = config.head_dim * config.num_attention_heads
    groups = config.head_dim * config.query_groups
    projections = 2 * 2 * tokens * h * inner + 2 * 2 * tokens * h * groups
    forward = 2 * tokens * h * config.vocab_size + _score_flops(config, tokens, s, inner)
    for experts, layers in _layers_by_experts(config).items():
        mlp = (3 if config.swiglu else 2) * 2 * tokens * h * f
        if experts:
            mlp = config.moe_router_topk * mlp + 2 * tokens * h * experts
        forward += layers * (projections + mlp)
    if config.model_type == "bert":
        forward += 2 * tokens * h * h
        if config.bert_binary_head:
            forward += 2 * b * h * h + 2 * b * h * 2
    return 3 * forward


def _score_flops(config: ModelConfig, tokens: int, s: int, inner: int) -> int:
    """Q·Kᵀ and probs·V of every layer: 2 · 2 FLOPs per query, key and head dimension, with the keys a query sees
    on average: s (BERT), s/2 (causal), w - w²/2s with a sliding window w < s (the first w queries see fewer)."""
    if config.model_type != "gpt":
        return 4 * tokens * s * inner * config.num_layers
    window = config.sliding_window
    full = config.num_layers
    if window is not None and window < s:
        full = config.num_layers // config.window_skip_freq if config.window_skip_freq else 0
    windowed_keys = 0.0 if window is None else window - window * window / (2 * s)
    return int(4 * tokens * inner * (full * s / 2 + (config.num_layers - full) * windowed_keys))


def gpt_flops_per_iteration(config: ModelConfig, global_batch_size: int) -> int:
    """FLOPs per iteration under the name Megatron's logging uses; see model_flops_per_iteration."""
    return model_flops_per_iteration(config, global_batch_size)
