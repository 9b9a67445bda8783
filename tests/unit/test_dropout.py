"""models/dropout.py: the CPU dropout masks drawn from random 64-bit words keep the share asked, scale to an unbiased
mean, repeat under the same seed, and the hidden dropout built on them behaves as F.dropout (identity in eval and at
p = 0, the gradient is the mask times the scale, the kept tensor the input's size as the memory plan counts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
