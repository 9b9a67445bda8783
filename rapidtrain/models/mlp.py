"""The dense MLP (GELU or squared ReLU, or gated: SwiGLU, gpt-oss's clamped quick-GEGLU) of a transformer layer, and the
activations both the dense MLP and the MoE experts use; the MoE layer (moe.py) adds one beside its experts for
PR-MoE, so it lives below both."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rapidtrain.models.config import ModelConfig

QUICK_GELU_ALPHA = 1.702  # quick GELU's sigmoid gain (Hendrycks & Gimpel), gpt-oss's swiglu_alpha


def gelu(x: torch.Tensor, tanh_approximation: bool) -> torch.Tensor:
    """Exact GELU, or with --openai-gelu its tanh approximation (GPT-2's gelu_new)."""
    return F.gelu(x, approximate="tanh" if tanh_approximation else "none")


def dense_activation(x: torch.Tensor, tanh_approximation: bool, squared_relu: bool) -> torch.Tensor:
    """The activation of an MLP without a gate: GELU (`gelu`), or with --squared-relu relu(x)² (Primer; Megatron's
    Nemotron runs)."""
    return F.relu(x).square() if squared_relu else gelu(x, tanh_approximation)


@dataclass(frozen=True)
class GatedUnit:
    """act(gate) · (linear + offset), Megatron-Core's gated linear unit: act is silu (SwiGLU) or quick GELU
    x·sigmoid(1.702x) (--quick-geglu); with `clamp` (--activation-func-clamp-value) the gate is clamped above at
    clamp and the linear half to ±clamp first; `linear_offset` is --glu-linear-offset. gpt-oss: quick GELU,
    clamp 7, offset 1."""

    quick_gelu: bool = False
    clamp: float | None = None
    linear_offset: float = 0.0

    def __call__(self, gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            gate = gate.clamp(max=self.clamp)
            linear = linear.clamp(min=-self.clamp, max=self.clamp)
        activated = gate * torch.sigmoid(QUICK_GELU_ALPHA * gate) if self.quick_gelu else F.silu(gate)
        return activated * (linear + self.linear_offset) if self.linear_offset else activated * linear


def gated_unit(config: ModelConfig) -> GatedUnit:
    """The model's gated activation (meaningful where config.gated_linear_unit)."""
    return GatedUnit(config.quick_geglu, config.activation_clamp, config.glu_linear_offset)


class MLP(nn.Module):
    """fc1 (h → ffn), GELU (or squared ReLU), fc2 (ffn → h); gated: fc2(act(gate(x)) · fc1(x)) (GatedUnit)."""

    def __init__(self, config: ModelConfig, ffn_size: int | None = None) -> None:
        """`ffn_size`: the hidden size when not the config's (an MoE layer's shared experts)."""
        super().__init__()
        h, f, bias = config.hidden_size, ffn_size or config.ffn_size, config.add_bias_linear
        self.openai_gelu = config.openai_gelu
        self.squared_relu = config.squared_relu
        self.gated_unit = gated_unit(config)
        self.fc1 = nn.Linear(h, f, bias=bias)
        self.gate = nn.Linear(h, f, bias=bias) if config.gated_linear_unit else None
        self.fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            if torch.is_autocast_enabled(x.device.type):  # one 16-bit copy of x kept for both projections, not two
                x = x.to(torch.get_autocast_dtype(x.device.type))
            return self.fc2(self.gated_unit(self.gate(x), self.fc1(x)))
        return self.fc2(dense_activation(self.fc1(x), self.openai_gelu, self.squared_relu))
