"""One optimizer made of torch.optim.Muon and torch.optim.AdamW (for --optimizer muon; optim/muon.py says which
parameters each takes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the groups tagged `use_muon`, torch.optim.AdamW for the others, over one list of groups
    kept in the given order (ZeroRedundancyOptimizer pairs its groups with its local optimizer's by position) and one
    state. Each inner optimizer lists the same group dicts and holds the same state, so `state_dict` and
    `load_state_dict` (torch.distributed.checkpoint's too) see one optimizer; a loaded state is handed back to them.
    """

    def __init__(self, groups: Iterable[dict[str, Any]], muon_options: dict[str, Any],
                 adamw_options: dict[str, Any]) -> None:
        groups = list(groups)
        muon_groups = [g for g in groups if g["use_muon"]]
        adamw_groups = [g for g in groups if not g["use_muon"]]
        # The inner optimizers fill their defaults into these dicts, which this optimizer then lists as they are.
        self.muon = torch.optim.Muon(muon_groups, **muon_options) if muon_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_options) if adamw_groups else None
        super().__init__(groups, defaults={})
        self._share()

    def _share(self) -> None:
        for inner, use_muon in ((self.muon, True), (self.adamw, False)):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if bool(g["use_muon"]) is use_muon]
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
        return loss
