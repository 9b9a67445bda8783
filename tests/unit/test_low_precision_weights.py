"""bf16 copies of the linear layers' weights kept by the step (parallel/low_precision_weights.py): the same numbers as
autocast casting the fp32 weights in every forward, without those casts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.parallel.low_precision_weights import LowPrecisionWeights, converted_linears

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                     vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)


def micro_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 128, (2, 16), generator=generator), torch.randint(0, 128, (2, 16), generator=generator))
            for _ in range(count)]


def train(model: nn.Module, steps: int, after_step=lambda: None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """`steps` AdamW steps of two accumulated micro-batches under bf16 autocast: each step's loss, the last grads."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses, grads = [], {}
    for _ in range(steps):
        total = torch.zeros(())
        for tokens, labels in micro_batches(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens, labels=labels).mean() / 2
            loss.backward()
            total += loss.detach()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_step()
        losses.append(total)
    return losses, grads


def test_bf16_copies_train_exactly_as_autocast_over_fp32_weights():
    """Losses, the fp32 gradients after two accumulated micro-batches and the updated weights: bitwise equal."""
    autocast_model = build_model(CONFIG, seed=1)
    model = copy.deepcopy(autocast_model)
    weights = LowPrecisionWeights(model)
    expected_losses, expected_grads = train(autocast_model, 2)
    losses, grads = train(model, 2, weights.refresh)
    assert torch.equal(torch.stack(losses), torch.stack(expected_losses))
    assert grads.keys() == expected_grads.keys()
    assert all(torch.equal(grads[name], expected_grads[name]) for name in grads), "fp32 gradients differ"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # optimizer and checkpoints see fp32 masters
    for name, p in model.state_dict().items():
        assert torch.equal(p, autocast_model.state_dict()[name]), name


def test_the_copies_are_the_layers_and_follow_the_masters():
    model = build_model(CONFIG, seed=1)
    weights = LowPrecisionWeights(model)
    converted = {name for name, m in model.named_modules() if m in weights.modules}
    # Every layer's projections; not the output layer, whose weight is the word embeddings' (tied).
    assert converted == {f"layers.{i}.{part}" for i in range(2)
                         for part in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
                                      "mlp.fc1", "mlp.fc2")}
    assert weights.parameters == sum(p.numel() for m in weights.modules for p in m.parameters())
    fc1 = model.layers["0"].mlp.fc1
    with torch.no_grad():
        fc1.weight.add_(1.0)  # as an optimizer step would
    weights.refresh()
    assert torch.equal(fc1.forward.weight, fc1.weight.to(torch.bfloat16))
    assert fc1.forward.weight.dtype == torch.bfloat16 and fc1.weight.dtype == torch.float32


def test_outside_bf16_autocast_the_layers_use_the_fp32_masters():
    """Evaluation or generation without autocast computes in fp32 as before (no bf16 rounding of the weights)."""
    reference = build_model(CONFIG, seed=1)
    model = copy.deepcopy(reference)
    LowPrecisionWeights(model)
    tokens, _ = micro_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))


@pytest.mark.parametrize("frozen", [True, False])
def test_shared_and_frozen_weights_keep_autocasts_cast(frozen):
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Linear(4, 4), shared)
    model[1].weight.requires_grad_(not frozen)
    assert converted_linears(model) == ([] if frozen else [model[1]])
