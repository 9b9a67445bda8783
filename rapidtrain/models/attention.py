"""The attention kernels of the built-in models (chosen by --attention-backend, see attention_backends.py):
torch SDPA (its dispatcher or one backend), an explicit softmax(QKᵀ/√d)V, and FlexAttention, whose mask is a
block-sparse BlockMask built from the mask's rule (causal, same document, padding) instead of a dense [s, s]."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rapidtrain.models.attention_backends import Kernel

SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    is_causal: bool, dropout_p: float) -> torch.Tensor:
    """softmax(QKᵀ/√d + mask)·V written out (Megatron's unfused/local attention), the softmax in fp32.
    q [b, heads, sq, d]; k, v [b, groups, sk, d] (grouped-query: each group serves heads / groups heads);
    mask bool, True = may attend."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.dropout(scores.softmax(dim=-1), dropout_p).to(v.dtype)
    return probs @ v


@functools.cache
def _flex_attention(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled FlexAttention materializes the scores; compiled (Triton on CUDA) it is a fused kernel.
    if not compiled:
        return flex_attention
    kernel: Any = torch.compile(flex_attention, dynamic=False)  # torch types it as a plain `function`
    return kernel


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, is_causal: bool, dropout_p: float,
           kernel: Kernel) -> torch.Tensor:
    """Attention of q [b, heads, sq, d] over k, v [b, groups, sk, d] with `kernel`; `mask` is a bool tensor
    (True = may attend) or None, or for "flex" the BlockMask that `flex_block_mask` built."""
    gqa = q.shape[1] != k.shape[1]
    if kernel == "flex":
        return _flex_attention(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=gqa)
    assert mask is None or isinstance(mask, torch.Tensor)  # a BlockMask is flex's alone
    if kernel == "eager":
        return eager_attention(q, k, v, mask, is_causal, dropout_p)
    call = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=dropout_p,
                             is_causal=is_causal, enable_gqa=gqa)
    if kernel in SDPA_BACKENDS:
        with sdpa_kernel(SDPA_BACKENDS[kernel]):
            return call()
    return call()


def flex_block_mask(batch: int, q_len: int, kv_len: int, device: torch.device, causal: bool,
                    document_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> object:
    """The BlockMask of: causal (query i, the last of q_len after kv_len - q_len cached tokens, sees keys up to
    its own position), the same document (document_ids [b, s]: packed samples do not attend across documents),
    and the batch's own mask (padding [b, s] with 1 = real token, or [b, (1,) s, s] with True = may attend).
    Every token may attend to itself, as `sdpa_mask` does, so no row is empty. Only blocks of 128×128 that
    hold an allowed pair are stored and computed: memory O(b · (s/128)²), not b · s²."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_len - q_len
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, 0]
    padding = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 else None
    dense = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 3 else None
    # A mask shared by the batch ([1, ...]) is indexed by each row's b.
    padding, dense = (None if t is None else t.expand(batch, *t.shape[1:]) for t in (padding, dense))

    def may_attend(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        position = q_idx + offset
        allowed = position >= kv_idx if causal else torch.ones_like(q_idx, dtype=torch.bool)
        if document_ids is not None:
            allowed = allowed & (document_ids[b, position] == document_ids[b, kv_idx])
        if padding is not None:
            allowed = allowed & padding[b, kv_idx]
        if dense is not None:
            allowed = allowed & dense[b, q_idx, kv_idx]
        return allowed | (position == kv_idx)

    per_row = document_ids is not None or attention_mask is not None
    return create_block_mask(may_attend, batch if per_row else None, None, q_len, kv_len, device=device)
