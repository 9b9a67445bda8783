"""Loss scaling for fp16 training with Megatron's semantics: dynamic (with hysteresis) or constant.

The loop: `scaler.scale(loss).backward()`; `found_inf = scaler.unscale(params)` (a flag on the device, reduced
over every rank with the iteration's other decisions); step the optimizer only when no rank found an overflow;
`scaler.update(skipped)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapidtrain.core.errors import UserError

if TYPE_CHECKING:  # the scaler's methods import torch: the plan checks LossScaleSettings without it
    import torch
    import torch.distributed as dist


class LossScalingError(UserError, ValueError):
    """Loss-scaling flags out of range (the message names them)."""


@dataclass(frozen=True)
class LossScaleSettings:
    """Flags `--loss-scale` (constant when given), `--initial-loss-scale`, `--min-loss-scale`,
    `--loss-scale-window`, `--hysteresis`; growth ×2 and backoff ×0.5 as Megatron fixes them."""

    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        problems = []
        if self.loss_scale is not None and self.loss_scale <= 0:
            problems.append(f"--loss-scale {self.loss_scale} must be > 0 (or left out for dynamic scaling)")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            problems.append(
                f"--min-loss-scale {self.min_loss_scale} must be > 0 and <= --initial-loss-scale "
                f"{self.initial_loss_scale}"
            )
        if self.loss_scale_window <= 0:
            problems.append(f"--loss-scale-window {self.loss_scale_window} must be >= 1")
        if self.hysteresis <= 0:
            problems.append(f"--hysteresis {self.hysteresis} must be >= 1")
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            problems.append("the growth factor must be > 1 and the backoff factor in (0, 1)")
        if problems:
            raise LossScalingError("loss scaling: " + "; ".join(problems))


class LossScaler:
    """Megatron's `DynamicGradScaler` (or `ConstantGradScaler` when `--loss-scale` is set).

    Dynamic: an overflow resets the growth count and uses up one unit of hysteresis; once the
    hysteresis is spent, each overflow multiplies the scale by the backoff factor (never below the
    minimum). After `loss_scale_window` overflow-free steps in a row the scale grows and the
    hysteresis is restored. As in Megatron's code, steps without overflow do not restore it.

    `data_parallel_average`: how many ranks the data-parallel wrapper averages gradients over. The loop
    multiplies each rank's loss by that count so the average comes out as the global-batch mean; the scaler
    takes it back out of the backward multiplier (and puts it back when unscaling), so each rank's fp16
    activation gradients have the one-process magnitudes and overflow at the same loss scale whatever the
    data-parallel size (Megatron's headroom: its loss is never multiplied by the data-parallel size).
    """

    def __init__(self, settings: LossScaleSettings | None = None, data_parallel_average: int = 1) -> None:
        self.settings = settings or LossScaleSettings()
        self.data_parallel_average = max(int(data_parallel_average), 1)
        self.dynamic = self.settings.loss_scale is None
        loss_scale = self.settings.loss_scale
        self._scale = float(self.settings.initial_loss_scale if loss_scale is None else loss_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.settings.hysteresis

    @property
    def loss_scale(self) -> float:
        """The current scale (what the log line prints as `loss scale`)."""
        return self._scale

    @property
    def multiplier(self) -> float:
        """What `scale` multiplies a loss by: the loss scale over the data-parallel average."""
        return self._scale / self.data_parallel_average

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the scale (over the data-parallel average); call `.backward()` on the result."""
        return loss * self.multiplier

    def unscale(self, optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide every gradient by the scale in place (torch's foreach kernel); this rank's overflow flag.

        The flag stays on the device (no wait on the host): a float 1.0 if any local gradient (the local
        shard of a DTensor one) is inf or NaN. Ranks holding different shards must agree on it before the
        step is taken or skipped (the loop reduces it over every rank).
        """
        import torch

        grads = [_local(p.grad) for p in _parameters(optimizer_or_params) if p.grad is not None]
        if any(grad.dtype == torch.float16 for grad in grads):
            # Dividing fp16 gradients by a scale such as 2^32 flushes them to zero: keep fp32 master
            # weights (fp16 autocast) or accumulate into fp32 gradients before unscaling.
            raise ValueError(
                "loss scaling: the gradients are float16, and unscaling them in place would flush them "
                "to zero; train with fp32 parameters under fp16 autocast (--fp16 / --mixed-precision do)"
            )
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = torch.full((1,), 1.0 / self.multiplier, dtype=torch.float32, device=device)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault((grad.device, grad.dtype), []).append(grad)
        for (grad_device, _), group in by_device.items():
            flag = found_inf if grad_device == device else torch.zeros(1, device=grad_device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv_scale.to(grad_device))
            if flag is not found_inf:
                found_inf = torch.maximum(found_inf, flag.to(device))
        return found_inf.reshape(())

    def unscale_and_check(
        self,
        optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor],
        process_group: dist.ProcessGroup | None = None,
    ) -> bool:
        """`unscale`, then the flag agreed over `process_group` (MAX) and read on the host."""
        import torch
        import torch.distributed as dist

        found_inf = self.unscale(optimizer_or_params)
        if process_group is not None:
            if dist.get_backend(process_group) == "nccl":
                found_inf = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=process_group)
        return bool(found_inf.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (no-op for a constant scale)."""
        if not self.dynamic:
            return
        s = self.settings
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * s.backoff_factor, s.min_loss_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == s.loss_scale_window:
            self._growth_tracker = 0
            self._hysteresis_tracker = s.hysteresis
            self._scale *= s.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys: `scale`, `growth_tracker`, `hysteresis_tracker` (empty when constant)."""
        if not self.dynamic:
            return {}
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a dynamic scaler; a constant scale comes from the flags, so it ignores the state."""
        if not self.dynamic or not state_dict:
            return
        scale = state_dict["scale"]
        self._scale = float(scale.item() if hasattr(scale, "item") else scale)  # a tensor or a number
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what the foreach kernels take), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _parameters(optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    if isinstance(optimizer_or_params, torch.optim.Optimizer):
        return [p for group in optimizer_or_params.param_groups for p in group["params"]]
    return list(optimizer_or_params)
