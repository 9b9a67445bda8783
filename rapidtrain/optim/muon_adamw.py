"""One optimizer made of torch.optim.Muon and torch.optim.AdamW (for --optimizer muon; optim/muon.py says which
parameters each takes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the groups tagged `use_muon`, torch.optim.AdamW for the others, over one list of groups
    kept in the given order (ZeroRedundancyOptimizer pairs its groups with its local optimizer's by position) and one
    state, which `state_dict` / `load_state_dict` (torch.distributed.checkpoint's too) see as one optimizer's.

    The matrices' Muon and AdamW list the same group dicts and hold the same state. The experts' stacked weights
    (groups tagged `muon_experts`) are stepped by a third, torch.optim.Muon over each expert's [in, out] matrix as a
    view: their momentum is kept here as one [E, in, out] tensor per weight (what a checkpoint holds), and the
    expert Muon's groups and state are views of it, made again at each step (so a loaded or cleared state, or a
    moved weight, is never stale).
    """

    def __init__(self, groups: Iterable[dict[str, Any]], muon_options: dict[str, Any],
                 adamw_options: dict[str, Any]) -> None:
        groups = list(groups)
        matrix_groups = [g for g in groups if g["use_muon"] and not g.get("muon_experts")]
        expert_groups = [g for g in groups if g["use_muon"] and g.get("muon_experts")]
        adamw_groups = [g for g in groups if not g["use_muon"]]
        # The inner optimizers fill their defaults into these dicts, which this optimizer then lists as they are.
        self.muon = torch.optim.Muon(matrix_groups, **muon_options) if matrix_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_options) if adamw_groups else None
        self.expert_muon = None
        if expert_groups:
            views = [{**g, "params": [p.detach()[0] for p in g["params"]]} for g in expert_groups]
            self.expert_muon = torch.optim.Muon(views, **muon_options)
            for group, inner in zip(expert_groups, self.expert_muon.param_groups, strict=True):
                for key, value in inner.items():
                    group.setdefault(key, value)
        super().__init__(groups, defaults={})
        self._share()

    def _share(self) -> None:
        for inner, wanted in ((self.muon, (True, False)), (self.adamw, (False, False))):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups
                                      if (bool(g["use_muon"]), bool(g.get("muon_experts", False))) == wanted]
                inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
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
        if self.expert_muon is not None:
            self._step_experts(self.expert_muon)
        return loss

    def _step_experts(self, expert_muon: torch.optim.Optimizer) -> None:
        """One torch Muon step over every expert's matrix: views of the stacked weights, their gradients and the
        stacked momentum, which torch's Muon updates in place."""
        expert_muon.state.clear()
        groups = [g for g in self.param_groups if g["use_muon"] and g.get("muon_experts")]
        for group, inner in zip(groups, expert_muon.param_groups, strict=True):
            inner.update({key: value for key, value in group.items() if key != "params"})
            views = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                for weight, grad, momentum in zip(param.detach().unbind(0), param.grad.unbind(0),
                                                  state["momentum_buffer"].unbind(0), strict=True):
                    weight.grad = grad
                    expert_muon.state[weight] = {"momentum_buffer": momentum}
                    views.append(weight)
            inner["params"] = views
        try:
            expert_muon.step()
        finally:
            for inner in expert_muon.param_groups:
                for weight in inner["params"]:
                    weight.grad = None
            expert_muon.state.clear()
