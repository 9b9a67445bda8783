"""Context parallelism's split and ring attention in one process: every CP rank simulated by its chunks, the
ring's blocks handed over directly, the result (and its gradients) against one attention over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.models.attention import alibi_slopes, eager_attention
from rapidtrain.parallel.context_parallel import (
    ContextParallelState,
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


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", ["causal", "documents", "window", "sink", "alibi", "mla_value_size"])
def test_ring_attention_matches_one_attention_over_the_whole_sequence(cp, case):
    torch.manual_seed(cp)
    b, heads, groups, length, d = 2, 4, 2, 32, 8
    dv = 6 if case == "mla_value_size" else d
    q = torch.randn(b, heads, length, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, groups, length, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, groups, length, dv, dtype=torch.float64, requires_grad=True)
    documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 30 + [1] * 2]) if case == "documents" else None
    window = 5 if case == "window" else None
    sink = torch.randn(heads, dtype=torch.float64) if case == "sink" else None
    alibi = alibi_slopes(heads).double() if case == "alibi" else None

    reference = eager_attention(q, k, v, _reference_mask(documents, length, window), False, 0.0, alibi, sink)
    outputs = torch.empty_like(reference)
    blocks = [torch.cat([k[:, :, local_positions(length, cp, r, True)], v[:, :, local_positions(length, cp, r, True)]],
                        dim=-1) for r in range(cp)]
    for rank in range(cp):
        state = ContextParallelState(None, cp, rank, "p2p", documents)
        mine = local_positions(length, cp, rank, True)
        out = ring_attention(q[:, :, mine], d, lambda step, r=rank: blocks[(r - step) % cp], state, window, 0.0,
                             alibi, sink)
        outputs[:, :, mine] = out
    torch.testing.assert_close(outputs, reference, rtol=1e-5, atol=1e-6)  # both take fp32 scores

    weights = torch.randn_like(reference)
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    got = torch.autograd.grad((outputs * weights).sum(), (q, k, v))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
