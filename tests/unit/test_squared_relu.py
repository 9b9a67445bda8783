"""--squared-relu (Megatron's Nemotron runs, e.g. its functional test gpt3_15b_8t_release): the MLP without a gate
activates relu(x)², in dense layers and in experts, as transformers' `relu2` activation (the oracle) computes it; the
plan says so, and the Hugging Face export, whose families have no such MLP, refuses it."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from rapidtrain.config import arguments, plan, rules
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.settings import RunContext
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.hf_weights import UnsupportedModel, export_family
from rapidtrain.models.moe import Experts

SMALL = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, ffn_hidden_size=48,
             hidden_dropout=0.0, attention_dropout=0.0)
RELU2 = ACT2FN["relu2"]


def test_dense_mlp_and_experts_activate_squared_relu():
    model = build_model(ModelConfig(**SMALL, squared_relu=True), seed=0)
    mlp = model.layers["0"].mlp
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.testing.assert_close(mlp(x), mlp.fc2(RELU2(mlp.fc1(x))))
    mlp(x).sum().backward()
    assert x.grad is not None and mlp.fc1.weight.grad.abs().sum() > 0
    experts = Experts(3, 32, 48, bias=True, squared_relu=True)
    rows = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    offsets = torch.tensor([2, 5, 7], dtype=torch.int32)  # grouped rows: expert 0 takes rows 0-1, ...
    expected = torch.cat([RELU2(rows[a:b] @ experts.w1[e] + experts.b1[e]) @ experts.w2[e] + experts.b2[e]
                          for e, (a, b) in enumerate([(0, 2), (2, 5), (5, 7)])])
    torch.testing.assert_close(experts(rows, offsets), expected, rtol=1e-5, atol=1e-5)
    buffers = rows[:6].view(3, 2, 32)  # capacity buffers [E, C, h]
    expected = torch.stack([RELU2(buffers[e] @ experts.w1[e] + experts.b1[e]) @ experts.w2[e] + experts.b2[e]
                            for e in range(3)])
    torch.testing.assert_close(experts(buffers), expected, rtol=1e-5, atol=1e-5)


def test_squared_relu_flag_plans_and_the_export_refuses_it():
    args = arguments.parse_args(["--squared-relu", "--num-layers", "2", "--hidden-size", "32",
                                 "--num-attention-heads", "4", "--train-iters", "2"], entry="pretrain_gpt")
    assert rules.violations(args, RunContext(1, "cpu")) == []
    resolved = plan.from_args(args, RunContext(1, "cpu"))
    assert resolved.model.squared_relu and "squared ReLU, relu(x)²" in describe_plan(resolved)
    with pytest.raises(UnsupportedModel, match="--squared-relu"):
        export_family(resolved.model)
