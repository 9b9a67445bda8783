"""Settings of the built-in transformer models: the model's own part of the plan, nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ModelConfig:
    """Shape and regularisation of a built-in GPT or BERT.

    `vocab_size` is already padded (a multiple of make-vocab-size-divisible-by × TP), so every
    layout builds the same embedding table. `num_experts` has one entry per layer: 0 is a dense MLP.
    The defaults are GPT-2's architecture; Llama's is RMSNorm, SwiGLU, rope, no biases, untied
    output, with `num_query_groups` < heads for grouped-query attention.
    """

    model_type: Literal["gpt", "bert"] = "gpt"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None: 4 × hidden_size
    seq_length: int = 128
    max_position_embeddings: int = 128
    vocab_size: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    position_embedding_type: Literal["learned_absolute", "rope", "alibi"] = "learned_absolute"
    rotary_base: float = 10000
    tie_embeddings: bool = True
    bert_binary_head: bool = False
    num_tokentypes: int = 0  # BERT: 2 when the binary head is on
    num_experts: tuple[int, ...] = field(default_factory=tuple)  # per layer; empty: all dense
    moe_router_topk: int = 1
    moe_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = True
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0
    moe_jitter_eps: float = 0.0
    # Fine-grained MoE (DeepSeek, Qwen-MoE; Megatron-Core's flag names). Scores: softmax (renormalised over the k
    # chosen when k > 1, unless `moe_router_pre_softmax`) or sigmoid (normalised over the k chosen when k > 1).
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False  # softmax over all experts, the k chosen keep their probabilities as they are
    moe_router_topk_scaling_factor: float | None = None  # the combine weights times this (DeepSeek's routed scaling)
    moe_router_num_groups: int | None = None  # group-limited routing: experts in this many equal groups ...
    moe_router_group_topk: int | None = None  # ... of which each token may use the best this many
    moe_router_force_load_balancing: bool = False  # benchmarking: random router logits (Megatron-Core's)
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias added for selection only
    moe_router_bias_update_rate: float = 1e-3  # ... moved by this much per step towards the mean load
    # the balancing loss over the micro-batch or per sequence; or Sinkhorn routing (balanced choice, no loss)
    moe_aux_loss_type: Literal["aux_loss", "seq_aux_loss", "sinkhorn"] = "aux_loss"
    moe_ffn_hidden_size: int | None = None  # each routed expert's hidden size; None: ffn_size
    moe_shared_expert_intermediate_size: int | None = None  # all shared experts together (one MLP); None: none
    moe_shared_expert_gate: bool = False  # Qwen-MoE: the shared experts' output times sigmoid(Linear(h, 1)(x))
    # Multi-token prediction (DeepSeek-V3, --mtp-num-layers): depths predicting 2, 3, ... tokens ahead (mtp.py).
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1

    # Llama-family switches (Megatron's flag names); the defaults keep GPT-2's architecture.
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    swiglu: bool = False  # gated MLP: fc2(silu(gate(x)) * fc1(x)), experts too
    num_query_groups: int | None = None  # key/value heads; None: one per attention head (no GQA)
    add_bias_linear: bool = True  # biases of every linear layer (--disable-bias-linear turns them off)
    add_qkv_bias: bool = False  # biases of q/k/v only, when add_bias_linear is off (Qwen2)
    rotary_percent: float = 1.0  # share of each head's dimensions that rope rotates
    rotary_interleaved: bool = False  # --rotary-interleaved: rope rotates pairs (2i, 2i + 1), not (i, i + r/2)
    openai_gelu: bool = False  # GELU's tanh approximation (GPT-2's gelu_new)
    post_layernorm: bool = False  # original BERT order: x = norm(x + f(x)), normed embeddings, no final norm
    hf_weights: str | None = None  # a Hugging Face folder whose weights replace the seeded initial values
    moe_residual: bool = False  # PR-MoE: each MoE layer adds a dense MLP mixed in by learned coefficients
    # --attention-backend's kernel (models/attention_backends.py)
    attention_kernel: Literal["auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "eager", "flex"] = "auto"
    # Qwen3 / OLMo 2 attention: head size apart from hidden / heads, and a norm on each head's queries and keys.
    kv_channels: int | None = None  # --kv-channels; None: hidden_size / num_attention_heads
    qk_layernorm: bool = False  # --qk-layernorm: --normalization over head_dim, one weight shared by all heads
    # Rope scaling: Llama 3.1's frequency-dependent one (--use-rope-scaling; the other three numbers are Megatron's
    # fixed values, Hugging Face's llama3 rope_parameters) and linear position interpolation.
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"
    rope_scaling_factor: float = 8.0  # llama3's factor, or YaRN's (--rotary-scaling-factor)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192  # llama3's, or YaRN's --yarn-original-max-position-embeddings
    # YaRN (--rope-type yarn, Peng et al. 2023, Megatron's flags): frequencies ramped between plain and divided by the
    # factor over the pairs that turn between beta_slow and beta_fast times in the original context; cos/sin scaled by
    # mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim), mscale(s, m) = 0.1 m ln s + 1.
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_round_range: bool = True  # --yarn-correction-range-round-to-int: the ramp's ends rounded to whole pairs
    rotary_interpolation_factor: float = 1.0  # --rotary-seq-len-interpolation-factor: positions / factor
    # BLOOM's switches: a LayerNorm on the word embeddings (--embed-layernorm); ALiBi is position_embedding_type.
    embed_layernorm: bool = False
    # Sliding-window attention (GPT only): each query sees at most the last `sliding_window` keys, itself included
    # (Hugging Face's sliding_window; Megatron's --window-size L,0 is L + 1). Every `window_skip_freq`-th layer
    # (1-based, Megatron's --window-attn-skip-freq) attends to the whole sequence instead; 0: none does.
    sliding_window: int | None = None
    window_skip_freq: int = 0
    # Multi-head Latent Attention (DeepSeek-V2/V3, --multi-latent-attention, models/mla.py): queries through a rank
    # q_lora_rank bottleneck (None: one projection), keys and values from a kv_lora_rank latent, each head's query/key
    # an unrotated part of qk_head_dim and a rotated part of qk_pos_emb_head_dim (the rotated key shared by all heads),
    # values of v_head_dim. With --qk-layernorm the two latents get a --normalization norm (DeepSeek's RMSNorms).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # gpt-oss's switches (Megatron-Core's names). Attention sinks (--softmax-type): off-by-one adds 1 to the softmax
    # denominator, learnable adds exp(a per-head learned logit), as an extra key with a zero value would.
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    # The gated MLP's gate activation: SwiGLU's silu, or with --quick-geglu x·sigmoid(1.702x) (gpt-oss); the gate
    # clamped above and the linear half to ±clamp (--activation-func-clamp-value), the linear half plus
    # glu_linear_offset (--glu-linear-offset; gpt-oss: 1).
    quick_geglu: bool = False
    activation_clamp: float | None = None
    squared_relu: bool = False  # --squared-relu: an MLP without a gate activates relu(x)² instead of GELU
    glu_linear_offset: float = 0.0
    # A bias on the router's logits (Megatron-Core's router with --add-bias-linear, gpt-oss's router); the default
    # router is DeepSpeed-MoE's, bias-free.
    moe_router_bias: bool = False

    @property
    def gated_linear_unit(self) -> bool:
        """A gated MLP (a third matrix, the gate): --swiglu or --quick-geglu."""
        return self.swiglu or self.quick_geglu

    @property
    def ffn_size(self) -> int:
        """--ffn-hidden-size, else 4h, or with SwiGLU Megatron's 2/3 of that rounded down to a multiple of 64
        (the same parameters as a 4h GELU MLP)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    @property
    def architecture(self) -> str:
        """The model in words, for the plan: built-in GPT (GPT-2-style / Llama-family) or BERT."""
        if self.model_type == "bert":
            kind = "built-in BERT" + (" (post-LN, original BERT order)" if self.post_layernorm else "")
        elif self.normalization == "RMSNorm" and self.swiglu and self.position_embedding_type == "rope":
            kind = "built-in GPT (DeepSeek-family)" if self.multi_latent_attention else "built-in GPT (Llama-family)"
        elif self.normalization == "LayerNorm" and not self.swiglu and self.position_embedding_type == "alibi" \
                and self.embed_layernorm:
            kind = "built-in GPT (BLOOM-style)"
        elif self.normalization == "LayerNorm" and not self.swiglu \
                and self.position_embedding_type == "learned_absolute":
            kind = "built-in GPT (GPT-2-style)"
        else:
            kind = "built-in GPT"
        return kind + (" with mixture-of-experts layers" if any(self.num_experts) else "")

    @property
    def attention_features(self) -> list[str]:
        """Positions and attention that differ from the family's usual, in words, for the plan's model line."""
        features = []
        if self.multi_latent_attention:
            query = f"queries through rank {self.q_lora_rank}" if self.q_lora_rank else "queries projected directly"
            features.append(f"multi-head latent attention ({query}, keys/values from a rank {self.kv_lora_rank} "
                            f"latent{' with q/kv ' + self.normalization if self.qk_layernorm else ''}; per head "
                            f"{self.qk_head_dim} + {self.qk_pos_emb_head_dim} rotary query/key dimensions, "
                            f"{self.v_head_dim} value dimensions)")
        if self.position_embedding_type == "alibi":
            features.append("ALiBi position biases (per-head slopes, no position embeddings)")
        if self.embed_layernorm:
            features.append("LayerNorm on the word embeddings")
        if self.softmax_type == "off-by-one":
            features.append("off-by-one softmax (an attention sink of logit 0 in every head)")
        elif self.softmax_type == "learnable":
            features.append("attention sinks (a learned logit per head in the softmax's denominator, gpt-oss)")
        if self.softmax_type != "vanilla" and self.attention_kernel in ("auto", "sdpa", "sdpa_flash", "sdpa_cudnn"):
            features.append("SDPA takes the sink as one more key under a float mask [heads, s, s + 1] (materialized, "
                            "as the eager kernel's scores)")
        if self.sliding_window is not None:
            window = f"sliding-window attention over the last {self.sliding_window} keys"
            if self.window_skip_freq:
                window += f" (every {ordinal(self.window_skip_freq)} layer attends to the whole sequence)"
            if self.sliding_window >= self.seq_length:
                window += f"; the window spans --seq-length {self.seq_length}, so training sees no difference"
            features.append(window)
        return features

    @property
    def mlp_features(self) -> list[str]:
        """The MLP's activation and router where they differ from GELU / SwiGLU and a bias-free router, for the plan."""
        features = []
        if self.squared_relu:
            features.append("MLP activation: squared ReLU, relu(x)² (--squared-relu)")
        if self.gated_linear_unit and (self.quick_geglu or self.activation_clamp is not None or self.glu_linear_offset):
            gate = "quick_gelu" if self.quick_geglu else "silu"
            clamp = (f", gate clamped at {self.activation_clamp:g} and linear half to ±{self.activation_clamp:g}"
                     if self.activation_clamp is not None else "")
            offset = f", linear half + {self.glu_linear_offset:g}" if self.glu_linear_offset else ""
            quick = " with quick_gelu(x) = x·sigmoid(1.702x)" if self.quick_geglu else ""
            features.append(f"gated MLP: {gate}(gate) × linear{quick}{clamp}{offset}")
        if self.moe_router_bias and any(self.num_experts):
            features.append("router with a bias (Megatron-Core's and gpt-oss's router)")
        return features

    def window_of_layer(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based), None where it attends to every earlier key."""
        if self.sliding_window is None or (self.window_skip_freq and (layer + 1) % self.window_skip_freq == 0):
            return None
        return self.sliding_window

    @property
    def expert_ffn_size(self) -> int:
        """Each routed expert's hidden size: --moe-ffn-hidden-size, else the dense MLP's."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def moe_router_features(self) -> list[str]:
        """The router as it runs, in words, for the plan (empty for a dense model)."""
        if not any(self.num_experts):
            return []
        k = self.moe_router_topk
        if self.moe_aux_loss_type == "sinkhorn":  # the router flags it ignores are refused (surface_meanings)
            scores = (f"Sinkhorn routing: in training the top {k} of the logits balanced over the micro-batch's tokens "
                      "(Sinkhorn-Knopp), in evaluation of the scores; combined by "
                      + ("sigmoid(logit)" if k == 1 else "their softmax probabilities, not renormalised")
                      + "; no balancing loss")
        elif self.moe_router_score_function == "sigmoid":
            scores = "sigmoid scores" + (f", the top {k} normalised to sum 1" if k > 1 else "")
        elif self.moe_router_pre_softmax or k == 1:
            scores = "softmax over all experts, the chosen keep their probabilities"
        else:
            scores = f"softmax, the top {k} renormalised to sum 1"
        words = [scores if self.moe_aux_loss_type == "sinkhorn" else f"router: top-{k} of {scores}"]
        if self.moe_router_topk_scaling_factor:
            words.append(f"combine weights × {self.moe_router_topk_scaling_factor:g}")
        if self.moe_router_num_groups:
            words.append(f"group-limited: {self.moe_router_num_groups} groups, the best "
                         f"{self.moe_router_group_topk} per token (by the sum of each group's top 2 scores)")
        if self.moe_router_force_load_balancing:
            words.append("benchmarking: random router logits balance the load, the router learns nothing "
                         "(--moe-router-force-load-balancing)")
        if self.moe_router_enable_expert_bias:
            words.append(f"aux-loss-free expert bias (selection only, moved ±{self.moe_router_bias_update_rate:g} "
                         "per step towards the mean load, all-reduced over data-parallel ranks; saved in checkpoints)")
        if self.moe_aux_loss_type == "seq_aux_loss":
            words.append("load-balancing loss per sequence (DeepSeek-V3's sequence-wise loss)")
        if self.moe_shared_expert_intermediate_size:
            words.append(f"shared experts of hidden {self.moe_shared_expert_intermediate_size} beside the routed ones"
                         + (", gated by sigmoid(Linear(h, 1))" if self.moe_shared_expert_gate else ""))
        if self.moe_ffn_hidden_size and self.moe_ffn_hidden_size != self.ffn_size:
            words.append(f"routed experts of hidden {self.moe_ffn_hidden_size}")
        return words

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rope rotates (even); MLA rotates its qk_pos_emb_head_dim part."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent) // 2 * 2

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def experts_in_layer(self, layer: int) -> int:
        return self.num_experts[layer] if self.num_experts else 0


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# A shape read from a file (a checkpoint's saved settings, a Hugging Face config.json) is refused past these bounds:
# valid JSON that damage or a crafted file made huge would otherwise fail only when the model is built (an overflow,
# or memory no machine has). Each bound is 64x or more the largest published model's value (Megatron's 1T GPT: 128
# layers, hidden 25,600; vocabularies of 256k ids; Llama 4 Scout's 10M positions), so no real model meets one.
SHAPE_SANITY_BOUNDS = {"num_layers": 2**13, "hidden_size": 2**21, "ffn_hidden_size": 2**23,
                       "num_attention_heads": 2**16, "num_query_groups": 2**16, "kv_channels": 2**16,
                       "vocab_size": 2**26, "padded_vocab_size": 2**26, "seq_length": 2**30,
                       "max_position_embeddings": 2**30, "sliding_window": 2**30, "num_experts": 2**16,
                       "moe_router_topk": 2**16, "q_lora_rank": 2**21, "kv_lora_rank": 2**21,
                       "qk_head_dim": 2**16, "qk_pos_emb_head_dim": 2**16, "v_head_dim": 2**16}
# The layers' weights (12 × hidden² each) past 10**15 parameters: 1000x the largest model trained so far.
MAX_LAYER_PARAMETERS = 10**15


def shape_past_bounds(values: dict) -> list[str]:
    """'name = value (at most BOUND)' for each count in `values` past its sanity bound, and the layers' size when
    their weights alone are past MAX_LAYER_PARAMETERS; [] for a sane shape. Values of other types are not judged
    here (each reader checks types)."""
    past = []
    for name, bound in SHAPE_SANITY_BOUNDS.items():
        value = values.get(name)
        largest = max((v for v in value if type(v) is int), default=0) if isinstance(value, (list, tuple)) else value
        if type(largest) is int and largest > bound:
            past.append(f"{name} = {largest} (at most {bound:,})")
    layers, hidden = values.get("num_layers"), values.get("hidden_size")
    if not past and type(layers) is int and type(hidden) is int and 12 * layers * hidden**2 > MAX_LAYER_PARAMETERS:
        past.append(f"num_layers = {layers} with hidden_size = {hidden} (~{12 * layers * hidden**2:.1e} parameters; "
                    f"at most {MAX_LAYER_PARAMETERS:.0e})")
    return past
