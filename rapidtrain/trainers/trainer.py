"""The training loop every template shares: one iteration = one global batch = one optimizer step.

`Trainer` is also Rapidformer's general template: bring a model whose `forward(**batch)` returns an
object with `.loss` (as Hugging Face models do) or override `run_forward_step`. PreTrainer and
Finetuner subclass it and supply data and models.

Loss normalisation: a forward step may return a mean loss (each micro-batch then weighs the same,
Megatron's classic rule) or `(loss_sum, num_tokens)` through a loss function; then the loss is averaged
over the tokens of the whole global batch, so the result does not depend on how the batch is split.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rapidtrain.engine import Engine
from rapidtrain.errors import UserError


class TrainingStopped(UserError, RuntimeError):
    """The run cannot go on (a non-finite loss without loss scaling); nothing corrupt was saved."""


@dataclass
class IterationResult:
    loss: float
    grad_norm: float | None
    skipped: bool
    nan: bool
    data_seconds: float
    tokens: int
    extras: dict[str, float] = field(default_factory=dict)


@dataclass
class IntervalTotals:
    """Loss and counters summed over the iterations since the last log line."""

    iterations: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    data_seconds: float = 0.0
    tokens: int = 0
    skipped: int = 0
    nan: int = 0
    extras: dict[str, float] = field(default_factory=dict)

    def add(self, result: IterationResult) -> None:
        self.iterations += 1
        if not (result.skipped or result.nan):
            self.loss_sum += result.loss
            self.loss_count += 1
        self.data_seconds += result.data_seconds
        self.tokens += result.tokens
        self.skipped += result.skipped
        self.nan += result.nan
        for name, value in result.extras.items():
            self.extras[name] = self.extras.get(name, 0.0) + value


def default_token_count(batch: Any) -> int | None:
    """Tokens that carry loss in a micro-batch: the sum of `loss_mask`, or non-ignored `labels`."""
    if isinstance(batch, dict):
        if "loss_mask" in batch:
            return int(torch.as_tensor(batch["loss_mask"]).sum())
        if "labels" in batch:
            return int((torch.as_tensor(batch["labels"]) != -100).sum())
    return None


class StopSignal:
    """SIGTERM (sent by schedulers and torchrun on shutdown) asks the loop to save and exit cleanly."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class Trainer:
    """The loop. Subclasses provide data (`train_valid_test_datasets_provider`) and models."""

    def __init__(self, engine: Engine | None = None, **engine_kwargs: Any) -> None:
        self.engine = engine or Engine(**engine_kwargs)
        self.args = self.engine.args
        self.iteration = 0
        self.consumed_samples = 0
        self.model: Any = None
        self.token_count: Callable[[Any], int | None] = default_token_count

    # ---- hooks ----
    def run_forward_step(self, data_iterator: Iterator[Any], model: Any) -> Any:
        """Default for Hugging Face style models: `model(**batch).loss`."""
        batch = next(data_iterator)
        output = model(**batch)
        return output.loss if hasattr(output, "loss") else output["loss"]

    def train(self) -> dict[str, Any]:
        """The general template's loop: epoch-based (--epochs) or iteration-based (--train-iters) over the hooks
        `train_valid_test_datasets_provider()` → (train, valid, test, collate_fn) and
        `model_optimizer_lr_scheduler_provider()`, with the validation loss after each epoch; it is the
        Finetuner's loop (trainers/finetuner.py), calling this class's `run_forward_step(data_iterator, model)`."""
        from rapidtrain.trainers.finetuner import TemplateRun

        return TemplateRun(self).train()

    def forward_micro_batch(self, batches: Iterator[Any]) -> Any:
        """One micro-batch's forward step; Finetuner hands its hook the batch itself, not the iterator."""
        return self.run_forward_step(batches, self.model)

    # ---- one iteration ----
    def train_step(self, micro_batches: list[Any]) -> IterationResult:
        runner = self.engine.runner
        steps = len(micro_batches)
        global_tokens = self._global_tokens(micro_batches)
        self._set_moe_aux_scale(steps)
        if hasattr(runner, "train_iteration"):  # pipeline parallel: the schedule runs every micro-batch itself
            loss_total, per_token = runner.train_iteration(micro_batches, self.run_forward_step, global_tokens)
        else:
            loss_total, per_token = self._run_micro_batches(micro_batches, global_tokens)
        loss = self._reduce_loss(loss_total, per_token, global_tokens)
        nan = not math.isfinite(loss)
        if nan and not runner.skips_nonfinite:
            raise TrainingStopped(
                f"the loss is {loss} at iteration {self.iteration + 1}; the run stops before the optimizer step and "
                "saves nothing (the checkpoints in --save stay as they were). Lower --lr, keep --clip-grad on, check "
                "the data, or use --fp16 with loss scaling, then resume with --load.")
        outcome = self.engine.step()
        return IterationResult(loss, outcome.grad_norm, outcome.skipped, nan and not outcome.skipped, 0.0,
                               tokens=self._tokens_of(micro_batches), extras=self._moe_extras())

    def _run_micro_batches(self, micro_batches: list[Any], global_tokens: int | None) -> tuple[torch.Tensor, bool]:
        """Forward and backward of each micro-batch → (loss total, whether it is a per-token sum)."""
        runner, steps = self.engine.runner, len(micro_batches)
        batches = iter(micro_batches)
        loss_total = torch.zeros((), dtype=torch.float64)
        per_token = False
        for index in range(steps):
            with runner.micro_batch(is_last=index == steps - 1):
                output = self.forward_micro_batch(batches)
                loss_sum, count = self._as_loss(output)
            per_token = count is not None and global_tokens is not None
            if per_token:
                backward_loss = loss_sum * (runner.gradient_average / global_tokens)
            else:
                backward_loss = loss_sum / steps
            runner.backward(backward_loss)
            loss_total += loss_sum.detach().double().cpu() if per_token else loss_sum.detach().double().cpu() / steps
        return loss_total, per_token

    def _as_loss(self, output: Any) -> tuple[torch.Tensor, int | None]:
        """A forward step's result as (loss or loss sum, token count or None)."""
        if isinstance(output, tuple) and len(output) == 2 and callable(output[1]):
            output = output[1](output[0])
        if isinstance(output, tuple):
            loss_sum, count = output
            return loss_sum, int(count)
        return output, None

    def _global_tokens(self, micro_batches: list[Any]) -> int | None:
        counts = [self.token_count(b) for b in micro_batches]
        if any(c is None for c in counts):
            return None
        total = torch.tensor(float(sum(counts)))
        self.engine.all_reduce_data_parallel(total)
        return max(int(total), 1)

    def _reduce_loss(self, loss_total: torch.Tensor, per_token: bool, global_tokens: int | None) -> float:
        value = loss_total.clone().float()
        self.engine.all_reduce_data_parallel(value)
        if per_token:
            return float(value) / global_tokens
        return float(value) / self.engine.plan.layout.data_parallel_size

    def _tokens_of(self, micro_batches: list[Any]) -> int:
        first = micro_batches[0] if micro_batches else None
        if isinstance(first, dict):
            for key in ("tokens", "input_ids", "text"):
                if key in first:
                    tensor = torch.as_tensor(first[key])
                    return tensor.numel() * len(micro_batches) * self.engine.plan.layout.data_parallel_size
        return 0

    def _set_moe_aux_scale(self, steps: int) -> None:
        from rapidtrain.models import moe

        scaler = getattr(self.engine.runner, "scaler", None)
        scale = scaler.loss_scale if scaler is not None else 1.0
        moe.set_aux_loss_scale(scale / steps)

    def _moe_extras(self) -> dict[str, float]:
        from rapidtrain.models import moe

        module = self.engine.runner.module
        aux = moe.collect_aux_losses(module)
        if aux is None:
            return {}
        value = aux.detach().float().reshape(1)
        self.engine.all_reduce_data_parallel(value)
        return {"load balancing loss": float(value) / self.engine.plan.layout.data_parallel_size}

    # ---- stopping, saving ----
    def checkpoint_extra(self) -> dict[str, Any]:
        """What a template keeps in a checkpoint beyond model, optimizer and position (Finetuner: best metric)."""
        return {}

    def restore_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        """Take back what `checkpoint_extra` saved (nothing by default)."""

    def should_stop(self, stop_signal: StopSignal, started: float) -> bool:
        a = self.args
        flags = [stop_signal.received,
                 bool(a.exit_interval and self.iteration % a.exit_interval == 0),
                 bool(a.exit_duration_in_mins and time.time() - started > a.exit_duration_in_mins * 60)]
        decision = torch.tensor([float(any(flags))])
        if dist.is_initialized():  # every rank must agree, or a save would hang
            dist.all_reduce(decision, op=dist.ReduceOp.MAX)
        return bool(decision.item())

    def save(self) -> None:
        from rapidtrain.checkpoint import save_checkpoint

        if not self.args.save:
            return
        path = save_checkpoint(self.args.save, self.iteration, self.engine.runner, self.engine.lr_scheduler,
                               self.consumed_samples, self.args, extra=self.checkpoint_extra())
        self.engine.print_rank0(f" saved checkpoint at iteration {self.iteration:7d} to {path}")

    def load(self) -> None:
        from rapidtrain.checkpoint import load_checkpoint

        if not self.args.load:
            return
        loaded = load_checkpoint(self.args.load, self.engine.runner, self.engine.lr_scheduler, self.args,
                                 finetune=self.args.finetune, load_optimizer=not self.args.no_load_optim,
                                 load_rng=not self.args.no_load_rng)
        if loaded is None:
            self.engine.print_rank0(f" no checkpoint in {self.args.load}; starting from scratch")
            return
        self.iteration, self.consumed_samples = loaded.iteration, loaded.consumed_samples
        self.restore_checkpoint_extra(loaded.extra)
        self.engine.print_rank0(f" loaded checkpoint from {self.args.load} at iteration {self.iteration}")
