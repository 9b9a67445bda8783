"""Rotary position embeddings' angles: the inverse frequencies of each rotated pair (plain rope, Llama 3.1's rope
scaling, YaRN, linear position interpolation) and the cos/sin tables the attention rotates queries and keys with."""

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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 · mscale · ln(factor) + 1 (1 when the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequency(frequency: torch.Tensor, base: float, factor: float, original_max_positions: int,
                           beta_fast: float, beta_slow: float, round_range: bool) -> torch.Tensor:
    """YaRN (Peng et al. 2023): pairs that turn more than beta_fast times over the original context keep their
    frequency, those that turn fewer than beta_slow times are divided by `factor`, and a linear ramp over the pair
    index blends the two between (its ends rounded to whole pairs with `round_range`, as Megatron's and Hugging
    Face's default)."""
    rotary_dim = 2 * frequency.shape[0]

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return rotary_dim * math.log(original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if round_range:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    pairs = torch.arange(rotary_dim // 2, device=frequency.device, dtype=torch.float32)
    interpolated = ((pairs - low) / (high - low)).clamp(0, 1)  # 0: keep the frequency, 1: divide it by the factor
    return frequency / factor * interpolated + frequency * (1 - interpolated)


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's mscale(factor, --mscale) / mscale(factor, --mscale-all-dim)
    (Megatron's; Hugging Face's attention_factor), 1 for every other rope."""
    if config.rope_scaling != "yarn":
        return 1.0
    factor = config.rope_scaling_factor
    return yarn_mscale(factor, config.yarn_mscale) / yarn_mscale(factor, config.yarn_mscale_all_dim)


def inverse_frequency(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """The model's inverse frequencies: plain, then Llama 3.1's scaling (--use-rope-scaling) or YaRN (--rope-type
    yarn), then linear interpolation (--rotary-seq-len-interpolation-factor: positions / factor, that is
    frequencies / factor)."""
    frequency = plain_inverse_frequency(config.rotary_dim, config.rotary_base, device)
    if config.rope_scaling == "llama3":
        frequency = llama3_inverse_frequency(frequency, config.rope_scaling_factor, config.rope_low_freq_factor,
                                             config.rope_high_freq_factor, config.rope_original_max_positions)
    elif config.rope_scaling == "yarn":
        frequency = yarn_inverse_frequency(frequency, config.rotary_base, config.rope_scaling_factor,
                                           config.rope_original_max_positions, config.yarn_beta_fast,
                                           config.yarn_beta_slow, config.yarn_round_range)
    if config.rotary_interpolation_factor != 1:
        frequency = frequency / config.rotary_interpolation_factor
    return frequency


def rotary_cos_sin(position_ids: torch.Tensor, frequency: torch.Tensor,
                   attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, fp32, shaped [b or 1, 1, s, rotary_dim] to broadcast over heads, times
    `attention_factor` (YaRN's, rope_attention_factor).

    Computed from positions on the fly (no buffer), so meta-device construction needs no re-init.
    """
    angles = position_ids.float().unsqueeze(-1) * frequency.to(position_ids.device)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    if attention_factor == 1:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate pairs (i, i + r/2) of the first r = cos.shape[-1] dimensions of x [b, heads, s, d]
    (Megatron's non-interleaved rotary; r < d with --rotary-percent), in fp32. `interleaved` (--rotary-interleaved,
    GPT-J's layout): pair i is (2i, 2i + 1) instead, rotated by the same angle."""
    rotary_dim = cos.shape[-1]
    x32 = x.float()
    whole = rotary_dim == x.shape[-1]  # the usual case: no untouched rest to slice off and join again
    part = x32 if whole else x32[..., :rotary_dim]
    if interleaved:  # gather each pair's two halves apart, rotate as above, then put them back side by side
        part = torch.cat([part[..., 0::2], part[..., 1::2]], dim=-1)
    first, second = part.chunk(2, dim=-1)
    rotated = part * cos + torch.cat([-second, first], dim=-1) * sin
    if interleaved:
        rotated = torch.stack(rotated.chunk(2, dim=-1), dim=-1).flatten(-2)
    return (rotated if whole else torch.cat([rotated, x32[..., rotary_dim:]], dim=-1)).to(x.dtype)
