"""One optimizer made of torch.optim.Muon and torch.optim.AdamW (for --optimizer muon; optim/muon.py says which
parameters each takes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the groups tagged `use_muon`, torch.optim.AdamW for the others, over one list of groups
    kept in the given order (ZeroRedundancyOptimizer pairs its groups with its local optimizer's by position) and one
    state, which `state_dict` / `load_state_dict` (torch.distributed.checkpoint's too) see as one optimizer's.

    The matrices' Muon and AdamW list the same group dicts and hold the same state. The experts' stacked weights
    (groups tagged `muon_by_matrix`) and sharded matrices (DTensors: FSDP2, tensor parallelism) are stepped by a third,
    torch.optim.Muon over whole matrices: each expert's [in, out] matrix as a view of the stacked weight, a DTensor
    gathered whole (its weight, gradient and momentum: three all-gathers of the matrix per step, and every rank
    computes the whole Newton–Schulz) and its own shard written back after the step. Their momentum is kept here
    shaped and placed as the parameter (what a checkpoint holds, resharded on load), and the third Muon's groups
    and state are made again at each step (so a loaded or cleared state, or a moved weight, is never stale).
    """

    def __init__(self, groups: Iterable[dict[str, Any]], muon_options: dict[str, Any],
                 adamw_options: dict[str, Any]) -> None:
        groups = list(groups)
        for group in groups:  # sharded matrices are gathered whole, as the experts' are split: by the third Muon
            if group["use_muon"] and any(isinstance(p, DTensor) for p in group["params"]):
                group["muon_by_matrix"] = True
        matrix_groups = [g for g in groups if g["use_muon"] and not g.get("muon_by_matrix")]
        expert_groups = [g for g in groups if g["use_muon"] and g.get("muon_by_matrix")]
        adamw_groups = [g for g in groups if not g["use_muon"]]
        # The inner optimizers fill their defaults into these dicts, which this optimizer then lists as they are.
        self.muon = torch.optim.Muon(matrix_groups, **muon_options) if matrix_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_options) if adamw_groups else None
        self.matrix_muon = None
        if expert_groups:
            placeholder = torch.zeros(1, 1)
            views = [{**g, "params": [placeholder.clone()]} for g in expert_groups]
            self.matrix_muon = torch.optim.Muon(views, **muon_options)
            for group, inner in zip(expert_groups, self.matrix_muon.param_groups, strict=True):
                for key, value in inner.items():
                    group.setdefault(key, value)
        super().__init__(groups, defaults={})
        self._share()

    def _share(self) -> None:
        for inner, wanted in ((self.muon, (True, False)), (self.adamw, (False, False))):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups
                                      if (bool(g["use_muon"]), bool(g.get("muon_by_matrix", False))) == wanted]
                inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Which optimizer steps a group is this layout's (a DDP checkpoint may continue under FSDP), not the saver's.
        steppers = [(g["use_muon"], g.get("muon_by_matrix", False)) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, (use_muon, by_matrix) in zip(self.param_groups, steppers, strict=True):
            group["use_muon"], group["muon_by_matrix"] = use_muon, by_matrix
        self._share()  # torch's load makes new group dicts and a new state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
        if self.matrix_muon is not None:
            self._step_by_matrix(self.matrix_muon)
        return loss

    def _step_by_matrix(self, matrix_muon: torch.optim.Optimizer) -> None:
        """One torch Muon step over every whole matrix of the split groups: each expert's matrix (views of the stacked
        weight, its gradient and momentum, updated in place), gathered DTensors (written back to their shards)."""
        matrix_muon.state.clear()
        write_backs = []
        groups = [g for g in self.param_groups if g["use_muon"] and g.get("muon_by_matrix")]
        for group, inner in zip(groups, matrix_muon.param_groups, strict=True):
            inner.update({key: value for key, value in group.items() if key != "params"})
            views = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                weight, grad, momentum, write_back = self._whole(param)
                if write_back is not None:
                    write_backs.append(write_back)
                matrices = zip(weight.unbind(0), grad.unbind(0), momentum.unbind(0), strict=True) \
                    if weight.ndim == 3 else [(weight, grad, momentum)]
                for matrix, matrix_grad, matrix_momentum in matrices:
                    matrix.grad = matrix_grad
                    matrix_muon.state[matrix] = {"momentum_buffer": matrix_momentum}
                    views.append(matrix)
            inner["params"] = views
        try:
            matrix_muon.step()
            for write_back in write_backs:
                write_back()
        finally:
            for inner in matrix_muon.param_groups:
                for matrix in inner["params"]:
                    matrix.grad = None
            matrix_muon.state.clear()

    def _whole(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """The parameter, its gradient and momentum as whole plain tensors the step updates in place, and what writes
        them back to a DTensor's shards (None for a plain tensor: the step updated it)."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        momentum = state["momentum_buffer"]
        assert param.grad is not None
        if not isinstance(param, DTensor):
            return param.detach(), param.grad, momentum, None
        assert isinstance(param.grad, DTensor) and isinstance(momentum, DTensor)
        weight, grad, whole_momentum = param.full_tensor(), param.grad.full_tensor(), momentum.full_tensor()

        def write_back() -> None:
            for target, whole in ((param, weight), (momentum, whole_momentum)):
                mesh = target.device_mesh
                # Replicate → the target's placements is a local slice on every rank: no communication.
                shard = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
                    mesh, target.placements).to_local()
                target.to_local().copy_(shard)

        return weight, grad, whole_momentum, write_back
