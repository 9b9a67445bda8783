"""What the loop reports: one result per iteration, interval totals, the Megatron log line (built once, for
every template), the exact per-iteration losses of --loss-log-file, and TensorBoard scalars.

Results stay on the device while training runs; they are read on the host only when a log line (or the
loss file, flushed at the same moments) needs them, so iterations between log lines never wait on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rapidtrain.config.settings import Plan
from rapidtrain.core.metrics import IntervalStats, format_log_line, mfu, peak_memory_bytes


@dataclass
class IterationResult:
    loss: torch.Tensor  # the global batch's loss, on the device
    grad_norm: torch.Tensor | None  # on the device; None when the step was skipped
    skipped: bool  # fp16 overflow: no update
    nan: bool  # a non-finite loss that was not skipped
    samples: int  # samples of this iteration over all data-parallel ranks
    tokens: int  # tokens of this iteration over all data-parallel ranks (throughput)
    data_seconds: float = 0.0
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. the MoE load-balancing loss
    stop: bool = False  # a rank asked to stop (SIGTERM, --exit-duration-in-mins)
    # What a Megatron loss function reported ({"lm loss": ...}): [sum, weight] pairs, this rank's.
    reported: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class IntervalTotals:
    """Loss and counters summed over the iterations since the last log line (device sums, host counts)."""

    iterations: int = 0
    loss_sum: torch.Tensor | None = None
    loss_count: int = 0
    data_seconds: float = 0.0
    skipped: int = 0
    nan: int = 0
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    last_grad_norm: torch.Tensor | None = None
    reported: dict[str, torch.Tensor] = field(default_factory=dict)  # [sum, weight] pairs, this rank's

    def add(self, result: IterationResult) -> None:
        self.iterations += 1
        if not (result.skipped or result.nan):
            loss = result.loss.detach()
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            self.loss_count += 1
            for name, pair in result.reported.items():
                self.reported[name] = pair if name not in self.reported else self.reported[name] + pair
        self.data_seconds += result.data_seconds
        self.skipped += result.skipped
        self.nan += result.nan
        for name, value in result.extras.items():
            self.extras[name] = value if name not in self.extras else self.extras[name] + value
        self.last_grad_norm = result.grad_norm

    def mean_losses(self, loss_name: str, reported: dict[str, float] | None = None) -> dict[str, float]:
        """The interval's average loss by name; Megatron leaves out iterations that skipped or hit NaN (no
        entry at all when every iteration did). `reported`: the means of what a Megatron loss function
        returned, shown instead of rapidtrain's own reduction, as Megatron shows that dict."""
        losses = {}
        if reported:
            losses.update(reported)
        elif self.loss_sum is not None:
            losses[loss_name] = float(self.loss_sum) / self.loss_count
        losses.update({name: float(value) / max(self.iterations, 1) for name, value in self.extras.items()})
        return losses


def build_log_line(plan: Plan, totals: IntervalTotals, interval: IntervalStats, *, iteration: int,
                   train_iters: int, consumed_samples: int, learning_rate: float, loss_scale: float,
                   loss_name: str, flops_per_iteration: float | None, device: torch.device,
                   extras: dict[str, Any] | None = None, global_batch_size: int | None = None,
                   reported: dict[str, float] | None = None,
                   params_norm: float | None = None) -> tuple[str, dict[str, float]]:
    """Megatron's log line for the interval, and the scalars it shows (for TensorBoard, as the logging
    settings choose). `global_batch_size`: the last iteration's (a ramp-up changes it); `reported`: the
    means of a Megatron loss function's dict, all ranks'."""
    seconds = interval.seconds_per_iteration
    losses = totals.mean_losses(loss_name, reported)
    grad_norm = float(totals.last_grad_norm) if totals.last_grad_norm is not None else None
    global_batch_size = global_batch_size or plan.batches.global_batch_size
    peak_bytes = peak_memory_bytes(device)
    shown: dict[str, Any] = {
        "tokens per second": round(interval.tokens_per_second, 1),
        "data time (ms)": round(1000 * totals.data_seconds / max(totals.iterations, 1), 2),
        "peak memory (MB)": round(peak_bytes / 2**20, 1),
    }
    peak = plan.logging.peak_tflops
    if flops_per_iteration is not None and peak:
        shown["MFU"] = f"{100 * mfu(flops_per_iteration, seconds, plan.layout.world_size, peak):.2f}%"
    shown.update(extras or {})
    line = format_log_line(
        iteration=iteration, train_iters=train_iters, consumed_samples=consumed_samples,
        seconds_per_iteration=seconds, learning_rate=learning_rate,
        global_batch_size=global_batch_size, losses=losses, loss_scale=loss_scale,
        grad_norm=grad_norm, skipped_iterations=totals.skipped, nan_iterations=totals.nan,
        flops_per_iteration=flops_per_iteration, world_size=plan.layout.world_size, extras=shown,
        params_norm=params_norm)
    logging = plan.logging
    scalars = {f"train/{name}": value for name, value in losses.items()}
    scalars["train/tokens per second"] = interval.tokens_per_second
    optional = {
        "train/learning rate": (logging.learning_rate_to_tensorboard, learning_rate),
        "train/loss scale": (logging.loss_scale_to_tensorboard, loss_scale),
        "train/batch size": (logging.batch_size_to_tensorboard, global_batch_size),
        "train/world size": (logging.world_size_to_tensorboard, plan.layout.world_size),
        "memory/peak (MB)": (logging.memory_to_tensorboard, peak_bytes / 2**20),
        "train/grad norm": (grad_norm is not None, grad_norm),
        "train/params norm": (params_norm is not None, params_norm),
    }
    scalars.update({tag: float(value) for tag, (wanted, value) in optional.items() if wanted and value is not None})
    return line, scalars


class LossRecords:
    """--loss-log-file: every iteration's exact loss (`iteration loss skipped grad_norm`, floats as
    float.hex, then each extra value as `name=float.hex`, e.g. `load_balancing_loss=0x...`), kept on the
    device and written when the loop logs or ends."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._pending: list[tuple[int, IterationResult]] = []

    def add(self, iteration: int, result: IterationResult) -> None:
        if self.path:
            self._pending.append((iteration, result))

    def flush(self) -> None:
        if not self.path or not self._pending:
            return
        norms = [r.grad_norm for _, r in self._pending]
        # One device-to-host copy: every loss, then every extra value, in order.
        names = [sorted(r.extras) for _, r in self._pending]
        values = torch.stack([r.loss.detach().double().reshape(()) for _, r in self._pending]
                             + [r.extras[n].detach().double().reshape(()).to(r.loss.device)
                                for (_, r), row in zip(self._pending, names, strict=True) for n in row]).tolist()
        losses, extras = values[:len(self._pending)], iter(values[len(self._pending):])
        with open(self.path, "a") as log:
            for (iteration, result), loss, norm, row in zip(self._pending, losses, norms, names, strict=True):
                shown = "-" if norm is None else float(norm).hex()
                columns = "".join(f" {name.replace(' ', '_')}={float(next(extras)).hex()}" for name in row)
                log.write(f"{iteration} {float(loss).hex()} {int(result.skipped)} {shown}{columns}\n")
        self._pending = []
