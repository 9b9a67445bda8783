"""The chunked head + loss with its blocks' elementwise work compiled (what --torch-compile runs on CUDA) computes
what the eager blocks compute, on the GPU, in bf16 autocast and in fp32, with ignored labels and a last block
narrower than the others (a second shape for the compiled functions).

    python -m pytest tests/gpu/test_gpu_fused_loss.py -v      # skipped without CUDA
"""

from __future__ import annotations

import pytest
import torch

from rapidtrain.models.chunked_loss import chunked_head_cross_entropy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_blocks_equal_the_eager_blocks_on_cuda(dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 512, 256, generator=generator).cuda().requires_grad_()
    weight = (torch.randn(5000, 256, generator=generator) * 0.05).cuda().requires_grad_()
    labels = torch.randint(0, 5000, (2, 512), generator=generator).cuda()
    labels[0, :9] = -100
    weights = torch.rand(2, 512, generator=generator).cuda()

    def run(compiled):
        hidden.grad = weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            losses = chunked_head_cross_entropy(hidden, weight, None, labels, block=2048, compiled=compiled)
        (losses * weights).sum().backward()
        return losses.detach(), hidden.grad.clone(), weight.grad.clone()

    expected = run(None)
    for _ in range(2):  # the first call compiles (static shapes, then the narrower last block)
        got = run(("inductor", None))
    assert got[0][0, :9].eq(0).all()
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-4)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for mine, theirs in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=tolerance * theirs.abs().max().item())
