"""The dense MLP (GELU or SwiGLU) of a transformer layer, and the GELU both GPT and BERT use; the MoE
layer (moe.py) adds one beside its experts for PR-MoE, so it lives below both."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rapidtrain.models.config import ModelConfig


def gelu(x: torch.Tensor, tanh_approximation: bool) -> torch.Tensor:
    """Exact GELU, or with --openai-gelu its tanh approximation (GPT-2's gelu_new)."""
    return F.gelu(x, approximate="tanh" if tanh_approximation else "none")


class MLP(nn.Module):
    """fc1 (h → ffn), GELU, fc2 (ffn → h); with SwiGLU fc2(silu(gate(x)) · fc1(x))."""

    def __init__(self, config: ModelConfig, ffn_size: int | None = None) -> None:
        """`ffn_size`: the hidden size when not the config's (an MoE layer's shared experts)."""
        super().__init__()
        h, f, bias = config.hidden_size, ffn_size or config.ffn_size, config.add_bias_linear
        self.openai_gelu = config.openai_gelu
        self.fc1 = nn.Linear(h, f, bias=bias)
        self.gate = nn.Linear(h, f, bias=bias) if config.swiglu else None
        self.fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            if torch.is_autocast_enabled(x.device.type):  # one 16-bit copy of x kept for both projections, not two
                x = x.to(torch.get_autocast_dtype(x.device.type))
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(gelu(self.fc1(x), self.openai_gelu))
