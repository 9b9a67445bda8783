"""LAMB with apex FusedLAMB's update rule, in plain PyTorch: serves `--optimizers apex_lamb` without apex.

Per step (apex `multi_tensor_lamb`): gradients are divided by max(1, global grad norm / max_grad_norm);
Adam moments with bias correction give u = m̂ / (√v̂ + eps) + weight_decay · w; then
w ← w − lr · r · u with trust ratio r = ‖w‖ / ‖u‖ (r = 1 when either norm is 0). As in apex, groups
without weight decay take r = 1 unless `use_nvlamb` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class LAMB(torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al., 2019), matching apex FusedLAMB's defaults and arithmetic.

    `adam_w_mode=False` adds the weight decay to the gradient (L2) instead of to the update;
    `grad_averaging=False` accumulates the first moment without the (1 − β1) factor;
    `max_grad_norm=None` turns off the built-in global gradient clipping.
    Moments are kept in float32 (as apex computes in float32) whatever the parameter's dtype.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float | None = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"LAMB: lr ({lr}), eps ({eps}) and weight decay ({weight_decay}) must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"LAMB: betas {betas} must lie in [0, 1); check --adam-beta1/--adam-beta2")
        if max_grad_norm is not None and max_grad_norm <= 0.0:
            raise ValueError(f"LAMB: max_grad_norm {max_grad_norm} must be > 0, or None to not clip")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            grad_averaging=grad_averaging,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.max_grad_norm = max_grad_norm
        self.use_nvlamb = use_nvlamb

    # torch types step() as two overloads (closure or none); one signature covering both is what torch's own
    # optimizers define too.
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return loss
        clip_divisor = self._clip_divisor(grads)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update_parameter(param, group, clip_divisor)
        return loss

    def _clip_divisor(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """max(1, ‖g‖ / max_grad_norm) over all gradients of all groups, kept on device (no sync)."""
        device = grads[0].device
        norms = torch.stack([torch.linalg.vector_norm(g.float()).to(device) for g in grads])
        global_norm = torch.linalg.vector_norm(norms)
        if self.max_grad_norm is None:
            return torch.ones((), device=device)
        return torch.where(
            global_norm > self.max_grad_norm, global_norm / self.max_grad_norm, torch.ones_like(global_norm)
        )

    def _update_parameter(
        self, param: torch.Tensor, group: dict[str, Any], clip_divisor: torch.Tensor
    ) -> None:
        assert param.grad is not None  # step() updates only parameters that have a gradient
        if param.grad.is_sparse:
            raise RuntimeError("LAMB does not support sparse gradients")
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        elif state["exp_avg"].dtype != torch.float32:
            # torch's load_state_dict casts state to the parameter's dtype; the moments stay float32.
            state["exp_avg"] = state["exp_avg"].float()
            state["exp_avg_sq"] = state["exp_avg_sq"].float()
        state["step"] += 1
        update = self._adam_update(param, group, state, clip_divisor.to(param.device))
        decay = group["weight_decay"]
        ratio = torch.ones((), device=param.device)
        if self.use_nvlamb or decay != 0.0:
            param_norm = torch.linalg.vector_norm(param.float())
            update_norm = torch.linalg.vector_norm(update)
            # apex's convention: a zero norm on either side leaves the plain learning rate.
            both_nonzero = (param_norm != 0.0) & (update_norm != 0.0)
            ratio = torch.where(both_nonzero, param_norm / update_norm, ratio)
        new_param = param.float() - group["lr"] * ratio * update
        param.copy_(new_param)

    def _adam_update(
        self, param: torch.Tensor, group: dict[str, Any], state: dict[str, Any], clip_divisor: torch.Tensor
    ) -> torch.Tensor:
        """Stage 1 of apex's kernel: the bias-corrected Adam direction plus decoupled weight decay."""
        beta1, beta2 = group["betas"]
        decay = group["weight_decay"]
        assert param.grad is not None  # step() updates only parameters that have a gradient
        grad = param.grad.float() / clip_divisor
        weights = param.float()
        if not self.adam_w_mode and decay != 0.0:
            grad = grad + decay * weights
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=(1.0 - beta1) if group["grad_averaging"] else 1.0)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        step = float(state["step"])
        correction1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
        correction2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
        update = (exp_avg / correction1) / ((exp_avg_sq / correction2).sqrt() + group["eps"])
        if self.adam_w_mode and decay != 0.0:
            update = update + decay * weights
        return update
