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

- p2p (ring): the K/V blocks travel around the CP ring (one send/recv per step, `RingShift`); each step's partial
  attention (with its log-sum-exp) is merged by log-sum-exp. Causal chunk pairs wholly in the future are skipped,
  the diagonal chunk is causal. Autograd keeps each received block for backward (the blocks' memory of allgather,
  the ring's communication pattern); the backward passes the gradients back around the ring. Each block's attention
  is written out (`block_attention`: its scores are kept, fp32), because the merge needs the gradient through each
  block's log-sum-exp, which SDPA's fused kernels return without one; a fused block kernel with its own backward
  (Megatron-Core's, through Transformer Engine) is what long sequences on GPUs want next.
- allgather: K/V (and document ids) all-gathered, one attention of the local queries over all keys under the
  global causal/document/window mask.
- a2a (Ulysses): all-to-all from the sequence split to a head split, attention over the whole sequence for
  heads/CP (and key/value groups/CP) heads, all-to-all back.

Every mask is built from global positions: causal, same document, sliding window; attention sinks (gpt-oss) and
ALiBi are handled in each path; MLA's value head size may differ from the key's.
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


def _block_scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  alibi: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scores of a block, -inf where not allowed and 0 across a row with no allowed key; and that row flag."""
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
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


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attentions over disjoint key sets → the attention over their union, by log-sum-exp."""
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
    out = sum(torch.exp(part_lse - lse) * part_out for part_out, part_lse in parts)
    assert isinstance(out, torch.Tensor)
    return out, lse


def with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Attention sinks from a merged result: the softmax over keys and sink (value 0) is the keys' output times
    Z / (Z + exp(sink)) = sigmoid(lse - sink), as models/attention.py's FlexAttention path does."""
    if sink is None:
        return out
    return out * torch.sigmoid(lse - sink.float()[None, :, None, None])


class RingShift(torch.autograd.Function):
    """Send a tensor to the next rank of the ring and receive the previous rank's; backward sends the gradient
    back (to the previous rank, from the next)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, forward_step: int) -> torch.Tensor:
        ctx.group, ctx.step = group, forward_step
        return _shift(tensor.contiguous(), group, forward_step)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _shift(grad.contiguous(), ctx.group, -ctx.step), None, None


def _shift(tensor: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    to = dist.get_global_rank(group, (rank + step) % size)
    source = dist.get_global_rank(group, (rank - step) % size)
    ops = [dist.P2POp(dist.isend, tensor, to, group), dist.P2POp(dist.irecv, received, source, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


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
        state = self.state
        current = [torch.cat([k, v], dim=-1)]  # one message per step (MLA's value size may differ from the key's)

        def fetch(step: int) -> torch.Tensor:
            if step:
                current[0] = RingShift.apply(current[0], state.group, 1)
            return current[0]

        return ring_attention(q, k.shape[-1], fetch, state, self.window, dropout_p, alibi, sink)

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

def ring_attention(q: torch.Tensor, key_size: int, fetch: Callable[[int], torch.Tensor], state: ContextParallelState,
                   window: int | None, dropout_p: float, alibi: torch.Tensor | None,
                   sink: torch.Tensor | None) -> torch.Tensor:
    """The ring's attention of this rank's queries: `fetch(i)` gives step i's K/V block (keys and values
    concatenated on the last dimension, `key_size` of it keys), that of rank (r - i) mod CP. Per pair of (query
    chunk, key chunk) of global chunk indices (a, b), b > a is wholly in the future and skipped; the partial
    results of each query chunk are merged by log-sum-exp."""
    length = q.shape[2]
    half = length // 2
    q_pos = state.positions(length, q.device)
    q_chunks = [(q[:, :, :half], q_pos[:half]), (q[:, :, half:], q_pos[half:])]
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    for step in range(state.size):
        block = fetch(step)
        block_k, block_v = block[..., :key_size], block[..., key_size:]
        source = (state.rank - step) % state.size
        k_pos = state.positions(length, q.device, source)
        k_chunks = [(block_k[:, :, :half], block_v[:, :, :half], k_pos[:half]),
                    (block_k[:, :, half:], block_v[:, :, half:], k_pos[half:])]
        for which, (q_part, q_at) in enumerate(q_chunks):
            query_chunk = _chunk_index(state, which)
            for key_which, (k_part, v_part, k_at) in enumerate(k_chunks):
                if _chunk_index(state, key_which, source) > query_chunk:
                    continue  # wholly in the future
                allowed = allowed_mask(q_at, k_at, state.documents, window)
                parts[which].append(block_attention(q_part, k_part, v_part, allowed, q_at, k_at, alibi, dropout_p))
    halves = [with_sink(*merge(chunk_parts), sink) for chunk_parts in parts]
    return torch.cat(halves, dim=2).to(q.dtype)


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
    caller gave none. Returns the shared state."""
    state = ContextParallelState(group, size, rank, comm_type)
    for layer, module in attention_modules(model):
        if not module.causal:
            raise ValueError("context parallelism splits a causal model's sequence: bidirectional (BERT) attention "
                             "is not served; drop --context-parallel-size")
        module.core = ContextParallelCore(state, window_of_layer(layer))  # type: ignore[assignment]

    state.attach(model)
    model.context_parallel = state  # type: ignore[assignment]  # pipeline stage views attach it too
    return state


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
