"""The built-in GPT computes head + cross-entropy over blocks of the vocabulary (models/chunked_loss.py): the same
losses and gradients as head(hidden) then the plain loss, with less memory held for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rapidtrain.models import build_model
from rapidtrain.models.chunked_loss import chunked_head_cross_entropy
from rapidtrain.models.config import ModelConfig

CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                     vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0)


def plain_loss(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.masked_fill(labels < 0, -100).flatten(),
                           reduction="none").view(labels.shape)


def head_inputs(bias: bool):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 50, 32, generator=generator).requires_grad_()
    weight = (torch.randn(1000, 32, generator=generator) * 0.2).requires_grad_()
    bias_ = torch.randn(1000, generator=generator).requires_grad_() if bias else None
    labels = torch.randint(0, 1000, (3, 50), generator=generator)
    labels[0, :7], labels[1, 3] = -100, -1  # ignored tokens: loss 0, no gradient
    weights = torch.rand(3, 50, generator=generator)  # an uneven per-token gradient, as the loss mask gives
    return hidden, weight, bias_, labels, weights


def losses_and_grads(loss_fn, bias: bool, autocast: bool):
    hidden, weight, bias_, labels, weights = head_inputs(bias)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = loss_fn(hidden, weight, bias_, labels)
    inputs = [hidden, weight] + ([bias_] if bias else [])
    return losses, torch.autograd.grad((losses * weights).sum(), inputs)


@pytest.mark.parametrize("block", [64, 1000])  # many vocabulary blocks (fp32 logits recomputed), or one (kept)
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_and_gradients_equal_the_plain_loss_in_fp32(block, bias):
    expected, expected_grads = losses_and_grads(plain_loss, bias, autocast=False)
    losses, grads = losses_and_grads(
        lambda h, w, b, y: chunked_head_cross_entropy(h, w, b, y, block=block), bias, autocast=False)
    assert losses.dtype == torch.float32 and losses[0, :7].eq(0).all() and losses[1, 3] == 0
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-5)
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


def test_chunked_loss_under_bf16_autocast_matches_autocast_linear_then_fp32_loss():
    expected, expected_grads = losses_and_grads(plain_loss, True, autocast=True)
    losses, grads = losses_and_grads(lambda h, w, b, y: chunked_head_cross_entropy(h, w, b, y, block=128),
                                     True, autocast=True)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-4)  # the same bf16 logits, then fp32
    # bf16 gradients: each block rounds alike, the fp32 sums over blocks differ a little.
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


def fused_eager(h, w, b, y, block):
    """The fused path's block functions, uncompiled (the CPU never takes the fused path by itself)."""
    from rapidtrain.models.chunked_loss import ChunkedHeadCrossEntropy, _block_forward, _block_gradient

    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else h.dtype
    with torch.autocast("cpu", enabled=False):
        losses = ChunkedHeadCrossEntropy.apply(h.reshape(-1, h.shape[-1]).to(dtype), w.to(dtype),
                                               None if b is None else b.to(dtype), y.reshape(-1).long(), block,
                                               (_block_forward, _block_gradient))
    return losses.view(y.shape)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("block", [64, 1000])
def test_the_fused_block_functions_compute_what_the_eager_blocks_compute(autocast, block):
    """--torch-compile on CUDA runs each block's elementwise work as compiled functions: the same loss and gradients
    as the eager blocks (fp32: to rounding; bf16: the gradient rounds to bf16 once, as the eager block does)."""
    expected, expected_grads = losses_and_grads(
        lambda h, w, b, y: chunked_head_cross_entropy(h, w, b, y, block=block), True, autocast)
    losses, grads = losses_and_grads(lambda h, w, b, y: fused_eager(h, w, b, y, block), True, autocast)
    assert losses[0, :7].eq(0).all() and losses[1, 3] == 0
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-5)
    for grad, reference in zip(grads, expected_grads, strict=True):
        tolerance = 1e-5 if not autocast else 1e-2
        torch.testing.assert_close(grad, reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())


def test_compiled_blocks_are_taken_on_cuda_only():
    """`compiled` asks for the fused blocks; a CPU tensor keeps the eager blocks, bit for bit (the layouts' parity
    tests run --torch-compile on the CPU)."""
    expected, expected_grads = losses_and_grads(
        lambda h, w, b, y: chunked_head_cross_entropy(h, w, b, y, block=64), False, False)
    losses, grads = losses_and_grads(
        lambda h, w, b, y: chunked_head_cross_entropy(h, w, b, y, block=64, compiled=("inductor", None)), False, False)
    assert torch.equal(losses, expected)
    assert all(torch.equal(g, r) for g, r in zip(grads, expected_grads, strict=True))


def saved_bytes(model, tokens, labels, autocast: bool) -> int:
    """Bytes autograd keeps for backward in the model's forward."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(tokens, labels=labels).sum().backward()
    return total


@pytest.mark.parametrize("autocast", [False, True])
def test_gpt_chunked_loss_matches_the_plain_loss_and_keeps_less_for_backward(autocast):
    config = ModelConfig(**{**CONFIG.__dict__, "vocab_size": 50304})
    model = build_model(config, seed=3)
    generator = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 50304, (4, 32), generator=generator) for _ in range(2))
    results = {}
    for chunked in (False, True):
        model.loss.chunked = chunked
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels=labels)
        loss.mean().backward()
        results[chunked] = (loss.detach(), [p.grad.clone() for p in model.parameters()],
                            saved_bytes(model, tokens, labels, autocast))
    (plain, plain_grads, plain_bytes), (chunked, chunked_grads, chunked_bytes) = results[False], results[True]
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-4)
    tolerance = 2e-2 if autocast else 1e-4
    # Absolute tolerance on the scale of all gradients: k_proj's bias has a gradient of zero up to rounding.
    scale = max(reference.abs().max().item() for reference in plain_grads)
    for grad, reference in zip(chunked_grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=tolerance, atol=tolerance * scale)
    # The plain loss keeps log_softmax's fp32 output besides the logits; the chunked one keeps no fp32 copy.
    fp32_logits_bytes = tokens.numel() * 50304 * 4
    assert plain_bytes - chunked_bytes >= 0.99 * fp32_logits_bytes, (chunked_bytes, plain_bytes)


def test_a_hooked_head_keeps_the_plain_path():
    """Whatever transforms the head from outside (tensor parallelism, ZeRO-3's gathering hooks) sees it called."""
    model = build_model(CONFIG, seed=3)
    calls = []
    model.output.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 1000, (2, 32))
    model(tokens, labels=tokens)
    assert calls == [1] and not model.loss.can_fuse_head(model.output)


def test_compiled_blocks_never_use_cuda_graphs():
    """Each step calls the block functions once per block while earlier outputs are in use: a CUDA-graph replay
    would rewrite them, so the graph modes compile as their graph-free siblings."""
    from rapidtrain.models.chunked_loss import fused_blocks

    assert fused_blocks("inductor", "reduce-overhead") is fused_blocks("inductor", None)
    assert fused_blocks("inductor", "max-autotune") is fused_blocks("inductor", "max-autotune-no-cudagraphs")
