"""models/dropout.py: the CPU dropout masks drawn from random 64-bit words keep the share asked, scale to an unbiased
mean, repeat under the same seed, and the hidden dropout built on them behaves as F.dropout (identity in eval and at
p = 0, the gradient is the mask times the scale, the kept tensor the input's size as the memory plan counts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidtrain.models.dropout import Dropout, dropout, keep_mask


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.97])
def test_keep_mask_keeps_the_share_asked_and_scales_to_an_unbiased_mean(dropout_p):
    """models/dropout.py's masks: over 2²⁰ draws the kept share is 1 - p within 5 standard errors, the scale is the
    inverse of the probability the mask actually keeps (so the mean of mask · scale is 1), the same seed draws the same
    mask, and no 16-bit lane is stuck (each of the four draws a word gives keeps its share)."""
    torch.manual_seed(11)
    keep, scale = keep_mask((1 << 10, 1 << 10), dropout_p, torch.device("cpu"))
    share = keep.double().mean().item()
    error = (dropout_p * (1 - dropout_p) / keep.numel()) ** 0.5
    assert abs(share - (1 - dropout_p)) < 5 * error
    assert abs(scale * round((1 - dropout_p) * 65536) / 65536 - 1) < 1e-12
    assert abs((1 - dropout_p) * scale - 1) < 2 ** -16 / (1 - dropout_p)
    lanes = keep.view(-1, 4).double().mean(0)
    assert ((lanes - (1 - dropout_p)).abs() < 5 * 2 * error).all(), lanes
    torch.manual_seed(11)
    assert torch.equal(keep_mask((1 << 10, 1 << 10), dropout_p, torch.device("cpu"))[0], keep)


def test_dropout_behaves_as_torch_s():
    """Identity in eval and at p = 0; in training the output is the input times the mask times 1/keep (the kept
    share 1 - p over 2¹⁸ elements), its gradient the same mask and scale, and autograd keeps one tensor of the
    input's dtype and size for it (F.dropout's CPU mask, what config/activations.py counts)."""
    x = torch.randn(1 << 9, 1 << 9, dtype=torch.bfloat16, requires_grad=True)
    module = Dropout(0.25)
    assert module.eval()(x) is x and dropout(x, 0.0, True) is x and module.extra_repr() == "p=0.25"
    module.train()
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = module(x)
    assert len(kept) == 1 and kept[0].dtype == x.dtype and kept[0].shape == x.shape
    mask = out != 0
    assert abs(mask.double().mean().item() - 0.75) < 5 * (0.25 * 0.75 / x.numel()) ** 0.5
    scale = 65536 / round(0.75 * 65536)
    torch.testing.assert_close(out, (x.float() * mask * scale).to(x.dtype), rtol=0, atol=0)
    grad = torch.randn_like(x)
    out.backward(grad)
    torch.testing.assert_close(x.grad, (grad.float() * mask * scale).to(x.dtype), rtol=0, atol=0)
    # Where it does not draw its own masks it is torch's: a CUDA device or a tensor subclass take F.dropout.
    param = torch.nn.Parameter(torch.randn(64, 64))
    torch.manual_seed(3)
    expected = F.dropout(param.detach(), 0.5, True)
    torch.manual_seed(3)
    assert torch.equal(dropout(param, 0.5, True).detach(), expected)


@pytest.mark.parametrize("dropout_p", [0.0, 1e-6, 2 ** -17, 0.1, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 11), ((1 << 16) + 3,)])
def test_keep_mask_at_the_edges_of_p_and_odd_sizes(dropout_p, shape):
    """At every p, odd element counts included: the share kept is the level kept, round((1 - p) · 2¹⁶) / 2¹⁶, within
    5 binomial standard errors, and the scale is its inverse; below 2⁻¹⁷ (p = 0 and 1e-6: --hidden-dropout 1e-6
    passes the flag's [0, 1) check) that level is every level, so all is kept at scale 1 (2¹⁵ compared with the
    int16 draws had wrapped to -2¹⁵ and dropped everything); p = 1 drops everything."""
    torch.manual_seed(5)
    keep, scale = keep_mask(shape, dropout_p, torch.device("cpu"))
    assert keep.shape == shape and keep.dtype == torch.bool
    if dropout_p == 1:
        assert not keep.any() and scale == 0
        return
    kept = round((1 - dropout_p) * 65536) / 65536
    assert scale == 1 / kept
    if kept == 1:
        assert keep.all()
        return
    error = (kept * (1 - kept) / keep.numel()) ** 0.5
    assert abs(keep.double().mean().item() - kept) <= 5 * error + 1 / keep.numel()


def test_a_tiny_dropout_keeps_everything_and_a_negative_one_is_refused():
    """dropout at p = 1e-6 is the identity (it zeroed every element); p < 0 is refused as F.dropout and
    nn.Dropout refuse it (it kept a wrapped-around share)."""
    x = torch.randn(4, 33)
    assert torch.equal(dropout(x, 1e-6, True), x)
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout(x, -0.1, True)
    with pytest.raises(ValueError, match="between 0 and 1"):
        keep_mask((3,), 1.5, torch.device("cpu"))
    with pytest.raises(ValueError, match="between 0 and 1"):
        Dropout(-0.1)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 200), st.integers(0, 9), st.sampled_from([0.1, 0.5, 0.9]), st.integers(0, 2 ** 16))
def test_a_mask_is_the_prefix_of_a_longer_one_from_the_same_seed(n, more, dropout_p, seed):
    """Each element takes the 16 bits of its own place in the words drawn, in order, the last word's leftover lanes
    unused: from one seed the mask of n elements is the first n of any longer mask's, whatever its shape."""
    torch.manual_seed(seed)
    short, _ = keep_mask((n,), dropout_p, torch.device("cpu"))
    torch.manual_seed(seed)
    longer, _ = keep_mask((1, n + more), dropout_p, torch.device("cpu"))
    assert torch.equal(longer.flatten()[:n], short)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 4 * 64 + 3])
def test_every_element_keeps_its_share_the_tail_of_the_last_word_included(n):
    """Over 4,000 draws of an n-element mask, each of the last (up to) four elements, which share the last random
    word and the first elements', is kept with probability 1 - p within 5 binomial standard errors."""
    torch.manual_seed(2)
    draws = torch.stack([keep_mask((n,), 0.3, torch.device("cpu"))[0] for _ in range(4000)]).double()
    kept = round(0.7 * 65536) / 65536
    error = (kept * (1 - kept) / 4000) ** 0.5
    for share in (*draws[:, -4:].mean(0), draws[:, 0].mean()):
        assert abs(share.item() - kept) < 5 * error


def test_masks_come_from_the_generator_state_the_checkpoint_saves():
    """keep_mask draws from torch's global CPU generator, which checkpoint/checkpointer.py's rng_state saves: a run
    that restores that state with set_rng_state draws the masks the uninterrupted run drew next (Megatron-style
    exact resume), and a draw advances the state (the next mask differs)."""
    from rapidtrain.checkpoint.checkpointer import rng_state, set_rng_state

    cpu = torch.device("cpu")
    torch.manual_seed(7)
    keep_mask((10, 10), 0.5, cpu)
    saved = rng_state()
    uninterrupted = [keep_mask((10, 10), 0.5, cpu)[0] for _ in range(3)]
    assert not torch.equal(uninterrupted[0], uninterrupted[1])
    torch.manual_seed(123)  # a fresh process
    set_rng_state(saved)
    resumed = [keep_mask((10, 10), 0.5, cpu)[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))
    x = torch.randn(10, 10)
    set_rng_state(saved)
    assert torch.equal(dropout(x, 0.5, True) != 0, uninterrupted[0])
