"""The attention kernels of the built-in models (chosen by --attention-backend, see attention_backends.py):
torch SDPA (its dispatcher or one backend), an explicit softmax(QKᵀ/√d)V, rapidtrain's short-sequence kernel (auto's
choice on a CPU in bf16 at short sequences or with attention dropout), and FlexAttention, whose mask is a
block-sparse BlockMask built from the mask's rule (causal, same document, padding, sliding window) instead of a dense
[s, s]. ALiBi's per-head linear biases (Press et al. 2022) enter each kernel its own way: an additive float mask
(SDPA), a term added to the scores (eager), a score_mod (FlexAttention). So do attention sinks (Megatron's
--softmax-type, gpt-oss's sinks: exp of a per-head logit in the softmax's denominator): one more key with a zero
value (SDPA), one more softmax column (eager), a rescaling by the returned logsumexp (FlexAttention)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rapidtrain.models.attention_backends import Kernel, short_kernel_runs
from rapidtrain.models.dropout import keep_mask

SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


def alibi_slopes(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """ALiBi's slope of each of `num_heads` heads, fp32: for a power of two n, the geometric sequence
    2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise those of the largest power of two p below n, followed by every
    other slope of 2p heads (the odd exponents), n - p of them. Made on `device` by torch ops (no host copy)."""
    power = 2 ** math.floor(math.log2(num_heads))
    exponents = torch.arange(1, power + 1, device=device, dtype=torch.float32) * (8.0 / power)
    extra = torch.arange(num_heads - power, device=device, dtype=torch.float32).mul(2).add(1) * (4.0 / power)
    return torch.pow(2.0, -torch.cat([exponents, extra]))


def alibi_bias(slopes: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """ALiBi's additive bias [heads, q_len, kv_len], fp32: -slope × (query position - key position), the queries
    being the last q_len of kv_len positions (after cached tokens). Causal rows see only distances >= 0."""
    query = torch.arange(kv_len - q_len, kv_len, device=slopes.device)[:, None]
    key = torch.arange(kv_len, device=slopes.device)[None, :]
    return -slopes[:, None, None] * (query - key).abs().float()


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    is_causal: bool, dropout_p: float, alibi: torch.Tensor | None = None,
                    sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(QKᵀ/√d + ALiBi + mask)·V written out (Megatron's unfused/local attention), the softmax in fp32; with
    attention sinks the softmax has one more column per row, the head's sink logit, dropped after it.
    q [b, heads, sq, d]; k, v [b, groups, sk, d] (grouped-query: each group serves heads / groups heads);
    mask bool, True = may attend; alibi: the slopes of q's heads, or None; sink: the sink logits of q's heads (fp32
    [heads]) or None."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    if alibi is not None:
        scores = scores + alibi_bias(alibi, q.shape[2], k.shape[2])
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sink is None:
        probs = scores.softmax(dim=-1)
    else:
        sinks = sink.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    return F.dropout(probs, dropout_p).to(v.dtype) @ v


@functools.cache
def _flex_attention(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled FlexAttention materializes the scores; compiled (Triton on CUDA) it is a fused kernel.
    if not compiled:
        return flex_attention
    kernel: Any = torch.compile(flex_attention, dynamic=False)  # torch types it as a plain `function`
    return kernel


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, is_causal: bool, dropout_p: float,
           kernel: Kernel, alibi: torch.Tensor | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [b, heads, sq, d] over k, v [b, groups, sk, d] with `kernel`; `mask` is a bool tensor
    (True = may attend) or None, or for "flex" the BlockMask that `flex_block_mask` built; `alibi` the ALiBi
    slopes of q's heads (fp32 [heads]) or None; `sink` the attention-sink logits of q's heads (fp32 [heads]: exp of
    each joins its softmax's denominator, --softmax-type) or None."""
    gqa = q.shape[1] != k.shape[1]
    if kernel == "flex":
        score_mod = None if alibi is None else _alibi_score_mod(alibi, k.shape[2] - q.shape[2])
        if sink is None:
            return _flex_attention(q.is_cuda)(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa)
        return _flex_with_sink(q, k, v, score_mod, mask, gqa, sink)
    assert mask is None or isinstance(mask, torch.Tensor)  # a BlockMask is flex's alone
    if kernel == "eager":
        return eager_attention(q, k, v, mask, is_causal, dropout_p, alibi, sink)
    if short_kernel_runs(kernel, q.device.type, _DTYPE_NAMES.get(q.dtype, "other"), q.shape[2], k.shape[2],
                         dropout_p > 0, alibi is not None, sink is not None):
        return short_attention(q, k, v, mask, is_causal, dropout_p)
    if sink is not None:
        # The sink as one more key: its key and value are zero, its score the head's sink logit (the float mask's
        # last column, through which the logits get their gradient); every query may see it.
        mask = _float_mask(alibi, q, k.shape[2], mask, is_causal)
        sinks = sink.to(mask.dtype)[None, :, None, None].expand(mask.shape[0], q.shape[1], q.shape[2], 1)
        mask, is_causal = torch.cat([mask.expand(-1, q.shape[1], -1, -1), sinks], dim=-1), False
        k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[3])], dim=2) for t in (k, v))
    elif alibi is not None:  # SDPA takes the biases as a float mask, into which the causal/boolean mask is folded
        mask, is_causal = _float_mask(alibi, q, k.shape[2], mask, is_causal), False
    call = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=dropout_p,
                             is_causal=is_causal, enable_gqa=gqa)
    if kernel in SDPA_BACKENDS:
        with sdpa_kernel(SDPA_BACKENDS[kernel]):
            return call()
    return call()


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                    dropout_p: float) -> torch.Tensor:
    """Self-attention over a short sequence with the scores materialized: one batched matmul for the scores (in the
    inputs' dtype, scaled and masked in the same call), one fused softmax (fp32 inside, the inputs' dtype out), one
    batched matmul for the output; backward from the kept probabilities and the fused softmax gradient. Megatron's
    unfused attention (baddbmm, fused scale-mask-softmax, bmm) as one autograd function that keeps only the
    probabilities (and dropout's mask, drawn by models/dropout.py's keep_mask: 5× faster than bernoulli_ on a CPU),
    not the scores.

    Why: PyTorch's CPU flash kernel runs its bf16 blocks at a third of the matmul units' rate (64-row query blocks
    against one key block: per-block GEMM calls and an online softmax); at a few hundred keys the whole [s, s]
    square fits the caches and two large batched GEMMs win, 2.4× at 256 keys (attention_backends.py's
    SHORT_KERNEL_MAX_KEYS says where it stops winning). The scores are rounded to bf16 once, as in Megatron's
    unfused path; the softmax and its gradient compute in fp32.

    Grouped-query attention without repeating K and V: the heads sharing a group are stacked as rows of one matrix
    (q [b, groups, heads/groups · s, d] against k [b, groups, s, d]), so each group's keys are read once and the
    keys' gradient sums its heads inside the matmul. q [b, heads, s, d]; k, v [b, groups, s, d or dv]; mask bool
    (True = may attend) broadcastable to [b, heads, s, s], or None; rows a mask empties give zeros (as SDPA's safe
    softmax)."""
    if torch.overrides.has_torch_function((q, k, v)):
        # a torch-function mode sees the call (selective recompute's, parallel/recompute.py), as it sees SDPA's
        return torch.overrides.handle_torch_function(short_attention, (q, k, v), q, k, v, mask, is_causal,
                                                     dropout_p)
    b, heads, s, d = q.shape
    groups = k.shape[1]
    rows = heads // groups * s
    bias = _short_bias(mask, is_causal, b, heads, groups, s, q.dtype, q.device)
    out = _ShortAttention.apply(q.reshape(b * groups, rows, d), k.reshape(b * groups, s, d),
                                v.reshape(b * groups, s, v.shape[-1]), bias, dropout_p, d ** -0.5, mask is not None)
    return out.view(b, heads, s, v.shape[-1])


def _short_bias(mask: torch.Tensor | None, is_causal: bool, b: int, heads: int, groups: int, s: int,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The additive mask (0 or -inf, in the scores' dtype) of short_attention's stacked rows: [heads/groups · s, s]
    when every sample and head share it (causal, or one mask for the batch), else [b · groups, heads/groups · s, s];
    None without a mask."""
    per_group = heads // groups
    if mask is None and not is_causal:
        return None
    if mask is None:
        allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    else:
        allowed = mask
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)
        if allowed.shape[0] != 1 or allowed.shape[1] != 1:
            bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            return bias.expand(b, heads, s, s).reshape(b * groups, per_group * s, s)
        allowed = allowed[0, 0]
    bias = torch.zeros(s, s, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return bias.repeat(per_group, 1) if per_group > 1 else bias


class _ShortAttention(torch.autograd.Function):
    """short_attention's forward and backward on stacked rows: q [n, rows, d], k [n, s, d], v [n, s, dv]."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                dropout_p: float, scale: float, masked: bool) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # q, k, v arrive in the dtype every product here runs in
            if bias is None:
                scores = torch.baddbmm(q.new_zeros(()), q, k.transpose(1, 2), beta=0, alpha=scale)
            else:
                scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
            probs = torch.softmax(scores, dim=-1)
            del scores
            if masked:
                probs = probs.nan_to_num_(0.0)  # a row the mask empties: zeros, not NaN
            keep = None
            dropped = probs
            ctx.kept_scale = 1.0
            if dropout_p > 0:
                keep, ctx.kept_scale = keep_mask(probs.shape, dropout_p, probs.device)
                dropped = torch.where(keep, probs, 0).mul_(ctx.kept_scale)
            out = torch.bmm(dropped, v)
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            # create_graph=True: the gradient would be differentiated with the kept probabilities as constants,
            # a silently wrong second derivative (SDPA's CPU flash kernel has none either, and says so)
            raise RuntimeError("rapidtrain's short-sequence attention (--attention-backend auto on a CPU) has no "
                               "second derivative (backward was asked to create a graph): use --attention-backend "
                               "eager, whose attention is differentiable ops")
        q, k, v, probs, keep = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        with torch.autocast(q.device.type, enabled=False):
            dq = dk = dv = None
            if ctx.needs_input_grad[2]:
                dropped = probs if keep is None else torch.where(keep, probs, 0).mul_(ctx.kept_scale)
                dv = torch.bmm(dropped.transpose(1, 2), grad_out)
                del dropped
            if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
                grad_probs = torch.bmm(grad_out, v.transpose(1, 2))
                if keep is not None:
                    grad_probs = torch.where(keep, grad_probs, 0).mul_(ctx.kept_scale)
                grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
                del grad_probs
                zero = grad_scores.new_zeros(())
                if ctx.needs_input_grad[0]:
                    dq = torch.baddbmm(zero, grad_scores, k, beta=0, alpha=ctx.scale)
                if ctx.needs_input_grad[1]:
                    dk = torch.baddbmm(zero, grad_scores.transpose(1, 2), q, beta=0, alpha=ctx.scale)
        return dq, dk, dv, None, None, None, None


def _float_mask(slopes: torch.Tensor | None, q: torch.Tensor, kv_len: int, mask: torch.Tensor | None,
                is_causal: bool) -> torch.Tensor:
    """ALiBi's bias (zero without `slopes`) with -inf where `mask` (bool, True = may attend) or causality forbids, in
    q's dtype, 4-d as SDPA's kernels take it: [b or 1, heads or 1, sq, sk]."""
    q_len = q.shape[2]
    if slopes is not None:
        bias = alibi_bias(slopes, q_len, kv_len).unsqueeze(0)
    else:
        bias = torch.zeros(1, 1, q_len, kv_len, device=q.device)
    if is_causal:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    if mask is not None:
        bias = torch.where(mask, bias, float("-inf"))
    return bias.to(q.dtype)


def _alibi_score_mod(slopes: torch.Tensor, cached: int) -> Callable:
    """FlexAttention's score_mod adding ALiBi's bias; query i is position i + cached (after cached tokens). The
    count travels as a tensor (a fill, no host copy), so compiled FlexAttention does not recompile per decoded token."""
    offset = torch.full((), cached, dtype=torch.int64, device=slopes.device)

    def add_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return score - slopes[h] * (q_idx + offset - kv_idx).abs()

    return add_bias


def _flex_with_sink(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Callable | None, block_mask: object,
                    gqa: bool, sink: torch.Tensor) -> torch.Tensor:
    """FlexAttention with attention sinks: its output over the real keys, times Z / (Z + exp(sink)) where
    Z = exp(logsumexp of the row's scores), which it returns: sigmoid(logsumexp - sink). The same as a softmax over
    the keys and the sink (whose value is zero), without a column that a BlockMask cannot hold."""
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = _flex_attention(q.is_cuda)(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa,
                                          return_aux=AuxRequest(lse=True))
    scale = torch.sigmoid(aux.lse.float() - sink.float()[None, :, None])
    return (out.float() * scale.unsqueeze(-1)).to(out.dtype)


def flex_block_mask(batch: int, q_len: int, kv_len: int, device: torch.device, causal: bool,
                    document_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                    window: int | None = None) -> object:
    """The BlockMask of: causal (query i, the last of q_len after kv_len - q_len cached tokens, sees keys up to
    its own position), the same document (document_ids [b, s]: packed samples do not attend across documents),
    and the batch's own mask (padding [b, s] with 1 = real token, or [b, (1,) s, s] with True = may attend), and
    a sliding window (the query sees keys less than `window` positions back).
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
        if window is not None:
            allowed = allowed & (position - kv_idx < window)
        return allowed | (position == kv_idx)

    per_row = document_ids is not None or attention_mask is not None
    return create_block_mask(may_attend, batch if per_row else None, None, q_len, kv_len, device=device)
