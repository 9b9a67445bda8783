"""What `Engine.compose` hands to a user's own loop (Rapidformer's "no trainer" shape).

Each training micro-batch is yielded inside the runner's micro-batch context (autocast, no gradient
all-reduce before the last micro-batch of a global batch), and the returned optimizer steps only at the end
of a global batch: so a plain PyTorch loop accumulates, runs mixed precision and partitions state as the
flags say, unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from rapidtrain.core.errors import UserError
from rapidtrain.data.loaders import ShardedLoader, eval_loader, train_loader
from rapidtrain.parallel.runner import autocast


class AccumulationTracker:
    """Where the own loop stands in its global batch: set by the training loader, read by the engine."""

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.group_size = 1
        self.is_last = True

    def place(self, step: int, steps_in_epoch: float) -> None:
        """Micro-batch `step` of an epoch of `steps_in_epoch`: its group is cut short at the epoch's end."""
        group_start = step - step % self.accumulation_steps
        self.group_size = int(min(self.accumulation_steps, steps_in_epoch - group_start))  # inf: no epoch end
        self.is_last = step - group_start == self.group_size - 1

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the global batch: each micro-batch's mean loss weighs 1 / micro-batches."""
        return loss / self.group_size


class ComposedOptimizer:
    """The optimizer an own loop sees: `step()` is the engine's (clip, loss scale, schedule) and acts at the
    end of a global batch only; `zero_grad()` is left to the engine, which clears gradients after each step.
    Everything else (param_groups, state_dict, ...) is the real optimizer's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def step(self, closure: Callable | None = None) -> None:
        self._engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients must survive until the last micro-batch of a global batch."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.runner.optimizer, name)


class ComposedScheduler:
    """The schedule an own loop sees: it advances with each optimizer step the engine takes (and not after
    an fp16 overflow), so `lr_scheduler.step()` in the loop is accepted and does nothing more."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Already done by the optimizer step."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def _reshard(loader: Any, engine: Any, train: bool, context: Callable | None) -> Any:
    """A user's DataLoader rebuilt over this rank's share with --micro-batch-size; other iterables are only
    moved to the device (an IterableDataset must shard itself)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        if isinstance(loader, DataLoader):
            return ShardedLoader(loader, engine.device, context, engine.mesh.group("dp"))
        return loader
    settings = engine.shard_settings()
    if loader.batch_size not in (None, settings.micro_batch_size):
        engine.print_rank0(
            f" note: the DataLoader's batch_size {loader.batch_size} is replaced by "
            f"--micro-batch-size {settings.micro_batch_size} (batch per data-parallel rank)"
        )
    if train:
        shuffle = isinstance(loader.sampler, RandomSampler)
        return train_loader(
            loader.dataset, loader.collate_fn, settings, engine.device, shuffle=shuffle, context=context
        )
    return eval_loader(loader.dataset, loader.collate_fn, settings, engine.device, context=context)


def compose_own_loop(
    engine: Any, train_dataloader: Any, eval_dataloader: Any, lr_scheduler_fn: Callable | None
) -> tuple[Any, Any, Any, Any, Any]:
    """The rest of `Engine.compose` when the user brings data loaders: see the module docstring."""
    if engine.plan.layout.context_parallel_size > 1:
        raise UserError(f"--context-parallel-size {engine.plan.layout.context_parallel_size}: an own training loop's "
                        "batches reach the model whole, and context parallelism needs each rank's part of every "
                        "sequence (rapidtrain's templates split them: PreTrainer, the built-in pretraining). Train "
                        "through a template, or drop the flag.")
    runner = engine.runner
    tracker = AccumulationTracker(engine.plan.batches.accumulation_steps)
    train = None
    if train_dataloader is not None:
        train = _reshard(train_dataloader, engine, True, None)
        steps_in_epoch = len(train) if hasattr(train, "__len__") else None

        @contextlib.contextmanager
        def micro_batch(step: int) -> Iterator[None]:
            tracker.place(step, steps_in_epoch or math.inf)
            with runner.micro_batch(is_last=tracker.is_last):
                yield

        if isinstance(train, ShardedLoader):
            train.context = micro_batch
        engine.accumulation = tracker
    evaluation = None
    if eval_dataloader is not None:
        evaluation = _reshard(
            eval_dataloader, engine, False, lambda step: autocast(runner.precision, engine.device.type)
        )
    steps_per_epoch = None
    if isinstance(train, ShardedLoader):
        steps_per_epoch = math.ceil(len(train) / tracker.accumulation_steps)
    engine.lr_scheduler = engine.build_scheduler(runner.optimizer, lr_scheduler_fn, steps_per_epoch)
    return runner.module, ComposedOptimizer(engine), ComposedScheduler(engine.lr_scheduler), train, evaluation


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], module: torch.nn.Module
) -> int:
    """Point a user's optimizer at the parameters the wrapping created (FSDP2 and tensor parallelism replace
    them with DTensors), in place, so schedulers built on it stay valid; returns how many were replaced."""
    from rapidtrain.models.transformer import canonical_name  # names without checkpoint/compile wrappers
    from rapidtrain.parallel.data_parallel import unwrap

    current = {canonical_name(name): p for name, p in unwrap(module).named_parameters()}
    replaced = 0
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            new = current.get(canonical_name(old_names.get(id(param), "")))
            if new is not None and new is not param:
                if param in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(param)
                group["params"][index] = new
                replaced += 1
    return replaced
