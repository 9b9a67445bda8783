"""One optimizer step, written once and read top to bottom: tokens → forward/backward → reduce → agree → step →
schedule. The Trainer's loop (every template) and an own loop (`Engine.compose`'s `engine.step()`) both take it
from here; the runner only runs micro-batches and the optimizer, and the engine only starts things up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rapidtrain.core.errors import UserError
from rapidtrain.core.metrics import Timers
from rapidtrain.models.moe import update_expert_biases
from rapidtrain.optim.lr_schedule import LRScheduler
from rapidtrain.parallel.runner import LossTotal, Runner, StepOutcome, agree


class TrainingStopped(UserError, RuntimeError):
    """The run cannot go on (a non-finite loss without loss scaling); nothing corrupt was saved."""


@dataclass
class TrainState:
    """Where the loop is: iterations done, samples consumed, and the last global batch's size (a ramp-up
    changes it). Checkpoints save the first two; a resumed run continues from them."""

    iteration: int = 0
    consumed_samples: int = 0
    last_global_batch: int = 0

    def advance(self, samples: int) -> None:
        self.iteration += 1
        self.consumed_samples += samples
        self.last_global_batch = samples


@dataclass
class StepDecision:
    """What one optimizer step did, as every rank agreed: its outcome, whether the loss was non-finite (and
    not skipped), whether a stop was requested anywhere."""

    outcome: StepOutcome
    nan: bool = False
    stop: bool = False


@dataclass
class StepResult:
    """One global batch trained: the reduced loss on the device, what the step did, and what it consumed."""

    loss: torch.Tensor
    decision: StepDecision
    samples: int
    tokens: int
    reported: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepContext:
    """What a step needs besides its batch: the runner, the data-parallel group and size, the schedule."""

    runner: Runner
    device: torch.device
    data_parallel_group: dist.ProcessGroup | None
    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    lr_scheduler: Any = None
    timers: Timers | None = None  # the forward-backward and optimizer timers, read only when asked
    per_token_loss: bool = False  # --calculate-per-token-loss: a mean loss from the forward step is refused
    # Context-parallel ranks share the data ranks' samples, each with a part of every sequence: losses and token
    # counts are reduced over data × context ranks (`data_parallel_group` is that group then).
    context_parallel_size: int = 1


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def global_token_count(counts: list[Any], group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """Loss-carrying tokens of the global batch (at least 1), counted on the host and summed over data-parallel
    ranks: an fp64 CPU tensor that gloo carries and the step divides by, never read on the host, so neither the
    device nor the loader's tensors are waited for. None when a micro-batch has no count (a mean loss)."""
    if any(c is None for c in counts):
        return None
    total = torch.stack([torch.as_tensor(c, dtype=torch.float64).reshape(()) for c in counts]).sum()
    return all_reduce(total, group).clamp(min=1)


def reduce_loss(total: LossTotal, global_tokens: torch.Tensor | int | None, group: dist.ProcessGroup | None,
                data_parallel_size: int) -> torch.Tensor:
    """The global batch's loss on the device: summed over data-parallel ranks, then averaged over its tokens
    (per-token sums) or its ranks (mean losses)."""
    value = all_reduce(total.value.clone(), group)
    if total.per_token and global_tokens is not None:
        return value / global_tokens
    return value / data_parallel_size


PER_TOKEN_NEEDS_COUNTS = (
    "--calculate-per-token-loss: the forward step returned a mean loss (or its batches carry no loss_mask / labels "
    "to count tokens by), so the loss cannot be averaged over the global batch's tokens. Return Megatron-Core's "
    "(loss sum, token count, {...}) from the loss function and give each batch a loss_mask, or drop the flag")


def advance_schedule(lr_scheduler: Any, samples: int) -> None:
    """Megatron's schedule counts samples (a ramp-up makes them differ from step to step); a user's torch
    scheduler counts steps."""
    if isinstance(lr_scheduler, LRScheduler):
        lr_scheduler.step(samples)
    elif lr_scheduler is not None and hasattr(lr_scheduler, "step"):
        lr_scheduler.step()


def finish_step(ctx: StepContext, loss: torch.Tensor | None, stop_requested: bool = False,
                where: str = "this iteration", samples: int | None = None) -> StepDecision:
    """Finish the gradients, agree with every rank (overflow, non-finite loss, stop) in one collective and one
    host read, then step or skip, and advance the schedule by one global batch (`samples`: this iteration's,
    when a ramp-up makes it differ from the global batch size).

    A non-finite loss without loss scaling stops the run before the optimizer step: nothing is updated and
    nothing saved (TrainingStopped)."""
    runner = ctx.runner
    found_inf = runner.unscale_gradients()
    nonfinite = ~torch.isfinite(loss) if loss is not None else False
    overflow, is_nonfinite, stop = agree(
        [found_inf if found_inf is not None else False, nonfinite, stop_requested], ctx.device)
    if is_nonfinite and not runner.skips_nonfinite:
        runner.zero_grad()
        raise TrainingStopped(
            f"the loss is not finite at {where}; the run stops before the optimizer step and saves nothing "
            "(the checkpoints in --save stay as they were). Lower --lr, keep --clip-grad on, check the data, "
            "or use --fp16 with loss scaling, then resume with --load.")
    outcome = runner.step(skip=overflow)
    # Aux-loss-free MoE balancing (Megatron-Core updates the biases with the step's gradients, skipped or not).
    update_expert_biases([runner.module, *getattr(runner, "views", [])], ctx.data_parallel_group)
    if not outcome.skipped:
        advance_schedule(ctx.lr_scheduler, samples or ctx.global_batch_size)
    return StepDecision(outcome, nan=is_nonfinite and not outcome.skipped, stop=stop)


def train_step(ctx: StepContext, micro_batches: list[Any], forward_step: Callable,
               token_count: Callable[[Any], Any], tokens_fed: Callable[[Any], int], *,
               stop_requested: bool = False, where: str = "this iteration") -> StepResult:
    """Forward and backward of every micro-batch of one global batch, then one optimizer step."""
    global_tokens = global_token_count([token_count(b) for b in micro_batches], ctx.data_parallel_group)
    with _timed(ctx, "forward-backward"):
        total = ctx.runner.forward_backward(micro_batches, forward_step, global_tokens)
        if ctx.per_token_loss and not total.per_token:
            ctx.runner.zero_grad()
            raise UserError(PER_TOKEN_NEEDS_COUNTS)
        loss = reduce_loss(total, global_tokens, ctx.data_parallel_group,
                           ctx.data_parallel_size * ctx.context_parallel_size)
    samples = len(micro_batches) * ctx.micro_batch_size * ctx.data_parallel_size
    with _timed(ctx, "optimizer"):
        decision = finish_step(ctx, loss, stop_requested, where=where, samples=samples)
    tokens = sum(tokens_fed(b) for b in micro_batches) * ctx.data_parallel_size * ctx.context_parallel_size
    return StepResult(loss, decision, samples, tokens, total.reported)


@contextlib.contextmanager
def _timed(ctx: StepContext, name: str) -> Iterator[None]:
    """A timer reading waits for the device: timed only when --log-timers-to-tensorboard asks."""
    if ctx.timers is None:
        yield
        return
    timer = ctx.timers(name)
    timer.start()
    yield
    timer.stop()
