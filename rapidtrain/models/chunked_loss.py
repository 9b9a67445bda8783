"""Output head + per-token cross-entropy in chunks of tokens, so the [tokens, vocabulary] fp32 logits never exist
whole: forward keeps each token's log-sum-exp and, where they are cheap, the logits in the matmul's own dtype;
backward turns one chunk at a time into gradients.

The plain path holds the logits three times over a step (autocast's bf16 output, its fp32 copy, log_softmax's fp32
output saved for backward) and a fourth in backward (their gradient); at vocabulary 50k and 8k tokens each fp32 copy
is 1.6 GB. Here bf16/fp16 logits are kept as the matmul wrote them (exactly what the fp32 copy would hold, at half
its size) and fp32 logits are kept only when one chunk holds them all; otherwise backward recomputes each chunk's
logits, one more head matmul.

Under --torch-compile on CUDA, each block's elementwise work (the fp32 view of the logits, log-sum-exp and the
label's logit in forward; softmax minus one-hot, times the incoming gradient, in backward) runs as one compiled
kernel per pass instead of several eager ones, each a full pass over a [tokens, block] fp32 tensor (`fused_blocks`).
"""

from __future__ import annotations

import torch

from rapidtrain.models.loss_blocks import block_size

# (backend, mode) → the compiled block functions; made at first use, shared by every model of the process.
_FUSED: dict[tuple[str, str | None], tuple] = {}


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One block's logits [T, block] in the matmul dtype."""
    return hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())


class ChunkedHeadCrossEntropy(torch.autograd.Function):
    """loss[t] = logsumexp(h[t] Wᵀ + b) - (h[t] Wᵀ + b)[label[t]], fp32, 0 where label < 0, computed over blocks of
    the vocabulary (so every matmul keeps all tokens as its long dimension, and dW needs no adding up over chunks).

    hidden [T, h] and weight [V, h] (bias [V]) arrive in the matmul dtype (autocast's, cast by the caller)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                block: int, fused: tuple | None = None) -> torch.Tensor:
        keep = hidden.element_size() <= 2 or block >= weight.shape[0]
        kept, block_lse = [], []
        picked = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, weight.shape[0], block):
            raw = _logits(hidden, weight[start:start + block], None if bias is None else bias[start:start + block])
            kept += [raw] if keep else []
            if fused is not None:  # the same, as one compiled kernel
                block_picked, lse = fused[0](raw, targets - start)
            else:
                inside = (targets >= start) & (targets < start + raw.shape[1])
                index = (targets - start).clamp(0, raw.shape[1] - 1)
                block_picked = raw.gather(1, index[:, None]).squeeze(1).float().masked_fill_(~inside, 0.0)
                lse = _log_sum_exp(_writable_fp32(raw, kept=keep))
            picked += block_picked
            block_lse.append(lse)
            del raw  # before the next block's matmul: one fp32 block at a time
        log_sum_exp = torch.logsumexp(torch.stack(block_lse), dim=0)
        ignored = targets < 0
        ctx.save_for_backward(hidden, weight, bias, targets, log_sum_exp, ignored, *kept)
        ctx.block, ctx.fused = block, fused
        return (log_sum_exp - picked).masked_fill_(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, log_sum_exp, ignored, *kept = ctx.saved_tensors
        scale = grad_losses.float().masked_fill(ignored, 0.0)[:, None]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        grad_bias = None if bias is None else torch.empty_like(bias)
        for index, start in enumerate(range(0, weight.shape[0], ctx.block)):
            end = start + ctx.block
            logits = kept[index] if kept else _logits(hidden, weight[start:end],
                                                      None if bias is None else bias[start:end])
            if ctx.fused is not None:  # the same, as one compiled kernel: logits in, gradient in their dtype out
                grad_logits = ctx.fused[1](logits, log_sum_exp, targets - start, scale)
            else:
                # d loss / d logits = softmax - one_hot(label), times each token's incoming gradient, in place on
                # an fp32 block: a copy of kept or 16-bit logits (the kept ones stay intact for a backward with
                # retain_graph), else the recomputed block itself. Several times faster on a CPU than one
                # type-promoting subtraction, in the same memory.
                grad_logits = _writable_fp32(logits, kept=bool(kept)).sub_(log_sum_exp[:, None]).exp_()
                inside = (targets >= start) & (targets < start + grad_logits.shape[1])
                grad_logits.scatter_add_(1, (targets - start).clamp(0, grad_logits.shape[1] - 1)[:, None],
                                         -inside.float()[:, None])
                grad_logits = grad_logits.mul_(scale).to(hidden.dtype)
            if grad_bias is not None:
                grad_bias[start:end] = grad_logits.float().sum(0)
            grad_hidden += grad_logits @ weight[start:end]
            torch.mm(grad_logits.t(), hidden, out=grad_weight[start:end])  # into its rows: no [block, h] temporary
        return grad_hidden.to(hidden.dtype), grad_weight, grad_bias, None, None, None


def _writable_fp32(block: torch.Tensor, kept: bool) -> torch.Tensor:
    """The block as fp32 that may be overwritten: itself when it is fp32 and nobody keeps it, else an fp32 copy."""
    return block if block.dtype == torch.float32 and not kept else block.to(torch.float32, copy=True)


def _log_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension of an fp32 block that may be overwritten: in place after the max, so the
    block is the only block-sized tensor (torch.logsumexp makes more inside; on a 2-core CPU at 1,024 tokens x
    8,064, the bf16 block's copy and this took 3.9 ms against 6.2 for the copy and torch.logsumexp). Infinite
    maxima are handled as torch.logsumexp does."""
    top = logits.amax(dim=-1)
    top = top.masked_fill(top.isinf(), 0.0)
    return logits.sub_(top[:, None]).exp_().sum(dim=-1).log_().add_(top)


def _block_forward(raw: torch.Tensor, shifted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's (label logit or 0 where the label is elsewhere, log-sum-exp), fp32; `shifted`: label - start."""
    width = raw.shape[1]
    logits = raw.float()
    picked = logits.gather(1, shifted.clamp(0, width - 1)[:, None]).squeeze(1)
    picked = torch.where((shifted >= 0) & (shifted < width), picked, 0.0)
    top = logits.amax(dim=-1)
    top = torch.where(top.isinf(), 0.0, top)
    return picked, (logits - top[:, None]).exp().sum(dim=-1).log() + top


def _block_gradient(raw: torch.Tensor, log_sum_exp: torch.Tensor, shifted: torch.Tensor,
                    scale: torch.Tensor) -> torch.Tensor:
    """(softmax - one_hot(label)) × each token's incoming gradient, in the logits' dtype."""
    columns = torch.arange(raw.shape[1], device=raw.device)
    hit = (columns[None, :] == shifted[:, None]).float()
    return (((raw.float() - log_sum_exp[:, None]).exp() - hit) * scale).to(raw.dtype)


# Modes without CUDA graphs: a graph's replay writes its outputs into the same memory every time, and each step
# calls these functions once per block while the earlier blocks' outputs are still in use.
_WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def fused_blocks(backend: str = "inductor", mode: str | None = None) -> tuple:
    """The two block functions compiled with the run's backend and mode, less CUDA graphs (shapes: static first,
    dynamic after)."""
    mode = _WITHOUT_CUDA_GRAPHS.get(mode or "default", mode or "default")
    if (backend, mode) not in _FUSED:
        _FUSED[backend, mode] = (torch.compile(_block_forward, backend=backend, mode=mode),
                                 torch.compile(_block_gradient, backend=backend, mode=mode))
    return _FUSED[backend, mode]


def chunked_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               labels: torch.Tensor, block: int | None = None,
                               compiled: tuple[str, str | None] | None = None) -> torch.Tensor:
    """Per-token loss [*labels.shape] of the head (weight, bias) on hidden [..., h], as autocast would compute
    `cross_entropy(linear(hidden).float())`: the matmuls in autocast's dtype where it is on, the loss in fp32.
    `compiled` (backend, mode): on CUDA, each block's elementwise work as compiled kernels (`fused_blocks`)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    targets = labels.reshape(-1).long()
    block = block or block_size(weight.shape[0], flat.shape[0], device)
    with torch.autocast(device, enabled=False):
        fused = fused_blocks(*compiled) if compiled is not None and hidden.is_cuda else None
        losses = ChunkedHeadCrossEntropy.apply(flat, weight.to(dtype), None if bias is None else bias.to(dtype),
                                               targets, block, fused)
    return losses.view(labels.shape)
