"""--sharding-backend fairscale: FairScale 0.4.13's OSS (optimizer state sharding) behind torch DDP for
--oss-memory-optimization, and OSS with FairScale's ShardedDataParallel for --oss-sdp-memory-optimization.

With torch 2.13 both give DDP's losses. ShardedDataParallel reduces each gradient only to the rank that
owns its optimizer state, so the global norm sums each rank's owned gradients; it reads its accumulation
flag in backward, so `no_sync` stays open until the last micro-batch; and gradients are zeroed by its own
`zero_grad` only (the optimizer's would detach them from its reduction buckets and corrupt later steps).
FairScale's FSDP does not run with current torch; the conflict table refuses it. Checkpoints use
OSSRunner's layout, so they load into every other mode.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rapidtrain.config.settings import Plan
from rapidtrain.optim.grad_scaler import LossScaler
from rapidtrain.optim.optimizers import OptimizerSettings, build_optimizer, param_groups
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.runner import GradNorm, TorchRunner
from rapidtrain.parallel.zero_redundancy import OSSRunner


def fairscale_oss(
    model: nn.Module,
    settings: OptimizerSettings,
    device_type: str,
    group: dist.ProcessGroup,
    optimizer: torch.optim.Optimizer | None = None,
):
    """fairscale.optim.OSS around the optimizer `build_optimizer` makes (or a fresh copy of the user's)."""
    try:
        from fairscale.optim import OSS
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "--sharding-backend fairscale: FairScale is not installed. Install it without letting pip touch "
            "torch (its only requirement is torch >= 1.8): pip install --no-deps fairscale==0.4.13; or drop "
            "--sharding-backend to use torch's ZeroRedundancyOptimizer / FSDP2."
        ) from error

    if optimizer is not None:
        if any(optimizer.state.values()):
            raise ValueError(
                "--sharding-backend fairscale: the optimizer passed to Engine.compose has already "
                "stepped; pass a fresh one (its state cannot be partitioned afterwards)."
            )
        return OSS(
            [dict(g) for g in optimizer.param_groups],
            optim=type(optimizer),
            group=group,
            **optimizer.defaults,
        )

    def local_optimizer(groups: list[dict[str, Any]], **_defaults: Any) -> torch.optim.Optimizer:
        return build_optimizer(groups, settings, device_type)[0]

    groups = param_groups(model, settings.weight_decay, settings.decoupled)
    return OSS(groups, optim=local_optimizer, group=group, lr=settings.lr)


def fairscale_runner(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    device: torch.device,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> TorchRunner:
    """OSS + DDP (`oss`) or OSS + ShardedDataParallel (`sdp`) over the data-parallel group."""
    from rapidtrain.parallel.data_parallel import apply_ddp

    group = mesh.group("dp")
    optimizer_settings = plan.optimizer
    assert optimizer_settings is not None and plan.loss_scale is not None
    scaler = LossScaler(plan.loss_scale) if plan.precision.loss_scaling != "none" else None
    common: dict[str, Any] = dict(precision=plan.precision, device_type=device.type, clip_grad=plan.clip_grad,
                                  scaler=scaler)
    if group is None:  # one data-parallel rank: nothing to shard
        optimizer = optimizer or build_optimizer(model, optimizer_settings, device.type)[0]
        return TorchRunner(module=model, optimizer=optimizer, **common)
    oss = fairscale_oss(model, optimizer_settings, device.type, group, optimizer)
    size = plan.layout.data_parallel_size
    if plan.switches.partitioning == "sdp":
        from fairscale.nn.data_parallel import ShardedDataParallel

        module = ShardedDataParallel(model, oss, process_group=group)
        return ShardedDDPRunner(module=module, optimizer=oss, gradient_average=size, data_parallel_group=group,
                                **common)
    return OSSRunner(module=apply_ddp(model, mesh, device), optimizer=oss, gradient_average=size, **common)


class ShardedDDPRunner(OSSRunner):
    """OSSRunner for FairScale's ShardedDataParallel (each gradient lives on its owner rank only)."""

    def __init__(self, *args: Any, data_parallel_group: dist.ProcessGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._accumulating = contextlib.ExitStack()
        # Gradients of parameters another rank owns were not reduced here: the norm sums the owners' parts.
        oss: Any = self.optimizer  # fairscale's OSS, typed as the plain Optimizer it extends
        owned = [p for p in self.parameters if oss._param_to_rank[p] == oss.rank]
        self.grad_norm = GradNorm([], local_parameters=owned, local_group=data_parallel_group)

    @property
    def state_module(self) -> nn.Module:
        # Names without ShardedDataParallel's prefix, as every mode saves them. It keeps the model as .module
        # (the cast: nn.Module's __getattr__ types it Tensor | Module).
        return cast(nn.Module, self.module.module)

    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        # ShardedDataParallel checks its flag in backward, after the micro-batch context: keep no_sync open.
        if enabled:
            self._accumulating.close()
        elif not self.module._should_accumulate_grads:
            # ShardedDataParallel's no_sync (the cast: nn.Module's __getattr__ types it Tensor | Module).
            self._accumulating.enter_context(cast(Any, self.module).no_sync())
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        # Only the module's own: bucketed gradients are views into its reduction buckets and must stay so
        # (the optimizer's zero_grad would set them to None and later steps would lose them).
        self.module.zero_grad(set_to_none=True)
