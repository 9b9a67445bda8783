"""The plan's per-rank optimizer state under --oss-memory-optimization against torch's own partition:
ZeroRedundancyOptimizer's partitioning method run on the model's real parameter groups (rapidtrain's
param_groups on a model built on the meta device), for any model and data-parallel size."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.optim import ZeroRedundancyOptimizer

from rapidtrain.config.memory import oss_optimizer_bytes_by_rank
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.optim.optimizers import param_groups
from rapidtrain.optim.state_bytes import shared_state_bytes, tensor_state_bytes
from tests.unit.test_counting import model_configs


def torch_partition(model: torch.nn.Module, world_size: int) -> list[list[torch.Tensor]]:
    """Each rank's parameters as ZeroRedundancyOptimizer assigns them (its own method, without a process group)."""
    oss = object.__new__(ZeroRedundancyOptimizer)
    oss.world_size = world_size
    oss.param_groups = param_groups(model, weight_decay=0.01)
    oss._partition_parameters_cache = []
    return [[p for group in groups for p in group["params"]] for groups in oss._partition_parameters()]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_configs(), st.integers(2, 8), st.sampled_from(["adam", "adafactor", "bitsandbytes_8bit"]))
def test_each_ranks_optimizer_state_is_torchs_partition(config: ModelConfig, world_size: int, kind: str):
    with torch.device("meta"):
        model = build_model(config, seed=None)
    expected = [shared_state_bytes(kind) + sum(tensor_state_bytes(kind, tuple(p.shape)) for p in params)
                for params in torch_partition(model, world_size)]
    assert oss_optimizer_bytes_by_rank(config, kind, world_size) == tuple(float(x) for x in expected)


def test_a_large_embedding_makes_one_rank_hold_far_more_than_the_average():
    """GPT-2 small's shape on 8 ranks: the word embedding (38.6M of 124M parameters) goes whole to one rank."""
    gpt2 = ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50304,
                       max_position_embeddings=1024, seq_length=1024)
    by_rank = oss_optimizer_bytes_by_rank(gpt2, "adam", 8)
    average = sum(by_rank) / 8
    assert max(by_rank) > 2.4 * average
    assert max(by_rank) >= 8 * 50304 * 768  # Adam's two fp32 moments of the embedding
