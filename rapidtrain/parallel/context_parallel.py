"""Context parallelism (--context-parallel-size, --cp-comm-type) and DeepSpeed-Ulysses (--ds-sequence-parallel-size):
each micro-batch's sequence is split over the ranks of the mesh's "cp" dimension and attention is exchanged across
them, applied from outside the model: the batch is split before the forward (`split_batch`), a pre-forward hook on
the model takes the document ids (--reset-attention-mask) out of its call, and each attention module's core (its
`core` attribute, `models.attention.attend` by default) is replaced by a `ContextParallelCore`.

Splits. p2p and allgather: Megatron-Core's load balance, the sequence cut into 2·CP chunks of which rank r keeps
chunks r and 2·CP-1-r, so each rank has the same causal work. a2a (Ulysses): rank r keeps the r-th of CP contiguous
parts (every rank attends over the whole sequence for its heads, so the split needs no balance). Position ids stay
the global ones (rope and learned positions read them); the loss is the per-token sum over the local tokens, reduced
with the token counts over the data × context ranks by the step (train/step.py).

Exchanges: p2p and allgather written here on torch.distributed's collectives with autograd
(`torch.autograd.Function` where a collective has none of its own), because torch's
`torch.distributed.tensor.experimental.context_parallel` only runs on CUDA's SDPA flash/efficient/cuDNN kernels (it
patches those aten ops; CPU/gloo and the explicit and masked kernels have none) and takes no document mask; a2a is
DeepSpeed's `deepspeed.sequence.layer.DistributedAttention` (it runs on gloo too), around the model's kernel under
the global mask built here:

- p2p (ring): the K/V blocks travel around the CP ring (one send/recv per step, `RingExchange`, started before the
  step's compute so the next block arrives while the current one is used); each step's partial attention is merged
  into a running output and log-sum-exp. Causal chunk pairs wholly in the future are skipped, the diagonal chunk is
  causal. Memory-efficient as Megatron-Core's (Transformer Engine's) ring and ring-flash-attention: forward keeps for
  backward only the local q, k, v, the output and the log-sum-exp (`_RingAttention`), never the received blocks;
  backward runs the ring again, passing each K/V block with its dK/dV accumulator (which returns to the block's
  owner after CP steps), recomputing each block pair's scores (and its dropout mask, from a per-pair seed). At
  most two blocks (and two accumulators) are in flight. Plain causal attention on a CPU runs each block pair
  through aten's flash kernel for CPUs, which returns its log-sum-exp, and its backward, handed the whole
  sequence's output and log-sum-exp as ring-flash-attention hands flash attention's (`fused_blocks`; measured on
  this repository's 2-core AMD EPYC, CP 2 simulated, 4,096 tokens, 8 heads of 64: forward and backward in a fifth
  of the CPU time and half the peak memory of the written-out blocks). Other masks, ALiBi, sinks, dropout and CUDA
  write the blocks out in torch ops (fp32 scores, one (s/2)² pair at a time); CUDA's flash/efficient kernels with
  their log-sum-exp (Megatron-Core's through Transformer Engine) are what long sequences on GPUs want next.
- allgather: K/V (and document ids) all-gathered, one attention of the local queries over all keys under the
  global causal/document/window mask.
- a2a (Ulysses): all-to-all from the sequence split to a head split, attention over the whole sequence for
  heads/CP (and key/value groups/CP) heads, all-to-all back.

Every mask is built from global positions: causal, same document, sliding window; attention sinks (gpt-oss) and
ALiBi are handled in each path; MLA's value head size may differ from the key's. An MoE layer's balancing loss
counts the experts' assignments of whole sequences (`SequenceCounts`: summed over the CP group, as Megatron-Core
sums them over TP × CP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rapidtrain.models.attention import attend
from rapidtrain.models.moe import moe_layers

if TYPE_CHECKING:
    from rapidtrain.config.settings import Plan
    from rapidtrain.parallel.mesh import ParallelMesh

# Batch keys split along their sequence (last) dimension; other keys travel whole.
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids", "input_ids")


def load_balanced(comm_type: str) -> bool:
    """p2p and allgather split into 2·CP chunks (r and 2·CP-1-r); a2a into CP contiguous parts."""
    return comm_type != "a2a"


def local_positions(seq_length: int, size: int, rank: int, balanced: bool,
                    device: torch.device | None = None) -> torch.Tensor:
    """The global positions of the tokens context-parallel rank `rank` of `size` keeps, in its order."""
    if not balanced:
        part = seq_length // size
        return torch.arange(rank * part, (rank + 1) * part, device=device)
    chunk = seq_length // (2 * size)
    first, second = rank, 2 * size - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def split_batch(batch: Any, size: int, rank: int, comm_type: str) -> Any:
    """This rank's part of a micro-batch (a dict of [b, s] tensors or arrays): every SEQUENCE_KEYS entry whose last
    dimension is the sequence keeps the positions `local_positions` names. A dense attention mask cannot be split
    this way (the data gives document ids under context parallelism instead): refused."""
    if size == 1 or not isinstance(batch, dict):
        return batch
    if batch.get("attention_mask") is not None and "tokens" in batch:
        raise ValueError("context parallelism splits the sequence, and this batch carries a dense [s, s] attention "
                         "mask: give document ids (the built-in data does) or drop --context-parallel-size")
    seq_length = next(torch.as_tensor(batch[key]).shape[-1] for key in SEQUENCE_KEYS if key in batch)
    index = local_positions(seq_length, size, rank, load_balanced(comm_type))
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch:
            value = torch.as_tensor(batch[key])
            if value.shape[-1] != seq_length:
                raise ValueError(f"context parallelism: batch entry {key!r} has {value.shape[-1]} positions, the "
                                 f"tokens {seq_length}: every sequence entry must have the sequence's length")
            out[key] = value.index_select(-1, index)
    return out


@dataclass
class ContextParallelState:
    """What every attention core of one model shares: the CP group and this rank's place in it, and the current
    forward's document ids in global order (set by the model's pre-forward hook; None without document masks)."""

    group: dist.ProcessGroup | None  # None only where ranks are simulated in one process (tests)
    size: int
    rank: int
    comm_type: str
    documents: torch.Tensor | None = None  # [b, S] in global order

    @property
    def balanced(self) -> bool:
        return load_balanced(self.comm_type)

    def positions(self, local_length: int, device: torch.device, rank: int | None = None) -> torch.Tensor:
        return local_positions(local_length * self.size, self.size, self.rank if rank is None else rank,
                               self.balanced, device)

    def gathered_positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """Global positions of a rank-ordered all-gather of every rank's local tokens."""
        return torch.cat([self.positions(local_length, device, r) for r in range(self.size)])

    def attach(self, model: nn.Module) -> None:
        """A pre-forward hook on `model` (a whole model or a pipeline stage's view): the document ids leave its
        call for this state (gathered into global order for the cores), and the global position ids are given
        where the caller gave none."""
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("attention_mask") is not None:
            raise ValueError("context parallelism builds the attention mask from global positions and document "
                             "ids: a dense attention_mask cannot be split over the sequence")
        self.set_documents(kwargs.pop("document_ids", None))
        tokens = args[0] if args else kwargs.get("input_ids")
        if kwargs.get("position_ids") is None and len(args) < 2 and tokens is not None and tokens.dim() >= 2:
            kwargs["position_ids"] = self.positions(tokens.shape[1], tokens.device)[None]
        return args, kwargs

    def set_documents(self, local: torch.Tensor | None) -> None:
        """Gather this forward's local document ids [b, s] into global order (no gradient: ids)."""
        if local is None:
            self.documents = None
            return
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        gathered = torch.cat(parts, dim=-1)
        order = self.gathered_positions(local.shape[-1], local.device)
        documents = torch.empty_like(gathered)
        documents[:, order] = gathered
        self.documents = documents


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, documents: torch.Tensor | None,
                 window: int | None) -> torch.Tensor:
    """Bool [b or 1, 1, sq, sk], True = may attend: causal by global position, the same document, within the
    sliding window. Every query sees itself (the diagonal is never masked)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
    allowed = allowed[None, None]
    if documents is not None:
        q_doc, k_doc = documents[:, q_pos], documents[:, k_pos]
        allowed = allowed & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    return allowed


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    q_pos: torch.Tensor, k_pos: torch.Tensor, alibi: torch.Tensor | None,
                    dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention written out: (output fp32 [b, h, sq, dv], log-sum-exp fp32 [b, h, sq, 1]). A row with
    no allowed key gives output 0 and log-sum-exp -inf, with finite gradients (its scores are made finite before
    the log-sum-exp and its probabilities multiplied by 0), so the merge can add such blocks.

    Without dropout the scores are not kept for backward (`_BlockAttention` recomputes them there, one block at a
    time, as flash attention does); with dropout autograd keeps them (its masks are drawn once)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if dropout_p == 0:
        out, lse = _BlockAttention.apply(q, k, v, allowed, q_pos, k_pos, alibi)
        return out, lse
    scores, any_allowed = _block_scores(q, k, allowed, q_pos, k_pos, alibi)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse) * any_allowed
    out = F.dropout(probs, dropout_p).to(v.dtype) @ v
    return out.float(), lse.masked_fill(~any_allowed, float("-inf"))


def _accumulation(q: torch.Tensor) -> torch.dtype:
    """Scores, outputs and gradients are computed in fp32 (fp64 where the inputs are: the tests' finite
    differences)."""
    return torch.promote_types(q.dtype, torch.float32)


def _block_scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  alibi: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scores of a block, -inf where not allowed and 0 across a row with no allowed key; and that row flag."""
    scores = (q @ k.transpose(-2, -1)).to(_accumulation(q)) * q.shape[-1] ** -0.5
    if alibi is not None:
        scores = scores - alibi[:, None, None] * (q_pos[:, None] - k_pos[None, :]).abs().float()
    any_allowed = allowed.any(dim=-1, keepdim=True)
    return scores.masked_fill(~allowed, float("-inf")).masked_fill(~any_allowed, 0.0), any_allowed


class _BlockAttention(torch.autograd.Function):
    """A block's attention and log-sum-exp whose backward recomputes the block's scores instead of keeping them,
    and takes the log-sum-exp's gradient too (the merge's): with P = softmax(S), out = P·V and lse = logsumexp(S),
    dS = P ∘ (dP - rowsum(dout ∘ out) + dlse) where dP = dout·Vᵀ."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                q_pos: torch.Tensor, k_pos: torch.Tensor,
                alibi: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores, any_allowed = _block_scores(q, k, allowed, q_pos, k_pos, alibi)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        out = ((torch.exp(scores - lse) * any_allowed).to(v.dtype) @ v).float()
        ctx.alibi = alibi
        ctx.save_for_backward(q, k, v, allowed, q_pos, k_pos, out, lse)
        return out, lse.masked_fill(~any_allowed, float("-inf"))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None) -> tuple:
        q, k, v, allowed, q_pos, k_pos, out, lse = ctx.saved_tensors
        scores, any_allowed = _block_scores(q, k, allowed, q_pos, k_pos, ctx.alibi)
        probs = torch.exp(scores - lse) * any_allowed
        dtype = probs.dtype  # fp32 (fp64 where the inputs are)
        grad_out = grad_out.to(dtype)
        grad_v = probs.transpose(-2, -1) @ grad_out
        grad_probs = grad_out @ v.to(dtype).transpose(-2, -1)
        row = (grad_out * out).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            row = row - torch.where(any_allowed, grad_lse.to(dtype), 0.0)
        grad_scores = probs * (grad_probs - row) * q.shape[-1] ** -0.5
        grad_q = grad_scores @ k.to(dtype)
        grad_k = grad_scores.transpose(-2, -1) @ q.to(dtype)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


def with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Attention sinks from a merged result: the softmax over keys and sink (value 0) is the keys' output times
    Z / (Z + exp(sink)) = sigmoid(lse - sink), as models/attention.py's FlexAttention path does."""
    if sink is None:
        return out
    return out * torch.sigmoid(lse - sink.float()[None, :, None, None])


class RingExchange:
    """The ring's transport: `start(tensor, tag)` sends `tensor` to the next rank of the CP group and receives the
    previous rank's tensor of the same shape, and returns a function that waits for the transfer and gives the
    received tensor, so the caller computes while the block travels (two blocks in flight: the one computed on and
    the one arriving). Over torch.distributed's batched isend/irecv; the tag keeps K/V and dK/dV apart where both
    are in flight (backward)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.previous = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, tensor: torch.Tensor, tag: int) -> Callable[[], torch.Tensor]:
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.previous, self.group, tag)]
        requests = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for request in requests:
                request.wait()
            return received

        return wait


KV_TAG, GRADIENT_TAG = 0, 1


@dataclass(frozen=True)
class _RingSettings:
    """What the ring's forward and backward share besides the tensors."""

    state: ContextParallelState
    exchange: Any  # RingExchange, or the one-process simulation of the unit tests
    window: int | None
    dropout_p: float
    seed: int  # the dropout masks' (one generator per block pair, seeded from it: drawn again in backward)
    alibi: torch.Tensor | None
    fused: bool = False  # block pairs through the CPU's flash kernel (`fused_blocks`)
    # This forward's document ids (global order), kept for its backward: a pipeline schedule runs other
    # micro-batches' forwards, which replace the state's, before this one's backward
    documents: torch.Tensor | None = None


def _block_pairs(state: ContextParallelState, step: int, length: int,
                 device: torch.device) -> list[tuple[slice, slice, torch.Tensor, torch.Tensor, bool]]:
    """Ring step `step`'s (query slice, key slice, query positions, key positions, diagonal) of the local queries'
    two chunks against the two chunks of the block from rank (r - step) mod CP; a pair whose key chunk (global chunk
    index) is wholly in the future of its query chunk is left out, the diagonal pair (the same chunk) is causal."""
    half = length // 2
    source = (state.rank - step) % state.size
    q_pos, k_pos = state.positions(length, device), state.positions(length, device, source)
    halves = (slice(0, half), slice(half, length))
    return [(q_at, k_at, q_pos[q_at], k_pos[k_at], key_chunk == query_chunk)
            for which, q_at in enumerate(halves) for key_which, k_at in enumerate(halves)
            if (key_chunk := _chunk_index(state, key_which, source)) <= (query_chunk := _chunk_index(state, which))]


def fused_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                 window: int | None, dropout_p: float, alibi: torch.Tensor | None, sink: torch.Tensor | None) -> bool:
    """Whether the ring's block pairs run through the CPU's flash kernel (aten's
    `_scaled_dot_product_flash_attention_for_cpu`, which returns its log-sum-exp, and its backward, which takes the
    whole sequence's output and log-sum-exp as ring-flash-attention hands flash attention's): on a CPU, for plain
    causal attention (each pair is whole or causal on its diagonal), keys and values of one head size. Masks of
    documents or windows, ALiBi, sinks (a log-sum-exp gradient) and dropout (masks the kernel cannot draw again)
    take the written-out blocks; so does CUDA, whose flash and efficient kernels take other signatures."""
    plain = documents is None and window is None and alibi is None and sink is None and not dropout_p
    return plain and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]


def _dropout_keep(settings: _RingSettings, step: int, pair: int, shape: torch.Size,
                  device: torch.device) -> torch.Tensor:
    """Block pair (step, pair)'s dropout scale (kept / (1 - p), dropped 0), drawn from its own seeded generator, so
    backward draws the same mask instead of keeping it (flash attention's way, its Philox seed and offset)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(settings.seed + 4 * step + pair)
    keep = torch.rand(shape, generator=generator, device=device) >= settings.dropout_p
    return keep / (1 - settings.dropout_p)


def _grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V of key/value groups repeated to the queries' heads (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _ungrouped(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_grouped`: each group's heads summed."""
    b, heads, s, d = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, s, d).sum(dim=2)


class _RingAttention(torch.autograd.Function):
    """The ring's attention of this rank's queries over the whole sequence, memory-efficient as Megatron-Core's
    (Transformer Engine's) and ring-flash-attention's: forward passes the K/V blocks around the ring and merges each
    step's partial attention into a running output and log-sum-exp, keeping for backward only the local q, k, v, the
    output and the log-sum-exp; backward passes the K/V blocks around again with their dK/dV accumulators (each
    rank adds its queries' share to the block it holds; after CP steps every accumulator is back at its owner) and
    recomputes each block pair's scores. Returns (output fp32 [b, h, s, dv], log-sum-exp fp32 [b, h, s, 1])."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                settings: _RingSettings) -> tuple[torch.Tensor, torch.Tensor]:
        state, heads, length, key_size = settings.state, q.shape[1], q.shape[2], k.shape[-1]
        out = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=_accumulation(q))
        lse = torch.full((*q.shape[:3], 1), float("-inf"), dtype=out.dtype, device=q.device)
        block = torch.cat([k, v], dim=-1)  # one message per step (MLA's value size may differ from the key's)
        for step in range(state.size):
            arriving = settings.exchange.start(block, KV_TAG) if step + 1 < state.size else None
            block_k, block_v = (_grouped(t, heads) for t in (block[..., :key_size], block[..., key_size:]))
            for pair, (q_at, k_at, q_pos, k_pos, diagonal) in enumerate(_block_pairs(state, step, length,
                                                                                     q.device)):
                if settings.fused:
                    fused_out, fused_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        q[:, :, q_at], block_k[:, :, k_at], block_v[:, :, k_at], 0.0, diagonal)
                    _merge_into(out[:, :, q_at], lse[:, :, q_at], fused_out.to(out.dtype),
                                fused_lse.unsqueeze(-1).to(out.dtype))
                    continue
                allowed = allowed_mask(q_pos, k_pos, settings.documents, settings.window)
                scores, any_allowed = _block_scores(q[:, :, q_at], block_k[:, :, k_at], allowed, q_pos, k_pos,
                                                    settings.alibi)
                block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
                probs = torch.exp(scores - block_lse) * any_allowed
                if settings.dropout_p:
                    probs = probs * _dropout_keep(settings, step, pair, probs.shape, q.device)
                block_out = (probs.to(v.dtype) @ block_v[:, :, k_at]).to(out.dtype)
                _merge_into(out[:, :, q_at], lse[:, :, q_at], block_out,
                            block_lse.masked_fill(~any_allowed, float("-inf")))
            if arriving is not None:
                block = arriving()
        ctx.settings = settings
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        settings: _RingSettings = ctx.settings
        state, heads, length, key_size = settings.state, q.shape[1], q.shape[2], k.shape[-1]
        dtype = out.dtype
        grad_out = grad_out.to(dtype)
        # dS = P ∘ (dP - rowsum(dO ∘ O) + dlse) for P = exp(S - lse) of the whole sequence (flash attention's
        # backward; rowsum(dO ∘ O) = rowsum(P ∘ dP) holds with dropout too)
        row = (grad_out * out.to(dtype)).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            row = row - grad_lse.to(dtype)
        scale = q.shape[-1] ** -0.5
        grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)
        block = torch.cat([k, v], dim=-1)
        grad_block = torch.zeros(block.shape, dtype=dtype, device=q.device)  # the held block's dK/dV so far
        q_dtype = q.to(dtype)
        for step in range(state.size):
            arriving = settings.exchange.start(block, KV_TAG) if step + 1 < state.size else None
            # in the inputs' dtype (the scores as forward computed them), and in the gradients'
            raw_k, raw_v = _grouped(block[..., :key_size], heads), _grouped(block[..., key_size:], heads)
            block_k, block_v = raw_k.to(dtype), raw_v.to(dtype)
            grad_k, grad_v = torch.zeros_like(block_k), torch.zeros_like(block_v)
            for pair, (q_at, k_at, q_pos, k_pos, diagonal) in enumerate(_block_pairs(state, step, length,
                                                                                     q.device)):
                if settings.fused:  # the kernel's backward from the whole sequence's output and log-sum-exp
                    parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        grad_out[:, :, q_at].to(q.dtype), q[:, :, q_at], raw_k[:, :, k_at],
                        raw_v[:, :, k_at], out[:, :, q_at].to(q.dtype), lse[:, :, q_at].squeeze(-1), 0.0, diagonal)
                    for whole, at, part in zip((grad_q, grad_k, grad_v), (q_at, k_at, k_at), parts, strict=True):
                        whole[:, :, at] += part.to(dtype)
                    continue
                allowed = allowed_mask(q_pos, k_pos, settings.documents, settings.window)
                scores, any_allowed = _block_scores(q[:, :, q_at], raw_k[:, :, k_at], allowed, q_pos, k_pos,
                                                    settings.alibi)
                probs = torch.exp(scores.to(dtype) - lse[:, :, q_at].to(dtype)) * any_allowed
                grad_probs = grad_out[:, :, q_at] @ block_v[:, :, k_at].transpose(-2, -1)
                if settings.dropout_p:
                    keep = _dropout_keep(settings, step, pair, probs.shape, q.device).to(dtype)
                    grad_probs = grad_probs * keep
                    grad_v[:, :, k_at] += (probs * keep).transpose(-2, -1) @ grad_out[:, :, q_at]
                else:
                    grad_v[:, :, k_at] += probs.transpose(-2, -1) @ grad_out[:, :, q_at]
                grad_scores = probs * (grad_probs - row[:, :, q_at]) * scale
                grad_q[:, :, q_at] += grad_scores @ block_k[:, :, k_at]
                grad_k[:, :, k_at] += grad_scores.transpose(-2, -1) @ q_dtype[:, :, q_at]
            grad_block += torch.cat([_ungrouped(grad_k, k.shape[1]), _ungrouped(grad_v, v.shape[1])], dim=-1)
            # the accumulator follows its block to the next rank; after CP steps each rank holds its own
            grad_block = settings.exchange.start(grad_block, GRADIENT_TAG)()
            if arriving is not None:
                block = arriving()
        grad_k, grad_v = grad_block[..., :key_size], grad_block[..., key_size:]
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None


def _merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a partial attention over more keys into the running (out, lse) in place, by log-sum-exp (rows with no
    allowed key so far or in the block have lse -inf: their weights are made 0, not NaN)."""
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(merged), 0.0, merged)
    out.mul_(torch.exp(lse - finite)).add_(block_out * torch.exp(block_lse - finite))
    lse.copy_(merged)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of [b, h, s, d]) in rank order; backward: each rank's slice of the
    summed gradients (a reduce-scatter, as an all-to-all and a sum: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        chunks = torch.stack(grad.chunk(size, dim=2))  # chunk j: the gradient of rank j's slice
        received = torch.empty_like(chunks)
        dist.all_to_all_single(received, chunks, group=ctx.group)
        return received.sum(dim=0), None


class ContextParallelCore:
    """An attention core (the signature of models.attention.attend) over the CP group's split sequence. The
    model's local mask and is_causal are not read: the model attends causally (context parallelism is refused for
    bidirectional models) and the global mask is built here from positions, document ids and `window`."""

    def __init__(self, state: ContextParallelState, window: int | None) -> None:
        self.state = state
        self.window = window
        self._ulysses: nn.Module | None = None
        self._exchange: RingExchange | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, is_causal: bool,
                 dropout_p: float, kernel: Any, alibi: torch.Tensor | None = None,
                 sink: torch.Tensor | None = None) -> torch.Tensor:
        kernel = "sdpa" if kernel == "flex" else kernel  # FlexAttention's BlockMask is the local one: not used
        comm = self.state.comm_type
        if comm == "a2a":
            return self.ulysses(q, k, v, dropout_p, kernel, alibi, sink)
        if comm == "allgather":
            return self.all_gathered(q, k, v, dropout_p, kernel, alibi, sink)
        return self.ring(q, k, v, dropout_p, alibi, sink)

    # ---- allgather ----
    def all_gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, kernel: Any,
                     alibi: torch.Tensor | None, sink: torch.Tensor | None) -> torch.Tensor:
        state, length = self.state, q.shape[2]
        k_all, v_all = (_AllGather.apply(t, state.group) for t in (k, v))
        q_pos = state.positions(length, q.device)
        k_pos = state.gathered_positions(length, q.device)
        allowed = allowed_mask(q_pos, k_pos, state.documents, self.window)
        if alibi is None:
            return attend(q, k_all, v_all, allowed, False, dropout_p, kernel, sink=sink)
        out, lse = block_attention(q, k_all, v_all, allowed, q_pos, k_pos, alibi, dropout_p)
        return with_sink(out, lse, sink).to(q.dtype)

    # ---- p2p ring ----
    def ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
             alibi: torch.Tensor | None, sink: torch.Tensor | None) -> torch.Tensor:
        if self._exchange is None:
            assert self.state.group is not None, "the ring needs the context-parallel process group"
            self._exchange = RingExchange(self.state.group)
        return ring_attention(q, k, v, self._exchange, self.state, self.window, dropout_p, alibi, sink)

    # ---- a2a (Ulysses) ----
    def ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, kernel: Any,
                alibi: torch.Tensor | None, sink: torch.Tensor | None) -> torch.Tensor:
        """DeepSpeed's DistributedAttention over [b, s, h, d] views: all-to-all to heads/CP of the whole sequence
        (rank order is sequence order under the contiguous split), the model's kernel under the global mask, and
        back."""
        state = self.state
        heads = q.shape[1]
        mine = slice(state.rank * heads // state.size, (state.rank + 1) * heads // state.size)
        length = q.shape[2] * state.size
        positions = torch.arange(length, device=q.device)
        plain = state.documents is None and (self.window is None or self.window >= length)
        allowed = None if plain else allowed_mask(positions, positions, state.documents, self.window)
        out = self.distributed_attention()(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, allowed=allowed, causal=plain,
            dropout_p=dropout_p, kernel=kernel, alibi=None if alibi is None else alibi[mine],
            sink=None if sink is None else sink[mine])
        return out.transpose(1, 2)

    def distributed_attention(self) -> nn.Module:
        """deepspeed.sequence.layer.DistributedAttention around the model's kernel, made at the first a2a call
        (DeepSpeed's import and its communication layer only where Ulysses runs)."""
        if self._ulysses is None:
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention

            # DeepSpeed's communication layer over torch's process group (gloo or NCCL), as the ZeRO runner does
            deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
            self._ulysses = DistributedAttention(_heads_attention, self.state.group, scatter_idx=2, gather_idx=1)
        return self._ulysses

def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exchange: Any, state: ContextParallelState,
                   window: int | None, dropout_p: float, alibi: torch.Tensor | None,
                   sink: torch.Tensor | None, seed: int | None = None, fused: bool | None = None) -> torch.Tensor:
    """The ring's attention of this rank's queries q [b, h, s, d] over the whole sequence, from its own keys and
    values k, v [b, groups, s, d or dv] and those `exchange` passes around the ring (`_RingAttention`); attention
    sinks applied on the merged result. With attention dropout each block pair's mask comes from a generator seeded
    from `seed` (drawn from torch's default generator when None, so recompute under activation checkpointing, which
    restores that generator, draws the same). `fused`: whether block pairs run through the CPU's flash kernel
    (`fused_blocks` decides when None)."""
    if dropout_p and seed is None:
        seed = int(torch.randint(2**62, (1,)).item())
    fused = fused_blocks(q, k, v, state.documents, window, dropout_p, alibi, sink) if fused is None else fused
    settings = _RingSettings(state, exchange, window, dropout_p, seed or 0, alibi, fused, state.documents)
    out, lse = _RingAttention.apply(q, k, v, settings)
    return with_sink(out, lse, sink).to(q.dtype)


def _chunk_index(state: ContextParallelState, which: int, rank: int | None = None) -> int:
    """The global chunk index of a rank's first (0) or second (1) chunk under the load-balanced split."""
    rank = state.rank if rank is None else rank
    return rank if which == 0 else 2 * state.size - 1 - rank


def _heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, allowed: torch.Tensor | None,
                     causal: bool, dropout_p: float, kernel: Any, alibi: torch.Tensor | None,
                     sink: torch.Tensor | None) -> torch.Tensor:
    """Ulysses' local attention: [b, s, heads/CP, d] of the whole sequence through the model's kernel."""
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, causal, dropout_p, kernel,
                 alibi=alibi, sink=sink)
    return out.transpose(1, 2)


def attention_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer number, attention module) of every transformer layer the model (or stage) holds."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "core") and hasattr(module, "causal"):
            parts = [p for p in name.split(".") if p.isdigit()]
            found.append((int(parts[0]) if parts else 0, module))
    return found


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, size: int, rank: int, comm_type: str,
                           window_of_layer: Callable[[int], int | None]) -> ContextParallelState:
    """Give every attention module of `model` a context-parallel core and the model a pre-forward hook that takes
    the document ids out of its call (gathered for the cores) and gives it the global position ids where the
    caller gave none; every MoE layer's balancing loss the whole sequences' expert counts. Returns the shared state."""
    state = ContextParallelState(group, size, rank, comm_type)
    for layer, module in attention_modules(model):
        if not module.causal:
            raise ValueError("context parallelism splits a causal model's sequence: bidirectional (BERT) attention "
                             "is not served; drop --context-parallel-size")
        module.core = ContextParallelCore(state, window_of_layer(layer))  # type: ignore[assignment]
    for moe in moe_layers(model).values():  # their balancing losses count the whole sequences' assignments
        moe.whole_sequence_counts = SequenceCounts(group)
    state.attach(model)
    model.context_parallel = state  # type: ignore[assignment]  # pipeline stage views attach it too
    return state


class SequenceCounts:
    """An MoE layer's balancing-loss expert counts summed over the CP group, so they are the whole sequences'
    (Megatron-Core reduces them over TP × CP; a TP rank here routes every token of its sequences already). Each rank's
    loss then weighs its own tokens' mean router probabilities by the whole sequences' fractions: their mean over the
    CP ranks, which the gradient reduction takes, is the whole sequences' balancing loss."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        summed = counts.clone()
        dist.all_reduce(summed, group=self.group)
        return summed


def apply_to_plan(model: nn.Module, plan: Plan, mesh: ParallelMesh) -> ContextParallelState:
    """`apply_context_parallel` with the plan's layout and the model's sliding windows; a model without the
    built-in attention modules (a Hugging Face or user model) is refused."""
    layout = plan.layout
    config = plan.model
    window_of_layer: Callable[[int], int | None] = config.window_of_layer if config is not None else lambda _: None
    if not attention_modules(model):
        raise ValueError(f"--context-parallel-size {layout.context_parallel_size}: context parallelism replaces the "
                         "attention core of rapidtrain's built-in models, and this model has none; drop the flag")
    group = mesh.group("cp")
    assert group is not None, "context parallelism needs its process group"
    return apply_context_parallel(model, group, layout.context_parallel_size, mesh.context_parallel_rank,
                                  layout.cp_comm_type, window_of_layer)
