"""Transformer pieces shared by the built-in GPT and BERT: embeddings, attention (multi-head or
grouped-query, with an optional KV cache for decoding), MLP (GELU or SwiGLU), pre- or post-norm layer,
output head, per-token loss, and initialization that depends only on (seed, parameter name).

Nothing here knows about parallelism: tensor, pipeline and expert parallelism transform these
modules from outside (see rapidtrain/parallel/), so the modules keep plain, stable structure.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rapidtrain.models.attention import alibi_slopes, attend, flex_block_mask
from rapidtrain.models.chunked_loss import chunked_head_cross_entropy
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.dropout import Dropout
from rapidtrain.models.mla import MultiLatentAttention
from rapidtrain.models.mlp import MLP
from rapidtrain.models.moe import MoELayer
from rapidtrain.models.rope import apply_rotary, inverse_frequency, rope_attention_factor, rotary_cos_sin


def check_model_config(config: ModelConfig) -> None:
    """Refuse shapes the model cannot build, naming the flag to change."""
    if config.multi_latent_attention:
        _check_latent_attention(config)
    elif config.kv_channels is None and config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"--hidden-size {config.hidden_size} is not divisible by --num-attention-heads "
            f"{config.num_attention_heads}: choose a head count that divides the hidden size, or give the head size "
            "with --kv-channels"
        )
    if config.num_attention_heads % config.query_groups:
        raise ValueError(
            f"--num-attention-heads {config.num_attention_heads} is not divisible by --num-query-groups "
            f"{config.query_groups}: each key/value head serves an equal share of the query heads"
        )
    if config.ffn_size < 1:
        raise ValueError(
            f"the MLP hidden size works out to {config.ffn_size} (--hidden-size {config.hidden_size}"
            + (" with --swiglu: 2/3 of 4h rounded down to a multiple of 64" if config.swiglu else "")
            + "): give --ffn-hidden-size"
        )
    if config.position_embedding_type == "rope" and config.rotary_dim < 2:
        raise ValueError(
            f"--rotary-percent {config.rotary_percent} of the head size {config.head_dim} leaves no pair of "
            "dimensions to rotate: raise it"
        )
    if config.position_embedding_type == "rope" and config.head_dim % 2 and not config.multi_latent_attention:
        raise ValueError(
            f"rotary position embeddings need an even head size, got {config.head_dim} "
            "(--kv-channels, else --hidden-size / --num-attention-heads): change it, or use learned_absolute positions"
        )
    _check_positions_and_window(config)
    if config.num_experts and len(config.num_experts) != config.num_layers:
        raise ValueError(
            f"--num-experts has {len(config.num_experts)} entries for {config.num_layers} layers "
            "(--num-layers): give one value per layer, 0 for a dense layer"
        )
    for experts in config.num_experts:
        if experts and not 1 <= config.moe_router_topk <= experts:
            raise ValueError(
                f"--moe-router-topk {config.moe_router_topk} must be between 1 and the number of "
                f"experts of an MoE layer ({experts}, --num-experts)"
            )


def _check_latent_attention(config: ModelConfig) -> None:
    """Multi-head latent attention's own shape: rotary positions, even rotary head part, sizes of at least 1."""
    if config.position_embedding_type == "alibi":
        raise ValueError("--multi-latent-attention rotates part of each head (rope): drop --position-embedding-type "
                         "alibi")
    if config.num_query_groups is not None:
        raise ValueError("--multi-latent-attention makes each head's key and value from a shared latent: drop "
                         "--group-query-attention / --num-query-groups")
    sizes = {"--kv-lora-rank": config.kv_lora_rank, "--qk-head-dim": config.qk_head_dim,
             "--qk-pos-emb-head-dim": config.qk_pos_emb_head_dim, "--v-head-dim": config.v_head_dim,
             "--q-lora-rank": config.q_lora_rank if config.q_lora_rank is not None else 1}
    small = [f"{flag} {size}" for flag, size in sizes.items() if size < 1]
    if small:
        raise ValueError(f"{', '.join(small)}: multi-head latent attention's sizes are at least 1")
    if config.qk_pos_emb_head_dim % 2:
        raise ValueError(f"--qk-pos-emb-head-dim {config.qk_pos_emb_head_dim}: rope rotates pairs of dimensions, "
                         "give an even size")


def _check_positions_and_window(config: ModelConfig) -> None:
    if config.model_type == "bert" and (config.position_embedding_type == "alibi" or config.sliding_window):
        raise ValueError("ALiBi and sliding-window attention are causal (GPT) features here: drop "
                         "--position-embedding-type alibi / the window flags for BERT")
    if config.sliding_window is not None and config.sliding_window < 1:
        raise ValueError(f"--sliding-window {config.sliding_window}: a query sees at least itself, give 1 or more")
    if config.window_skip_freq < 0:
        raise ValueError(f"--window-attn-skip-freq {config.window_skip_freq}: give a positive layer interval")


def make_norm(config: ModelConfig, size: int | None = None) -> nn.Module:
    """LayerNorm or RMSNorm (--normalization) over the last dimension."""
    size = size or config.hidden_size
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(size, eps=config.layernorm_epsilon)


NORMS = (nn.LayerNorm, nn.RMSNorm)


class Embedding(nn.Module):
    """Word embeddings (with BLOOM's --embed-layernorm a LayerNorm on them alone, as Megatron-DeepSpeed) + (learned
    position) + (token type) embeddings, (a norm in post-norm models,) then dropout."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.word_embeddings_norm = nn.LayerNorm(h, eps=config.layernorm_epsilon) if config.embed_layernorm else None
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, h)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.tokentype_embeddings = nn.Embedding(config.num_tokentypes, h) if config.num_tokentypes else None
        self.norm = make_norm(config) if config.post_layernorm else None
        self.dropout = Dropout(config.hidden_dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if self.word_embeddings_norm is not None:
            hidden = self.word_embeddings_norm(hidden)
        if self.position_embeddings is not None:
            seq_length = input_ids.shape[1]
            if seq_length > self.position_embeddings.num_embeddings:
                raise ValueError(
                    f"sequence of {seq_length} tokens is longer than --max-position-embeddings "
                    f"{self.position_embeddings.num_embeddings}: raise it or shorten --seq-length"
                )
            if position_ids is None:
                position_ids = torch.arange(seq_length, device=input_ids.device).unsqueeze(0)
            hidden = hidden + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError(
                    "tokentype_ids were given but the model has no token-type embeddings (num_tokentypes=0)"
                )
            hidden = hidden + self.tokentype_embeddings(tokentype_ids)
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self.dropout(hidden)


def sdpa_mask(attention_mask: torch.Tensor | None, seq_length: int, causal: bool) -> torch.Tensor | None:
    """Turn a batch's mask into a boolean SDPA mask [b, 1, s, s] (True = may attend), or None.

    Accepted: [b, s] padding mask (1 = real token) or [b, s, s] / [b, 1, s, s] with True = may attend.
    Causal models AND it with the causal triangle. Every query may always attend to itself, so no
    row is fully masked (SDPA would return NaN there; such rows are padding and carry no loss).
    """
    if attention_mask is None:
        return None
    allowed = attention_mask.bool()
    if allowed.dim() == 2:
        allowed = allowed[:, None, None, :]
    elif allowed.dim() == 3:
        allowed = allowed[:, None]
    elif allowed.dim() != 4:
        raise ValueError(
            f"attention_mask must be [b, s], [b, s, s] or [b, 1, s, s], got {tuple(allowed.shape)}"
        )
    eye = torch.eye(seq_length, dtype=torch.bool, device=allowed.device)
    if causal:
        allowed = allowed & torch.ones_like(eye).tril()
    return allowed | eye


def decoding_mask(padding: torch.Tensor, new: int) -> torch.Tensor:
    """The boolean mask [b, 1, new, total] of `new` tokens decoded after total - new cached ones, from the padding
    mask [b, total] of all of them (1 = real token; left padding): token i sees the real tokens up to its own
    position, and always itself (so a padding row is never empty)."""
    total = padding.shape[1]
    query_position = torch.arange(total - new, total, device=padding.device)[:, None]
    key_position = torch.arange(total, device=padding.device)
    allowed = padding.bool()[:, None, None, :] & (key_position <= query_position)
    return allowed | (key_position == query_position)


class KVCache:
    """Keys and values of the tokens decoded so far, per layer, so each new token attends to them
    without recomputing them. `length` tokens are cached; the next token's position is `length`."""

    def __init__(self) -> None:
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.length = 0

    def extend(self, layer: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values [b, groups, s, d] of `layer`; all of them so far."""
        if layer in self.keys:
            keys = torch.cat([self.keys[layer], keys], dim=2)
            values = torch.cat([self.values[layer], values], dim=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def advance(self, tokens: int) -> None:
        """Count this step's tokens as cached (after every layer extended the cache with them)."""
        self.length += tokens


class StaticKVCache:
    """Keys and values in buffers preallocated for `max_length` tokens per layer, so that every decoding step after
    the prompt has the same shapes (what lets torch.compile compile the step once). The prompt fills slots [0, s)
    and attends over them alone; each later step writes its tokens at `slots` (a tensor set by the decoding loop,
    not a Python int, which compiled code would specialise on) and attends over all max_length slots under the
    loop's [b, max_length] mask, which hides the slots not written yet and the padding."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.length = 0  # tokens of the prompt; the loop counts the decoded ones by its slots
        self.slots: torch.Tensor | None = None

    def extend(self, layer: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values [b, groups, s, d] of `layer`; what the step attends over."""
        if self.slots is None:  # the prompt
            b, groups, s, _ = keys.shape  # keys and values may differ in size (multi-head latent attention)
            self.keys[layer] = keys.new_zeros(b, groups, self.max_length, keys.shape[-1])
            self.values[layer] = values.new_zeros(b, groups, self.max_length, values.shape[-1])
            self.keys[layer][:, :, :s] = keys
            self.values[layer][:, :, :s] = values
            return keys, values
        self.keys[layer].index_copy_(2, self.slots, keys)
        self.values[layer].index_copy_(2, self.slots, values)
        return self.keys[layer], self.values[layer]

    def advance(self, tokens: int) -> None:
        if self.slots is None:
            self.length += tokens


class AttentionSink(nn.Module):
    """The sink logit of every head (--softmax-type): 0 for off-by-one (no parameter), a learned `logits` [heads]
    for learnable (gpt-oss's `sinks`). A module of its own so tensor parallelism replicates it whole; each rank takes
    its heads' logits (Attention.first_head) and the gradients are summed over the ranks."""

    def __init__(self, num_heads: int, softmax_type: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.logits = nn.Parameter(torch.zeros(num_heads)) if softmax_type == "learnable" else None

    def forward(self, device: torch.device) -> torch.Tensor:
        """fp32 [heads]: every head's sink logit."""
        if self.logits is None:
            return torch.zeros(self.num_heads, device=device)
        return self.logits.float()


class Attention(nn.Module):
    """Self-attention with separate q/k/v projections (column-split friendly) and o_proj.

    Grouped-query attention: k/v project to `num_query_groups` heads, each shared by
    heads / groups consecutive query heads. Heads and groups are counted from the projections' outputs
    at run time, so after a column split of q/k/v (and row split of o_proj) each rank runs its own
    heads and groups without knowing the split. ALiBi's slopes depend on a head's place among all heads:
    `first_head` is the index of this module's first head (a column split sets it per rank).
    """

    def __init__(self, config: ModelConfig, causal: bool) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.causal = causal
        self.dropout = config.attention_dropout
        self.kernel = config.attention_kernel
        self.alibi_heads = config.num_attention_heads if config.position_embedding_type == "alibi" else 0
        self.rotary_interleaved = config.rotary_interleaved
        self.first_head = 0
        self.q_proj = nn.Linear(h, d * config.num_attention_heads, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, d * config.query_groups, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, d * config.query_groups, bias=config.qkv_bias)
        self.o_proj = nn.Linear(d * config.num_attention_heads, h, bias=config.add_bias_linear)
        # --qk-layernorm: one norm over head_dim for all query heads, one for all key heads (Qwen3's q_norm/k_norm);
        # under tensor parallelism each rank holds them whole and applies them to its own heads.
        self.q_norm = make_norm(config, d) if config.qk_layernorm else None
        self.k_norm = make_norm(config, d) if config.qk_layernorm else None
        self.sink = AttentionSink(config.num_attention_heads, config.softmax_type) \
            if config.softmax_type != "vanilla" else None
        # The attention core (attend's signature): replaced from outside where attention spans ranks (context
        # parallelism, parallel/context_parallel.py); the model itself always calls attend.
        self.core: Callable[..., torch.Tensor] = attend

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: tuple[KVCache | StaticKVCache, str] | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        if torch.is_autocast_enabled(x.device.type):
            # Once for the three projections: autocast would cast x per projection, and each would keep its own
            # 16-bit copy for backward (two more [b, s, h] tensors per layer).
            x = x.to(torch.get_autocast_dtype(x.device.type))
        q, k, v = (
            proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope, self.rotary_interleaved), apply_rotary(k, *rope, self.rotary_interleaved)
        if cache is not None:
            k, v = cache[0].extend(cache[1], k, v)
        slopes = None
        if self.alibi_heads:
            slopes = alibi_slopes(self.alibi_heads, q.device)[self.first_head:self.first_head + q.shape[1]]
        sink = None if self.sink is None else self.sink(q.device)[self.first_head:self.first_head + q.shape[1]]
        out = self.core(
            q,
            k,
            v,
            attention_mask,
            # Decoding one token after cached ones: it may attend to all of them (no mask).
            is_causal=self.causal and attention_mask is None and q.shape[2] == k.shape[2],
            dropout_p=self.dropout if self.training else 0.0,
            kernel=self.kernel,
            alibi=slopes,
            sink=sink,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + dropout(attention(ln1(x))), then x + dropout(mlp(ln2(x))); post-norm
    (`config.post_layernorm`, original BERT): ln1(x + dropout(attention(x))), then ln2(x + dropout(mlp(x))).

    `mlp` is a dense MLP, or an MoE layer where `config.experts_in_layer(layer_number) > 0`.
    """

    def __init__(self, config: ModelConfig, layer_number: int, causal: bool) -> None:
        super().__init__()
        self.name = str(layer_number)  # the KV cache's key for this layer
        self.post_layernorm = config.post_layernorm
        self.ln1 = make_norm(config)
        self.attention: Attention | MultiLatentAttention = (
            MultiLatentAttention(config, causal) if config.multi_latent_attention else Attention(config, causal))
        self.ln2 = make_norm(config)
        experts = config.experts_in_layer(layer_number)
        self.mlp = MoELayer(config, experts) if experts else MLP(config)
        self.dropout = Dropout(config.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | StaticKVCache | None = None,
    ) -> torch.Tensor:
        layer_cache = None if cache is None else (cache, self.name)
        if self.post_layernorm:
            x = self.ln1(x + self.dropout(self.attention(x, attention_mask, rope, layer_cache)))
            return self.ln2(x + self.dropout(self.mlp(x)))
        x = x + self.dropout(self.attention(self.ln1(x), attention_mask, rope, layer_cache))
        return x + self.dropout(self.mlp(self.ln2(x)))


def cached_positions(hidden: torch.Tensor, cache: KVCache | StaticKVCache | None) -> torch.Tensor:
    """Positions [1, s] of this step's tokens: after the cached ones."""
    start = cache.length if cache is not None else 0
    return torch.arange(start, start + hidden.shape[1], device=hidden.device).unsqueeze(0)


def run_layers(
    layers: nn.ModuleDict,
    hidden: torch.Tensor,
    config: ModelConfig,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    causal: bool,
    cache: KVCache | StaticKVCache | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run every layer this model (or pipeline stage) holds, with rotary angles and mask made once.

    With a KV cache, this step's tokens follow the `cache.length` cached ones; the cache grows by them.
    With a KV cache and a [b, cached + s] padding mask (batched decoding, left padding), each row sees its own
    real tokens only; the caller gives each row's position_ids.
    `document_ids` [b, s] (FlexAttention only): packed documents attend within their own document.
    Layers with a sliding window (config.window_of_layer) get the mask narrowed to it; one mask per window.
    """
    seq_length = hidden.shape[1]
    rope = None
    if config.position_embedding_type == "rope" or config.multi_latent_attention:  # MLA rotates its own part always
        if position_ids is None:
            position_ids = cached_positions(hidden, cache)
        rope = rotary_cos_sin(position_ids, inverse_frequency(config, hidden.device), rope_attention_factor(config))
    if isinstance(cache, StaticKVCache) and cache.slots is not None:
        return _run_static_step(layers, hidden, config, attention_mask, rope, cache)
    kv_length = seq_length + (cache.length if cache is not None else 0)
    windows = {name: config.window_of_layer(int(name)) for name in layers}
    if config.attention_kernel == "flex":
        masks = {window: flex_block_mask(hidden.shape[0], seq_length, kv_length, hidden.device, causal, document_ids,
                                         attention_mask, window) for window in set(windows.values())}
        return _run(layers, hidden, masks, windows, rope, cache)
    if document_ids is not None:
        raise ValueError("document_ids mask packed documents through FlexAttention's BlockMask: build the model "
                         "with --attention-backend flex_attention, or pass a dense attention_mask")
    mask = _dense_mask(attention_mask, seq_length, causal, cache, hidden.device)
    masks = {window: sliding_window_mask(mask, seq_length, kv_length, window, hidden.device)
             for window in set(windows.values())}
    return _run(layers, hidden, masks, windows, rope, cache)


def _dense_mask(attention_mask: torch.Tensor | None, seq_length: int, causal: bool,
                cache: KVCache | StaticKVCache | None, device: torch.device) -> torch.Tensor | None:
    """The boolean mask of SDPA and eager attention (True = may attend), None where causality alone decides."""
    if cache is not None and attention_mask is not None and attention_mask.dim() == 2:
        return decoding_mask(attention_mask, seq_length)
    mask = sdpa_mask(attention_mask, seq_length, causal)
    if cache is not None and cache.length and seq_length > 1:
        if mask is not None:
            raise ValueError("a KV cache decodes without an attention mask (one unpadded sequence per row)")
        # Several new tokens after cached ones: token i sees the cache and new tokens up to i.
        total = cache.length + seq_length
        mask = torch.ones(seq_length, total, dtype=torch.bool, device=device).tril(cache.length)
    return mask


def sliding_window_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, window: int | None,
                        device: torch.device) -> torch.Tensor | None:
    """`mask` (causal where None) narrowed so that each of the last q_len of kv_len positions sees only keys less
    than `window` positions back; unchanged where there is no window or it covers every key."""
    if window is None or window >= kv_len:
        return mask
    query = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key = torch.arange(kv_len, device=device)[None, :]
    near = query - key < window
    return near & (key <= query) if mask is None else mask & near


def _run_static_step(layers: nn.ModuleDict, hidden: torch.Tensor, config: ModelConfig,
                     attention_mask: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None,
                     cache: StaticKVCache) -> torch.Tensor:
    """A static cache's decoding step: every slot under the loop's [b, max_length] mask of the written ones. Reads
    no Python length (compiled code would specialise on it). ALiBi and sliding windows measure distances from the
    last key, which a static cache's step is not: refused."""
    if config.position_embedding_type == "alibi" or any(config.window_of_layer(int(n)) for n in layers):
        raise ValueError("a static KV cache (--torch-compile) decodes rope or learned positions with full "
                         "attention; ALiBi and sliding-window models decode through the growing cache")
    if attention_mask is None or attention_mask.dim() != 2:
        raise ValueError("a static KV cache's decoding step needs the [b, max_length] mask of its written slots")
    mask = attention_mask.bool()[:, None, None, :]
    return _run(layers, hidden, {None: mask}, dict.fromkeys(layers, None), rope, cache)


def _run(layers: nn.ModuleDict, hidden: torch.Tensor, masks: dict, windows: dict[str, int | None],
         rope: tuple[torch.Tensor, torch.Tensor] | None, cache: KVCache | StaticKVCache | None) -> torch.Tensor:
    for name, layer in layers.items():
        hidden = layer(hidden, masks[windows[name]], rope, cache)
    if cache is not None:
        cache.advance(hidden.shape[1])
    return hidden


TIED_EMBEDDING_NAME = "embedding.word_embeddings.weight"


class OutputLayer(nn.Linear):
    """Hidden states → vocabulary logits (an nn.Linear, so ColwiseParallel can split the vocabulary).

    Tied: `weight` is the word-embedding Parameter object itself and `tied_to` names it. A pipeline
    last stage without the embedding keeps this Parameter as its own copy (initialized under the
    embedding's name, so both stages start equal); the stages then keep the two copies in sync.
    """

    def __init__(
        self, hidden_size: int, vocab_size: int, tied_weight: nn.Parameter | None, bias: bool
    ) -> None:
        # A tied head builds its placeholder weight on meta: it is replaced at once, so never allocated.
        super().__init__(
            hidden_size, vocab_size, bias=bias, device="meta" if tied_weight is not None else None
        )
        self.tied_to = TIED_EMBEDDING_NAME if tied_weight is not None else None
        if tied_weight is not None:
            self.weight = tied_weight
            if self.bias is not None:
                self.bias = nn.Parameter(torch.zeros(vocab_size, device=tied_weight.device))


class TokenCrossEntropy(nn.Module):
    """Per-token cross-entropy [b, s] in fp32, unreduced; labels < 0 (-1, -100) give loss 0.

    A module of its own so tensor parallelism can swap it for a vocab-parallel version
    (`torch.distributed.tensor.parallel.loss_parallel`); masking and averaging belong to the loop.
    With `chunked` (the default) a model whose head and loss are untransformed computes head and loss together
    chunk by chunk (`from_hidden`, chunked_loss.py): the same numbers without the whole fp32 logits.
    """

    def __init__(self, chunked: bool = True) -> None:
        super().__init__()
        self.chunked = chunked
        # (backend, mode) under --torch-compile: on CUDA the chunked loss's per-block elementwise work is compiled
        self.compiled: tuple[str, str | None] | None = None

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = labels.masked_fill(labels < 0, -100).flatten()
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets, reduction="none", ignore_index=-100)
        return loss.view(labels.shape)

    def can_fuse_head(self, head: nn.Module) -> bool:
        """Whether `from_hidden` may compute this loss with `head`: both plain modules that nothing hooks. A head
        or loss transformed from outside (tensor parallelism's DTensor weight and vocab-parallel loss, DeepSpeed
        ZeRO-3's gathering hooks, LoRA or quantized heads) keeps the plain path: head(hidden), then the loss."""
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (self, head))
        global_hooks = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
        plain = type(head) is OutputLayer and type(head.weight) is nn.Parameter
        return self.chunked and plain and not hooked and not global_hooks

    def from_hidden(self, hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
        """The same per-token loss as `self(head(hidden), labels)`, without the whole fp32 logits at once."""
        return chunked_head_cross_entropy(hidden, head.weight, head.bias, labels, compiled=self.compiled)


def tie_weights(model: nn.Module) -> None:
    """Point every tied output layer at the word-embedding Parameter again, where the model holds both.

    Needed after `to_empty` (meta → real device creates new Parameter objects, breaking the tie).
    """
    for module in model.modules():
        if isinstance(module, OutputLayer) and module.tied_to is not None:
            try:
                module.weight = model.get_parameter(module.tied_to)
            except AttributeError:  # pipeline stage without the embedding: keeps its own copy
                pass


# Wrappers that activation checkpointing, torch.compile and FSDP1 insert into parameter names; checkpoints spell
# names without them (as torch.distributed.checkpoint does), so every layout and wrapper saves the same keys.
WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
# Megatron's scaled init: projections that write into the residual stream get std / sqrt(2 L).
_RESIDUAL_OUTPUTS = ("o_proj.weight", "fc2.weight", "experts.w2")
_BIASES = {"bias", "b1", "b_gate", "b2"}


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, parameter name) that is the same in every process and Python run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(
    name: str, module: nn.Module, shape: torch.Size, config: ModelConfig, seed: int
) -> torch.Tensor:
    """The fp32 CPU value of parameter `name` (canonical, un-wrapped name) of `module`."""
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, NORMS):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf in _BIASES or name.endswith(".lora.lora_b.weight"):  # a LoRA adapter starts as no change (B = 0)
        return torch.zeros(shape)
    std = config.init_method_std
    if name.endswith(_RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2.0 * config.num_layers)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def canonical_name(name: str) -> str:
    """A parameter's (or buffer's) name without wrapper prefixes, as checkpoints spell it."""
    return ".".join(part for part in name.split(".") if part and part not in WRAPPER_NAMES)


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's canonical name, by id (the first name of a tied one)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), canonical_name(name))
    return names


def canonical_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """(name in the whole unwrapped model, owning module, parameter) for every materialized parameter.

    Wrapper prefixes (activation checkpointing, compile, FSDP1) are dropped, and a tied head's own copy
    on a pipeline stage without the embedding is named after the embedding it copies.
    """
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if param.is_meta:
                continue
            name = canonical_name(f"{module_name}.{leaf}")
            if isinstance(module, OutputLayer) and leaf == "weight" and module.tied_to:
                name = module.tied_to
            yield name, module, param


def set_parameter(param: nn.Parameter, value: torch.Tensor) -> None:
    """Copy a whole (CPU) value into `param`, which may be a DTensor holding a shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def init_weights(model: nn.Module, seed: int, only: Callable[[str], bool] | None = None) -> None:
    """Set every parameter from a generator seeded by (seed, its name), whatever the layout.

    A whole model, one built on meta and materialized with `to_empty`, a pipeline stage with some
    layers deleted, or a model whose parameters are DTensors (tensor/fully sharded) all get the
    same values for the same parameter. Values are drawn on the CPU (device generators differ).
    Needs `model.config` (a ModelConfig; num_layers is the whole model's, also in a stage).
    """
    config: ModelConfig = model.config  # type: ignore[assignment]
    with torch.no_grad():
        for name, module, param in canonical_parameters(model):
            if only is None or only(name):  # `only`: the parameters added after the model was built (LoRA)
                set_parameter(param, initial_value(name, module, param.shape, config, seed))
        for module in model.modules():  # buffers that start at zero (materialized from meta they hold garbage)
            if isinstance(module, MoELayer) and module.expert_bias is not None:
                module.expert_bias.zero_()
