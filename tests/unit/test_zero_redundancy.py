"""A user's own optimizer becomes a ZeroRedundancyOptimizer of the same class and settings."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rapidtrain.config.settings import Layout
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.zero_redundancy import oss_from_optimizer


def test_users_adamw_is_wrapped_with_its_settings(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        user = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.9), weight_decay=0.2)
        oss = oss_from_optimizer(user, ParallelMesh(Layout(1, 1), None))
        assert isinstance(oss.optim, torch.optim.AdamW)
        group = oss.optim.param_groups[0]
        assert (group["lr"], group["betas"], group["weight_decay"]) == (0.05, (0.8, 0.9), 0.2)
        model(torch.ones(2, 4)).sum().backward()
        oss.step()
    finally:
        dist.destroy_process_group()
