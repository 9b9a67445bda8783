"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3): keys and values come out of one small
latent per token, queries optionally out of another, and each head's query/key has an unrotated part and a rotary
part, the rotary key being one vector shared by all heads. Megatron-Core's --multi-latent-attention and
Hugging Face's DeepseekV2/V3 attention compute this; the built-in TransformerLayer builds it when
`config.multi_latent_attention`.

Nothing here knows about parallelism: tensor parallelism splits q_up_proj / q_proj / kv_up_proj by heads and
o_proj by rows from outside (parallel/tensor_parallel.py), and swaps `shared_key_gradient` (the identity here) for
the sum of the shared rotary key's gradient over the ranks, whose heads each use it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rapidtrain.models.attention import attend
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.rope import apply_rotary, yarn_mscale


def latent_norm(config: ModelConfig, size: int) -> nn.Module:
    """The norm of a latent (--qk-layernorm with MLA, as Megatron builds it: --normalization's kind)."""
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(size, eps=config.layernorm_epsilon)


def mla_softmax_scale_factor(config: ModelConfig) -> float:
    """What MLA's softmax scale 1/√(qk_head_dim + qk_pos_emb_head_dim) is multiplied by: YaRN's
    mscale(factor, --mscale-all-dim)² (DeepSeek's and Megatron's), 1 without YaRN."""
    if config.rope_scaling != "yarn":
        return 1.0
    return yarn_mscale(config.rope_scaling_factor, config.yarn_mscale_all_dim) ** 2


class MultiLatentAttention(nn.Module):
    """q = q_up(norm(q_down(x))) (or q_proj(x) without --q-lora-rank), split per head into [unrotated, rotary];
    kv_down(x) = [latent, rotary key]; kv_up(norm(latent)) per head = [unrotated key, value]; the rotary key,
    rotated once, is appended to every head's key. softmax(q·kᵀ · scale)·v, then o_proj.

    The KV cache holds each head's key and value after the up-projection (the same cache as the other attention;
    not the compressed latent). Heads are counted from the projections' outputs at run time, so a column split by
    heads runs unchanged on each rank.
    """

    def __init__(self, config: ModelConfig, causal: bool) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        self.causal = causal
        self.dropout = config.attention_dropout
        self.kernel = config.attention_kernel
        query_size = heads * (self.nope_dim + self.rope_dim)
        bias = False  # the q/kv projections have none (Megatron's MLA, DeepSeek); o_proj follows --disable-bias-linear
        self.q_proj = self.q_down_proj = self.q_down_norm = self.q_up_proj = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, query_size, bias=bias)
        else:
            self.q_down_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_down_norm = latent_norm(config, config.q_lora_rank) if config.qk_layernorm else None
            self.q_up_proj = nn.Linear(config.q_lora_rank, query_size, bias=bias)
        self.kv_down_proj = nn.Linear(h, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_down_norm = latent_norm(config, self.latent_dim) if config.qk_layernorm else None
        self.kv_up_proj = nn.Linear(self.latent_dim, heads * (self.nope_dim + self.v_dim), bias=bias)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=config.add_bias_linear)
        self.shared_key_gradient: nn.Module = nn.Identity()
        # Every kernel scales by 1/√(query size); YaRN's extra factor goes into the queries.
        self.query_scale = mla_softmax_scale_factor(config)
        self.rotary_interleaved = config.rotary_interleaved
        self.core: Callable[..., torch.Tensor] = attend  # replaced from outside by context parallelism

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_down_proj is not None and self.q_up_proj is not None
        latent = self.q_down_proj(x)
        return self.q_up_proj(latent if self.q_down_norm is None else self.q_down_norm(latent))

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: tuple | None = None,
    ) -> torch.Tensor:
        if rope is None:
            raise ValueError("multi-head latent attention needs rotary positions (--position-embedding-type rope)")
        b, s, _ = x.shape
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        q = self.queries(x).view(b, s, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_down_proj(x).split([self.latent_dim, self.rope_dim], dim=-1)
        if self.kv_down_norm is not None:
            latent = self.kv_down_norm(latent)
        kv = self.kv_up_proj(latent).view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        heads = q.shape[1]
        interleaved = self.rotary_interleaved
        k_rot = apply_rotary(self.shared_key_gradient(k_rot).unsqueeze(1), *rope, interleaved)  # [b, 1, s, rope_dim]
        q = torch.cat([q_nope, apply_rotary(q_rot, *rope, interleaved)], dim=-1)
        if self.query_scale != 1:
            q = q * self.query_scale
        k = torch.cat([k_nope, k_rot.expand(b, heads, s, self.rope_dim)], dim=-1)
        if cache is not None:
            k, v = cache[0].extend(cache[1], k, v)
        q, k, v = self.same_head_sizes(q, k, v)
        out = self.core(
            q, k, v, attention_mask,
            # Decoding one token after cached ones: it may attend to all of them (no mask).
            is_causal=self.causal and attention_mask is None and q.shape[2] == k.shape[2],
            dropout_p=self.dropout if self.training else 0.0,
            kernel=self.kernel,
        )
        return self.o_proj(out[..., :self.v_dim].transpose(1, 2).reshape(b, s, -1))

    def same_head_sizes(self, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SDPA's flash and cuDNN kernels (--attention-backend flash / fused) take one head size for q, k and v:
        the smaller side is padded with zeros (the caller keeps the first v_head_dim outputs), and queries padded
        from d to D dimensions are scaled by √(D/d) so the kernel's 1/√D is still 1/√d. Other kernels take MLA's
        sizes as they are."""
        query, value = q.shape[-1], v.shape[-1]
        if self.kernel not in ("sdpa_flash", "sdpa_cudnn") or query == value:
            return q, k, v
        if value < query:
            return q, k, F.pad(v, (0, query - value))
        q = F.pad(q * (value / query) ** 0.5, (0, value - query))
        return q, F.pad(k, (0, value - query)), v
