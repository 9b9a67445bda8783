"""--oss-memory-optimization: torch's ZeroRedundancyOptimizer over DDP, and its checkpoint state.

Each rank's local optimizer steps only its share of the parameters. A checkpoint holds that share
under parameter names, in the layout `torch.distributed.checkpoint.state_dict.get_state_dict` gives
for a plain model (`state[name][key]`, `param_groups` listing names): every rank writes its own
entries, so nothing is gathered on one rank, and the files load into DDP, FSDP, ZeRO or OSS at any
world size, as theirs load into OSS.

Under expert parallelism the expert slices stay out of the partitioning: ZeroRedundancyOptimizer
broadcasts each parameter it partitions from its owner over the whole data-parallel group, which would
overwrite the slices that differ from one expert-parallel rank to the next. Each rank's local optimizer
steps its own slices beside its share of the rest, in the same parameter groups (so the schedule's
learning rate reaches them); their gradients are reduced over their own group (parallel/experts.py).
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from rapidtrain.models.transformer import parameter_names
from rapidtrain.optim.optimizers import OptimizerSettings, build_optimizer, optimizer_param_groups
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.runner import TorchRunner, ensure_optimizer_state


def oss_optimizer(
    model: nn.Module, settings: OptimizerSettings, device_type: str, mesh: ParallelMesh
) -> ZeroRedundancyOptimizer:
    """ZeroRedundancyOptimizer whose local optimizer is the one `build_optimizer` makes without OSS (same
    class, settings and weight-decay groups), so OSS and DDP take identical steps."""
    from rapidtrain.parallel.experts import expert_parameters

    experts = {id(p) for p in expert_parameters(model).values()}
    groups = optimizer_param_groups(model, settings)
    partitioned = [{**g, "params": [p for p in g["params"] if id(p) not in experts]} for g in groups]
    own = [[p for p in g["params"] if id(p) in experts] for g in groups]

    def local_optimizer(local_groups: list[dict[str, Any]], **_defaults: Any) -> torch.optim.Optimizer:
        # ZeroRedundancyOptimizer hands this rank's share group by group, in the order of `partitioned`.
        mine = [{**g, "params": list(g["params"]) + extra} for g, extra in zip(local_groups, own, strict=True)]
        return build_optimizer(mine, settings, device_type)[0]

    # torch types optimizer_class as a class but only calls it with (params, **defaults): a factory serves.
    return ZeroRedundancyOptimizer(
        partitioned,
        optimizer_class=cast(type[torch.optim.Optimizer], local_optimizer),
        process_group=mesh.gradient_group(),
        lr=settings.lr,
    )


def oss_from_optimizer(optimizer: torch.optim.Optimizer, mesh: ParallelMesh) -> ZeroRedundancyOptimizer:
    """A user's (not yet stepped) optimizer as a ZeroRedundancyOptimizer of the same class and settings."""
    if any(optimizer.state.values()):
        raise ValueError(
            "--oss-memory-optimization: the optimizer passed to Engine.compose has already stepped; "
            "pass a fresh one (its state cannot be partitioned afterwards)."
        )
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), process_group=mesh.gradient_group(), **constructor_defaults(optimizer)
    )


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its class's constructor accepts (AdamW records `decoupled_weight_decay` in
    `defaults` but refuses it as an argument)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


class OSSRunner(TorchRunner):
    """TorchRunner whose optimizer is a ZeroRedundancyOptimizer: checkpoints hold each rank's own share."""

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        return cast(ZeroRedundancyOptimizer, self.optimizer).optim

    @property
    def stepping_optimizer(self) -> torch.optim.Optimizer:
        return self.local_optimizer

    @property
    def state_module(self) -> nn.Module:
        """The model inside DDP: checkpoints name parameters without the wrapper's prefix."""
        return self.module.module if isinstance(self.module, DistributedDataParallel) else self.module

    def clear_gradients(self) -> None:
        super().clear_gradients()
        self.local_optimizer.zero_grad(set_to_none=True)  # also the expert slices, which only it holds

    def optimizer_state(self) -> dict[str, Any]:
        local = self.local_optimizer
        if not self.optimizer_stepped():  # before any step: made for this save (state_dict() forgets it again)
            ensure_optimizer_state(local)
        names = parameter_names(self.state_module)
        # A parameter that never had a gradient has no state, and none is saved (a step at rate 0 to make it would
        # count a step and decay the moments of every other parameter).
        state = {names[id(p)]: dict(local.state[p]) for group in local.param_groups for p in group["params"]
                 if local.state.get(p)}
        partitioned = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                # every parameter of the group: all partitioned ones, and this rank's expert slices
                "params": [names[id(p)] for p in group["params"]]
                + [names[id(p)] for p in local_group["params"] if id(p) not in partitioned],
            }
            for group, local_group in zip(self.optimizer.param_groups, local.param_groups, strict=True)
        ]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, saved: dict[str, Any]) -> None:
        local = self.local_optimizer
        ensure_optimizer_state(local)
        names = parameter_names(self.state_module)
        with torch.no_grad():
            for group in local.param_groups:
                for p in group["params"]:
                    if names[id(p)] not in saved["state"]:  # never had a gradient in the saved run: no state
                        local.state.pop(p, None)
                        continue
                    for key, value in saved["state"][names[id(p)]].items():
                        current = local.state[p].get(key)
                        if torch.is_tensor(current) and torch.is_tensor(value):
                            current.copy_(value)
                        else:
                            local.state[p][key] = value
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for group, saved_group in zip(local.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})

    def _own_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state: dict[str, Any] = {
            "model": get_model_state_dict(self.state_module),
            "optimizer": self.optimizer_state(),
        }
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def state_dict_for_loading(self, load_optimizer: bool) -> dict[str, Any]:
        if load_optimizer:
            return self.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": get_model_state_dict(self.state_module)}  # no optimizer state is created
        for to_saved, _ in self.state_transforms:
            state = to_saved(state)
        return state

    def _load_own_state_dict(self, state: dict[str, Any], load_optimizer: bool) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.state_module, state["model"])
        if load_optimizer:
            self.load_optimizer_state(state["optimizer"])
            if self.scaler is not None and "loss_scaler" in state:
                self.scaler.load_state_dict(state["loss_scaler"])
