"""Context parallelism's split and ring attention in one process: every CP rank a thread holding its chunks, the
ring's blocks handed between the threads (SimulatedRing), the result (and its gradients, each rank's from its own
backward ring) against one attention over the whole sequence."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rapidtrain.models.attention import alibi_slopes, eager_attention
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.moe import MoELayer
from rapidtrain.parallel.context_parallel import (
    ContextParallelState,
    fused_blocks,
    local_positions,
    ring_attention,
    split_batch,
)


def test_load_balanced_split_keeps_chunks_r_and_2cp_minus_1_minus_r():
    assert local_positions(8, 2, 0, balanced=True).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1, balanced=True).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 1, balanced=True).tolist() == [2, 3, 12, 13]
    assert local_positions(8, 2, 1, balanced=False).tolist() == [4, 5, 6, 7]  # a2a: contiguous parts
    every = torch.cat([local_positions(24, 3, r, balanced=True) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def test_split_batch_splits_every_sequence_entry_and_keeps_global_positions():
    tokens = torch.arange(16).reshape(2, 8)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, 8), "position_ids": tokens % 8,
             "document_ids": (tokens % 8 >= 4).long(), "other": torch.zeros(3)}
    part = split_batch(batch, 2, 1, "p2p")
    assert part["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert part["document_ids"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert part["other"].shape == (3,)
    with pytest.raises(ValueError, match="dense"):
        split_batch({"tokens": tokens, "attention_mask": torch.ones(2, 1, 8, 8, dtype=torch.bool)}, 2, 0, "p2p")


def _reference_mask(documents: torch.Tensor | None, length: int, window: int | None) -> torch.Tensor:
    position = torch.arange(length)
    allowed = position[None, :] <= position[:, None]
    if window is not None:
        allowed = allowed & (position[:, None] - position[None, :] < window)
    allowed = allowed[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    return allowed


class SimulatedRing:
    """The ring's transport for CP ranks run as threads of one process: `start` posts this rank's tensor, waits for
    every rank to post its own (a barrier) and takes the previous rank's; the real ring's order of sends and
    receives (K/V, then dK/dV in backward) is then exercised as on a process group."""

    def __init__(self, size: int, rank: int, board: dict, barrier: threading.Barrier) -> None:
        self.size, self.rank, self.board, self.barrier = size, rank, board, barrier
        self.sent_bytes = 0

    def start(self, tensor: torch.Tensor, tag: int):
        self.board[tag, self.rank] = tensor.detach().clone()
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self.barrier.wait()
        received = self.board[tag, (self.rank - 1) % self.size]
        self.barrier.wait()  # every rank has taken its block before the next step posts
        return lambda: received


def run_ranks(cp: int, work):
    """`work(rank, exchange)` on cp threads joined by a SimulatedRing; their results in rank order."""
    board: dict = {}
    barrier = threading.Barrier(cp, timeout=120)

    def one(rank: int):
        try:
            return work(rank, SimulatedRing(cp, rank, board, barrier))
        except BaseException:
            barrier.abort()  # the other ranks stop waiting for this one
            raise

    with ThreadPoolExecutor(cp) as pool:
        return [future.result() for future in [pool.submit(one, rank) for rank in range(cp)]]


def ring_over_ranks(q, k, v, cp, documents=None, window=None, alibi=None, sink=None, dropout_p=0.0, seed=None,
                    weights=None, fused=None):
    """The ring's output over every simulated rank, assembled in global order, and (with `weights`) the gradients of
    sum(output · weights) for q, k, v, each rank's own part computed by its own backward."""
    length = q.shape[2]

    def work(rank, exchange):
        mine = local_positions(length, cp, rank, True)
        q_r, k_r, v_r = (t[:, :, mine].detach().requires_grad_() for t in (q, k, v))
        state = ContextParallelState(None, cp, rank, "p2p", documents)
        out = ring_attention(q_r, k_r, v_r, exchange, state, window, dropout_p, alibi, sink, seed, fused)
        state.documents = None  # as the next micro-batch's forward replaces them, before this one's backward (PP)
        grads = None if weights is None else torch.autograd.grad((out * weights[:, :, mine]).sum(), (q_r, k_r, v_r))
        return mine, out.detach(), grads

    results = run_ranks(cp, work)
    output = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for mine, out, rank_grads in results:
        output[:, :, mine] = out
        for whole, part in zip(grads, rank_grads or (), strict=False):
            whole[:, :, mine] = part
    return output, grads


def _inputs(seed: int, value_size: int = 8, length: int = 32):
    torch.manual_seed(seed)
    b, heads, groups, d = 2, 4, 2, 8
    return tuple(torch.randn(b, n, length, size, dtype=torch.float64)
                 for n, size in ((heads, d), (groups, d), (groups, value_size)))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", ["causal", "causal_written_out", "documents", "window", "sink", "alibi",
                                  "mla_value_size"])
def test_ring_attention_matches_one_attention_over_the_whole_sequence(cp, case):
    """Plain causal attention runs each block pair through the CPU's flash kernel (its forward and backward from
    the whole sequence's output and log-sum-exp), every other case (and causal_written_out) the written-out blocks."""
    q, k, v = _inputs(cp, 6 if case == "mla_value_size" else 8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    heads, length = q.shape[1], q.shape[2]
    documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 30 + [1] * 2]) if case == "documents" else None
    window = 5 if case == "window" else None
    sink = torch.randn(heads, dtype=torch.float64) if case == "sink" else None
    alibi = alibi_slopes(heads).double() if case == "alibi" else None

    reference = eager_attention(q, k, v, _reference_mask(documents, length, window), False, 0.0, alibi, sink)
    weights = torch.randn_like(reference)
    assert fused_blocks(q, k, v, documents, window, 0.0, alibi, sink) == case.startswith("causal")
    outputs, got = ring_over_ranks(q, k, v, cp, documents, window, alibi, sink, weights=weights,
                                   fused=False if case == "causal_written_out" else None)
    torch.testing.assert_close(outputs, reference.detach(), rtol=1e-5, atol=1e-6)  # both take fp32 scores
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_keeps_only_the_local_blocks_for_backward(cp):
    """What the ring's forward saves for backward on a rank: its own q, k, v, the fp32 output and log-sum-exp, never
    a block received from another rank (Megatron-Core's and ring-flash-attention's memory); and its exchange moves
    the other ranks' K/V in forward, again in backward, and the dK/dV accumulators once around the ring."""
    q, k, v = _inputs(0)
    b, heads, length, d = q.shape
    local = length // cp

    def work(rank, exchange):
        mine = local_positions(length, cp, rank, True)
        q_r, k_r, v_r = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        saved: list[torch.Tensor] = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ring_attention(q_r, k_r, v_r, exchange, ContextParallelState(None, cp, rank, "p2p"), None, 0.0,
                                 None, None)
        forward_bytes = exchange.sent_bytes
        out.sum().backward()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        own = {t.untyped_storage().data_ptr() for t in (q_r, k_r, v_r)}
        return storages, own, forward_bytes, exchange.sent_bytes - forward_bytes

    block = b * k.shape[1] * local * (k.shape[-1] + v.shape[-1]) * 8  # one rank's K and V, fp64
    for storages, own, forward_bytes, backward_bytes in run_ranks(cp, work):
        assert own <= set(storages)
        others = sum(n for ptr, n in storages.items() if ptr not in own)
        assert others == b * heads * local * (v.shape[-1] + 1) * 8  # the output and log-sum-exp (fp32; fp64 here)
        assert forward_bytes == (cp - 1) * block
        assert backward_bytes == (cp - 1) * block + cp * block


def test_ring_dropout_backward_redraws_the_forward_masks():
    """With attention dropout the ring's backward draws each block pair's mask again from its seed: the gradient's
    component along a direction equals the forward's own finite difference (fp64, the same seed), and the masks
    change the output."""
    cp, seed = 2, 1234
    q, k, v = _inputs(3)
    weights = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    dropped, grads = ring_over_ranks(q, k, v, cp, dropout_p=0.3, seed=seed, weights=weights)
    plain, _ = ring_over_ranks(q, k, v, cp)
    assert (dropped - plain).abs().max() > 0.1
    torch.manual_seed(7)
    directions = [torch.randn_like(t) for t in (q, k, v)]
    step = 1e-6

    def objective(sign: float) -> float:
        moved = [t + sign * step * u for t, u in zip((q, k, v), directions, strict=True)]
        out, _ = ring_over_ranks(*moved, cp, dropout_p=0.3, seed=seed)
        return float((out * weights).sum())

    numeric = (objective(1) - objective(-1)) / (2 * step)
    analytic = float(sum((g * u).sum() for g, u in zip(grads, directions, strict=True)))
    assert numeric == pytest.approx(analytic, rel=1e-4)


@pytest.mark.parametrize("aux_loss_type", ["aux_loss", "seq_aux_loss"])
def test_moe_balancing_loss_of_sequence_parts_is_the_whole_sequences(aux_loss_type):
    """Two CP ranks' parts (the load-balanced split) of 2 sequences of 16 tokens: with each part's expert counts
    replaced by the whole sequences' (SequenceCounts sums them over the CP group; here the parts' counts are added
    directly), the mean of the parts' balancing losses and of their router gradients (what the gradient reduction
    over CP ranks takes) is the whole sequences' loss and gradient, as Megatron-Core's TP × CP count reduction gives;
    the parts' own counts give another loss."""
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, num_experts=(4,),
                         moe_router_topk=2, moe_token_dropping=False, moe_aux_loss_type=aux_loss_type,
                         ffn_hidden_size=24)
    torch.manual_seed(0)
    layer = MoELayer(config, 4).train()
    layer.returns_aux_loss = True  # the loss itself, not its gradient injected into the output
    x = torch.randn(2, 16, 16)

    def balancing(tokens, reduction):
        layer.whole_sequence_counts = reduction
        layer(tokens)
        loss = layer.last_aux_loss
        return loss.detach(), torch.autograd.grad(loss, layer.router.weight)[0]

    whole, whole_gradient = balancing(x, None)
    parts = [x[:, local_positions(16, 2, rank, True)] for rank in range(2)]
    counts: list[torch.Tensor] = []
    own = [balancing(part, lambda c: counts.append(c) or c)[0] for part in parts]
    assert abs(sum(own) / 2 - whole) > 1e-4  # the parts' own balance is not the sequences'
    summed = [balancing(part, lambda c: counts[0] + counts[1]) for part in parts]
    torch.testing.assert_close(sum(loss for loss, _ in summed) / 2, whole)
    torch.testing.assert_close(sum(gradient for _, gradient in summed) / 2, whole_gradient)
