"""Qwen3 / Llama 3.1 features of the built-in GPT: --kv-channels (head size apart from hidden / heads),
--qk-layernorm (a norm on each head's queries and keys), Llama 3.1's rope scaling and linear position
interpolation, each checked against numbers computed here from the published formulas."""

from __future__ import annotations

import math

import torch

from rapidtrain.config import arguments, plan, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.counting import count_parameters
from rapidtrain.models.rope import inverse_frequency, plain_inverse_frequency, rotary_cos_sin

LLAMA = dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             vocab_size=64, seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
             normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope")


def llama31_frequency(i: int, dim: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                      original: int = 8192) -> float:
    """One pair's inverse frequency under Llama 3.1's scaling, written out from the published rule."""
    plain = base ** (-2 * i / dim)
    wavelength = 2 * math.pi / plain
    if wavelength < original / high:
        return plain
    if wavelength > original / low:
        return plain / factor
    smooth = (original / wavelength - low) / (high - low)
    return (1 - smooth) * plain / factor + smooth * plain


def test_llama31_rope_scaling_matches_the_formula_in_all_three_bands():
    config = ModelConfig(**{**LLAMA, "kv_channels": 128}, rotary_base=500000.0, rope_scaling="llama3")
    ours = inverse_frequency(config).double()
    expected = torch.tensor([llama31_frequency(i, 128, 500000.0) for i in range(64)], dtype=torch.float64)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=0)
    plain = plain_inverse_frequency(128, 500000.0).double()
    ratio = plain / ours
    # Llama 3 8B's pairs: high frequencies kept, low ones slowed 8×, and some blended between.
    assert (ratio - 1).abs().lt(1e-6).sum() > 10 and (ratio - 8).abs().lt(1e-4).sum() > 10
    assert ((ratio > 1 + 1e-3) & (ratio < 8 - 1e-3)).sum() >= 3


def test_linear_interpolation_sees_positions_divided_by_the_factor():
    config = ModelConfig(**LLAMA, rotary_interpolation_factor=4.0)
    cos, sin = rotary_cos_sin(torch.tensor([[0, 3, 10]]), inverse_frequency(config))
    d = config.head_dim
    for column, position in enumerate((0, 3, 10)):
        angles = [position / 4.0 * 10000 ** (-2 * (i % (d // 2)) / d) for i in range(d)]
        torch.testing.assert_close(cos[0, 0, column].double(), torch.tensor(angles).cos().double(), atol=1e-6,
                                   rtol=0)
        torch.testing.assert_close(sin[0, 0, column].double(), torch.tensor(angles).sin().double(), atol=1e-6,
                                   rtol=0)


def test_kv_channels_sizes_the_projections_and_the_parameter_count_follows():
    config = ModelConfig(**LLAMA, kv_channels=20, qk_layernorm=True)
    model = build_model(config, seed=3)
    attention = model.layers["0"].attention
    assert tuple(attention.q_proj.weight.shape) == (4 * 20, 48)
    assert tuple(attention.k_proj.weight.shape) == (2 * 20, 48)
    assert tuple(attention.o_proj.weight.shape) == (48, 4 * 20)
    assert tuple(attention.q_norm.weight.shape) == (20,) and isinstance(attention.k_norm, torch.nn.RMSNorm)
    assert count_parameters(config)[0] == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert model(ids).shape == (2, 16, 64)


def test_qk_layernorm_normalises_each_heads_queries_and_keys():
    """With the q/k norms, scaling the q and k projections changes nothing (each head's vector is normalised);
    without them it sharpens the attention."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def logits(qk_layernorm: bool, scale: float) -> torch.Tensor:
        # eps 1e-12: the norm's epsilon would otherwise count against the small unscaled vectors
        config = ModelConfig(**LLAMA, qk_layernorm=qk_layernorm, layernorm_epsilon=1e-12)
        model = build_model(config, seed=5).eval()
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.q_proj.weight.mul_(scale)
                layer.attention.k_proj.weight.mul_(scale)
            return model(ids)

    torch.testing.assert_close(logits(True, 1.0), logits(True, 7.0), atol=2e-5, rtol=1e-4)
    assert (logits(False, 1.0) - logits(False, 7.0)).abs().max() > 1e-2


def test_a_layernorm_model_gets_layernorm_q_k_norms_with_biases():
    config = ModelConfig(**{**LLAMA, "normalization": "LayerNorm"}, qk_layernorm=True)
    attention = build_model(config, seed=1).layers["0"].attention
    assert isinstance(attention.q_norm, torch.nn.LayerNorm) and attention.q_norm.bias.shape == (12,)
    assert count_parameters(config)[0] == sum(p.numel() for p in build_model(config, seed=1).parameters())


QWEN3_FLAGS = ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4", "--kv-channels", "32",
               "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
               "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
               "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "2", "--lr", "0.1",
               "--micro-batch-size", "1"]


def test_the_flags_reach_the_model_config():
    args = arguments.parse_args([*QWEN3_FLAGS, "--use-rope-scaling", "--rope-scaling-factor", "16",
                                 "--rotary-seq-len-interpolation-factor", "2"])
    model = plan.from_args(args, settings.RunContext(1, "cpu")).model
    assert (model.kv_channels, model.head_dim, model.qk_layernorm) == (32, 32, True)
    assert (model.rope_scaling, model.rope_scaling_factor, model.rotary_interpolation_factor) == ("llama3", 16.0, 2.0)


def test_the_hidden_size_need_not_divide_by_the_heads_with_kv_channels():
    args = arguments.parse_args([*QWEN3_FLAGS[:3], "50", *QWEN3_FLAGS[4:]])  # 50 hidden, 4 heads of 32
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert "hidden 50, 4 heads" in described
