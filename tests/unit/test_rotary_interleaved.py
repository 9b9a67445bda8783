"""--rotary-interleaved (Megatron-LM's functional tests gpt3_mcore_te_tp1_pp2_*rope_embeddings_interleaved*): rope
rotates adjacent dimensions (2i, 2i + 1) by angle i, as transformers' GPT-J does (the oracle), over the whole head or
the --rotary-percent share of it; the plan says so, a model without rotary embeddings refuses it, and the Hugging Face
export, whose rotary families rotate halves, refuses it too."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary

from rapidtrain.config import arguments, plan, rules
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.settings import RunContext
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.hf_weights import UnsupportedModel, export_family
from rapidtrain.models.rope import apply_rotary, plain_inverse_frequency, rotary_cos_sin


@pytest.mark.parametrize("rotary_dim", [16, 8])  # the whole head, and --rotary-percent 0.5
def test_interleaved_rope_is_gptjs_rotation_of_adjacent_pairs(rotary_dim):
    b, heads, s, d = 2, 3, 7, 16
    x = torch.randn(b, heads, s, d, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(s).unsqueeze(0)
    frequency = plain_inverse_frequency(rotary_dim, 10000.0)
    cos, sin = rotary_cos_sin(positions, frequency)
    ours = apply_rotary(x, cos, sin, interleaved=True)
    angles = positions.float().unsqueeze(-1) * frequency  # [1, s, rotary_dim / 2]: one angle per pair
    theirs = x.transpose(1, 2).clone()  # GPT-J's [b, s, heads, d]
    theirs[..., :rotary_dim] = gptj_rotary(theirs[..., :rotary_dim], angles.sin(), angles.cos())
    torch.testing.assert_close(ours, theirs.transpose(1, 2))
    assert not torch.allclose(ours, apply_rotary(x, cos, sin))  # not the halves' rotation


def test_a_model_with_interleaved_rope_attends_otherwise_and_the_plan_says_so():
    small = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                 hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    halves = build_model(ModelConfig(**small), seed=0)(tokens)
    pairs = build_model(ModelConfig(**small, rotary_interleaved=True), seed=0)(tokens)
    assert halves.shape == pairs.shape and not torch.allclose(halves, pairs)
    args = arguments.parse_args(["--rotary-interleaved", "--position-embedding-type", "rope", "--num-layers", "2",
                                 "--hidden-size", "32", "--num-attention-heads", "4", "--train-iters", "2"],
                                entry="pretrain_gpt")
    assert rules.violations(args, RunContext(1, "cpu")) == []
    resolved = plan.from_args(args, RunContext(1, "cpu"))
    assert "rope on adjacent pairs (2i, 2i + 1) (--rotary-interleaved)" in describe_plan(resolved)
    with pytest.raises(UnsupportedModel, match="--rotary-interleaved"):
        export_family(resolved.model)
