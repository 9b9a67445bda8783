"""Rotary position embeddings' angles: the inverse frequencies of each rotated pair (plain rope, Llama 3.1's rope
scaling, linear position interpolation) and the cos/sin tables the attention rotates queries and keys with."""

from __future__ import annotations

import math

import torch

from rapidtrain.models.config import ModelConfig


def plain_inverse_frequency(rotary_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """θ_i = base^(-2i / rotary_dim) for each pair i, fp32 (as Megatron and Hugging Face compute it)."""
    exponents = torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def llama3_inverse_frequency(frequency: torch.Tensor, factor: float, low_freq_factor: float,
                             high_freq_factor: float, original_max_positions: int) -> torch.Tensor:
    """Llama 3.1's rope scaling: pairs whose wavelength is shorter than original / high_freq_factor keep their
    frequency, those longer than original / low_freq_factor are slowed by `factor`, and those between blend the
    two linearly in original / wavelength."""
    wavelength = 2 * math.pi / frequency
    slowed = frequency / factor
    blend = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - blend) * slowed + blend * frequency
    short = wavelength < original_max_positions / high_freq_factor
    long = wavelength > original_max_positions / low_freq_factor
    return torch.where(short, frequency, torch.where(long, slowed, between))


def inverse_frequency(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """The model's inverse frequencies: plain, then Llama 3.1's scaling (--use-rope-scaling), then linear
    interpolation (--rotary-seq-len-interpolation-factor: positions / factor, that is frequencies / factor)."""
    frequency = plain_inverse_frequency(config.rotary_dim, config.rotary_base, device)
    if config.rope_scaling == "llama3":
        frequency = llama3_inverse_frequency(frequency, config.rope_scaling_factor, config.rope_low_freq_factor,
                                             config.rope_high_freq_factor, config.rope_original_max_positions)
    if config.rotary_interpolation_factor != 1:
        frequency = frequency / config.rotary_interpolation_factor
    return frequency


def rotary_cos_sin(position_ids: torch.Tensor, frequency: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, fp32, shaped [b or 1, 1, s, rotary_dim] to broadcast over heads.

    Computed from positions on the fly (no buffer), so meta-device construction needs no re-init.
    """
    angles = position_ids.float().unsqueeze(-1) * frequency.to(position_ids.device)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()
