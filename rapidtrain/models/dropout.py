"""Dropout masks drawn fast on a CPU.

PyTorch's CPU `bernoulli_` (behind F.dropout) draws one number from the generator per element under its lock: 9.7 ms
for the 1.6 M elements of one layer's attention probabilities at seq 256 × 24 heads, 2.4 ms for one [4, 256, 384]
hidden state (2 threads, Zen 4): with Megatron's default dropout of 0.1 a fifth of a bf16 training step. `random_`
over int64 words fills 64 random bits per draw, 6.5× faster for the same bits; each element then takes 16 of them and
is kept when they fall under round(keep · 2¹⁶): a keep probability within 2⁻¹⁷ of the one asked (0.9 → 0.899994), and
the scale exactly the inverse of the probability kept, so the expectation is unchanged. The draws come from torch's
CPU generator, whose state the checkpoint saves and activation recomputation restores: a resumed or recomputed step
draws the same masks. CUDA (whose dropout is a fused Philox kernel), DTensors (DTensor's own RNG tracker) and compiled
graphs (Inductor's fused random numbers) keep torch's dropout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16


def keep_mask(shape: torch.Size | tuple[int, ...], dropout_p: float,
              device: torch.device) -> tuple[torch.Tensor, float]:
    """(bool mask of `shape`, True = kept; the scale 1 / keep probability the kept values take)."""
    if not 0 <= dropout_p <= 1:  # F.dropout's check: a negative p would keep a wrapped-around share
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if dropout_p >= 1:
        return torch.zeros(shape, dtype=torch.bool, device=device), 0.0
    if torch.compiler.is_compiling():
        return torch.rand(shape, device=device) >= dropout_p, 1 / (1 - dropout_p)
    kept_levels = max(1, round((1 - dropout_p) * _LEVELS))
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), (1 << 63) - 1)
    halves = words.view(torch.int16)[:n].view(shape)  # four uniform 16-bit draws per word, in [-2¹⁵, 2¹⁵)
    # `<=` the last kept level, not `<` the first dropped one: at p < 2⁻¹⁷ every level is kept, and 2¹⁵ compared
    # with an int16 tensor wraps to -2¹⁵ (which dropped every element at --hidden-dropout 1e-6)
    return halves <= kept_levels - (_LEVELS >> 1) - 1, _LEVELS / kept_levels


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout(x, p, training), its mask drawn by keep_mask on a CPU. The mask is kept for backward in x's dtype,
    as F.dropout's is on a CPU (the memory plan counts it so), and the product is scaled in fp32 before rounding."""
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or type(x) is not torch.Tensor or torch.compiler.is_compiling() or p >= 1:
        return F.dropout(x, p, True)
    keep, scale = keep_mask(x.shape, p, x.device)
    return (x * keep.to(x.dtype)).mul_(scale)


class Dropout(nn.Module):
    """nn.Dropout through `dropout` (the same module interface: p, train/eval, no state)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0 <= p <= 1:  # nn.Dropout refuses it here, not at the first training forward
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
