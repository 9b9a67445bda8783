"""--checkpoint-activations on a user's own model without a list of blocks: the blocks are found through the module
classes the model repeats (an nn.Sequential of them, or instances held as attributes) and recomputed, with the
gradients of the plain model; a model that repeats nothing is refused naming what is needed (it was accepted and
recomputed nothing, while the plan claimed per-layer recompute)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from rapidtrain.core.errors import UserError
from rapidtrain.parallel.transforms import apply_activation_checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class SequentialModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.Sequential(Block(), Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


class AttributeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.first, self.second, self.head = nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(self.embed(x))))


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model(torch.randn(5, 8)).square().sum().backward()
    return {name.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("model_class", "wrapped"), [(SequentialModel, 3), (AttributeModel, 2)])
def test_a_user_model_without_a_block_list_has_its_repeated_blocks_recomputed(model_class, wrapped):
    torch.manual_seed(1)
    plain = model_class()
    recomputed = copy.deepcopy(plain)
    apply_activation_checkpointing(recomputed)
    assert sum(isinstance(m, CheckpointWrapper) for m in recomputed.modules()) == wrapped
    expected, got = gradients(plain), gradients(recomputed)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def test_a_model_that_repeats_nothing_is_refused_naming_what_is_needed():
    with pytest.raises(UserError, match=r"--checkpoint-activations: Linear has no repeated blocks.*nn.ModuleList"):
        apply_activation_checkpointing(nn.Linear(4, 4))
