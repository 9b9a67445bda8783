"""Engine (alias RapidformerEngine): flags → distributed init → plan → wrapped model, optimizer, schedule.

`Engine(extra_args_provider=fn)` parses and checks the flags (exit 2 on conflicts), starts
torch.distributed, seeds, and builds the mesh. `compose()` applies the plan to a model in the fixed order
(tensor parallel → activation checkpointing → compile → data-parallel wrapping) and returns a runner
that the templates, or a user's own loop (`engine.backward`, `engine.step`), drive.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rapidtrain import arguments, rules
from rapidtrain.cpu_allocator import keep_freed_memory
from rapidtrain.parallel.mesh import ParallelMesh, build_mesh
from rapidtrain.parallel.runner import StepOutcome
from rapidtrain.plan import Plan, RunContext, from_args, lr_schedule_settings

_GLOBAL_ARGS: argparse.Namespace | None = None


def get_args() -> argparse.Namespace:
    """The parsed flags, for user scripts (Rapidformer's `get_args`); internal code is handed its settings."""
    if _GLOBAL_ARGS is None:
        raise RuntimeError("get_args() before the Engine parsed the flags: create Engine(...) first.")
    return _GLOBAL_ARGS


def init_distributed(backend: str | None, device_type: str) -> None:
    global _GROUPS_STARTED
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=10)
    store = fresh_group_store(timeout)
    extra = {}
    if store is not None:
        extra = {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(backend or ("nccl" if device_type == "cuda" else "gloo"), timeout=timeout, **extra)
    _GROUPS_STARTED += 1


# Default process groups this process started (a run after another's shutdown, as tests do, starts a second).
_GROUPS_STARTED = 0


def fresh_group_store(timeout: timedelta) -> dist.Store | None:
    """torchrun's store under a prefix of this restart attempt and group; None where the default is fresh.

    The agent of torchrun's static rendezvous (--master-port) keeps one store across restarts
    (--max-restarts) and across groups started one after another in a process, so a new group would read
    the old group's addresses and fail or hang connecting ("Gloo connectFullMesh failed").
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == _GROUPS_STARTED == 0:
        return None
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timeout)
    return dist.PrefixStore(f"rapidtrain/attempt_{attempt}/group_{_GROUPS_STARTED}", agent_store)


def main_script() -> str | None:
    """The file run as `__main__` when it is not one of rapidtrain's own entry points (pretrain.py, ...)."""
    from pathlib import Path

    import __main__

    path = getattr(__main__, "__file__", None)
    if path is None or Path(__file__).resolve().parent in Path(path).resolve().parents:
        return None
    return str(path)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Engine:
    """What a run needs before its model exists: flags, process groups, seeds, the plan."""

    def __init__(
        self,
        extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
        argv: Sequence[str] | None = None,
        defaults: dict | None = None,
        args: argparse.Namespace | None = None,
    ) -> None:
        global _GLOBAL_ARGS
        self.args = args or arguments.parse_args(argv, extra_args_provider, defaults)
        if self.args.user_script is None:  # `torchrun my_script.py` is a user script too (its template decides)
            self.args.user_script = main_script()
        self.context = RunContext.detect(self.args)
        rules.exit_on_conflicts(self.args, self.context)
        _GLOBAL_ARGS = self.args
        init_distributed(self.args.distributed_backend, self.context.device_type)
        self.device = self._device()
        if self.device.type == "cpu" and self.args.cpu_allocator_tuning:
            keep_freed_memory()
        seed_everything(self.args.seed)
        self.plan = from_args(self.args, self.context)
        self.mesh: ParallelMesh = build_mesh(self.plan.layout, self.context.device_type)
        self.runner: Any = None
        self.lr_scheduler: Any = None
        self.accumulation: Any = None  # an own loop's place in its global batch (trainers/composed.py)

    def _device(self) -> torch.device:
        if self.context.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def resolve_model(self, vocab_size: int) -> Plan:
        """Re-resolve the plan once the padded vocabulary (and so the built-in model's shape) is known."""
        self.plan = from_args(self.args, self.context, vocab_size=vocab_size)
        return self.plan

    def print_rank0(self, *message: Any) -> None:
        if self.is_main_process:
            print(*message, flush=True)

    # ---- composing a model for training ----

    def compose(
        self,
        model: nn.Module,
        train_dataloader: Any = None,
        eval_dataloader: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler_fn: Callable[..., Any] | None = None,
        model_factory: Callable[[], nn.Module] | None = None,
    ) -> tuple[Any, Any, Any, Any, Any]:
        """Wrap per the plan → (model, optimizer, lr_scheduler, train_dataloader, eval_dataloader).

        `optimizer` None: built from the flags. `lr_scheduler_fn(optimizer)` None: Megatron's schedule from
        the flags. The returned model is the wrapped module to call; `engine.backward`/`engine.step`
        drive the rest.
        """
        from rapidtrain.parallel.apply import parallelize

        names = {id(p): n for n, p in model.named_parameters()} if optimizer is not None else {}
        self.runner = parallelize(model, self.plan, self.mesh, self.device, optimizer=optimizer,
                                  optimizer_settings=self.plan.optimizer, clip_grad=self.args.clip_grad,
                                  loss_scale=self._loss_scale_settings(), model_factory=model_factory)
        if optimizer is not None and self.runner.optimizer is optimizer:  # the user's, over the wrapped parameters
            from rapidtrain.trainers.composed import rebind_optimizer

            rebind_optimizer(optimizer, names, self.runner.module)
        if train_dataloader is not None or eval_dataloader is not None:  # a user's own loop
            from rapidtrain.trainers.composed import compose_own_loop

            return compose_own_loop(self, train_dataloader, eval_dataloader, lr_scheduler_fn)
        self.lr_scheduler = self._scheduler(self.runner.optimizer, lr_scheduler_fn)
        return self.runner.module, self.runner.optimizer, self.lr_scheduler, train_dataloader, eval_dataloader

    def _loss_scale_settings(self):
        from rapidtrain.optim.grad_scaler import LossScaleSettings

        a = self.args
        return LossScaleSettings(loss_scale=a.loss_scale, initial_loss_scale=a.initial_loss_scale,
                                 min_loss_scale=a.min_loss_scale, loss_scale_window=a.loss_scale_window,
                                 hysteresis=a.hysteresis)

    def _scheduler(self, optimizer: torch.optim.Optimizer, lr_scheduler_fn: Callable | None,
                   steps_per_epoch: int | None = None) -> Any:
        if lr_scheduler_fn is not None:
            # DeepSpeed's ZeRO optimizer is no torch Optimizer, which torch schedulers refuse; its inner one
            # holds the same param_groups.
            if not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = getattr(optimizer, "optimizer", optimizer)
            return lr_scheduler_fn(optimizer)
        from rapidtrain.optim.lr_schedule import LRScheduler

        return LRScheduler(optimizer, lr_schedule_settings(self.args, self.plan.batches.global_batch_size,
                                                           self.total_iterations(steps_per_epoch)))

    def total_iterations(self, steps_per_epoch: int | None = None) -> int:
        if self.args.train_iters is not None:
            return self.args.train_iters
        if steps_per_epoch is None:
            return 0
        return steps_per_epoch * (self.args.epochs or 1)

    def backward(self, loss: torch.Tensor) -> None:
        """Use instead of `loss.backward()`: applies loss scaling / the DeepSpeed engine's backward."""
        if self.accumulation is not None:  # an own loop: the mean over the global batch's micro-batches
            loss = self.accumulation.scale(loss)
        self.runner.backward(loss)

    def step(self) -> StepOutcome:
        """Clip, step the optimizer (skipped on fp16 overflow) and advance the schedule by one global batch."""
        if self.accumulation is not None and not self.accumulation.is_last:
            return StepOutcome(None)  # an own loop mid global batch: gradients keep accumulating
        outcome = self.runner.step()
        if not outcome.skipped and self.lr_scheduler is not None and hasattr(self.lr_scheduler, "step"):
            self._advance_schedule()
        return outcome

    def _advance_schedule(self) -> None:
        from rapidtrain.optim.lr_schedule import LRScheduler

        if isinstance(self.lr_scheduler, LRScheduler):
            self.lr_scheduler.step(self.plan.batches.global_batch_size)
        else:
            self.lr_scheduler.step()

    def all_reduce_data_parallel(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        group = self.mesh.group("dp")
        if group is not None:
            dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


RapidformerEngine = Engine
