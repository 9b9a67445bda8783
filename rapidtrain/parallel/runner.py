"""How one wrapped model trains: micro-batch context, backward, optimizer step, state for checkpoints.

`TorchRunner` serves plain, DDP, FSDP2 and ZeroRedundancyOptimizer models; the DeepSpeed engine has its
own runner with the same methods (`parallel/deepspeed.py`). The trainer talks only to this interface.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rapidtrain.optim.grad_scaler import LossScaler
from rapidtrain.plan import Precision

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepOutcome:
    grad_norm: float | None
    skipped: bool = False  # fp16 overflow: no update, the schedule does not advance


def autocast(precision: Precision, device_type: str) -> contextlib.AbstractContextManager:
    if precision.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[precision.dtype])


def total_grad_norm(parameters: list[nn.Parameter], pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm of all gradients: DTensor shards (TP, FSDP) are reduced, pipeline stages summed."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    # torch's fp32 norm kernel drifts by up to ~1e-4 relative on millions of elements, and differently for
    # each way of sharding them, so layouts would log (and clip by) different norms. Plain tensors: fp32
    # sums of squares (cascade summation, within ~1e-7 of fp64) added up in fp64, with no fp64 copy of
    # the gradients (2.5 ms against 5–24 ms at 14M parameters on CPU, the upper figure with glibc's
    # default allocator faulting the copies in every step). DTensors (TP, FSDP): fp64 per-shard norms,
    # which DTensor combines across the shards.
    if any(isinstance(grad, DTensor) for grad in grads):
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
    else:
        norm = torch.stack([grad.float().square().sum() for grad in grads]).double().sum().sqrt()
    if pipeline_group is not None:
        squared = norm**2
        dist.all_reduce(squared, group=pipeline_group)
        norm = squared.sqrt()
    return norm


@dataclass
class TorchRunner:
    """A torch-wrapped model and its optimizer.

    `gradient_average` is how many ranks the wrapper averages gradients over (DDP and FSDP divide by the
    data-parallel size), so per-token loss sums can be scaled to the exact global-batch mean.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    device_type: str
    clip_grad: float
    gradient_average: int = 1
    pipeline_group: dist.ProcessGroup | None = None
    scaler: LossScaler | None = None
    found_inf_group: dist.ProcessGroup | None = None
    parameters: list[nn.Parameter] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.parameters:
            self.parameters = [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def micro_batch(self, is_last: bool) -> Iterator[None]:
        """Forward/backward of one micro-batch; gradients are synchronised only on the last."""
        with self._gradient_sync(is_last), autocast(self.precision, self.device_type):
            yield

    @property
    def skips_nonfinite(self) -> bool:
        """Under loss scaling an overflow skips the step; otherwise a non-finite loss must stop the run."""
        return self.scaler is not None

    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if hasattr(self.module, "set_requires_gradient_sync"):
            # FSDP2 decides in backward, which the trainer runs after this context (outside autocast):
            # so the flag is set for the whole micro-batch, and the last one turns reduction back on.
            self.module.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if enabled:
            return contextlib.nullcontext()
        if hasattr(self.module, "no_sync"):  # DDP
            return self.module.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> StepOutcome:
        if self.scaler is not None:
            found_inf = self.scaler.unscale_and_check(self.parameters, process_group=self.found_inf_group)
            self.scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return StepOutcome(None, skipped=True)
        norm = self.grad_norm()
        if self.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(self.parameters, self.clip_grad, norm.to(self._grad_device()))
        self.optimizer.step()
        self.zero_grad()
        return StepOutcome(float(norm))

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm that clipping and the log line use (expert parallelism overrides it)."""
        return total_grad_norm(self.parameters, self.pipeline_group)

    def _grad_device(self) -> torch.device:
        return self.parameters[0].device if self.parameters else torch.device("cpu")

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    # ---- checkpoint state (torch.distributed.checkpoint, reshardable) ----
    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if load_optimizer:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            if self.scaler is not None and "loss_scaler" in state:
                self.scaler.load_state_dict(state["loss_scaler"])
        else:
            set_model_state_dict(self.module, state["model"])

    def state_dict_for_loading(self, load_optimizer: bool) -> dict[str, Any]:
        """A state dict of the right shapes for torch.distributed.checkpoint.load to fill in place."""
        state = self.state_dict()
        if not load_optimizer:
            state.pop("optimizer")
            state.pop("loss_scaler", None)
        return state


def is_finite(value: float | torch.Tensor) -> bool:
    return math.isfinite(float(value))
