"""Engine (alias RapidformerEngine): flags → plan → distributed init → wrapped model, optimizer, schedule.

`Engine(extra_args_provider=fn)` parses and checks the flags (exit 2 on conflicts), resolves the plan once,
starts torch.distributed, seeds, and builds the mesh. From then on only the plan is read: `compose()`
applies it to a model and returns the runner that the templates, or a user's own loop (`engine.backward`,
`engine.step`), drive. `get_args()` keeps the flags for user scripts.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import random
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rapidtrain.config import arguments, rules
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import DistributedSettings, Plan, RunContext
from rapidtrain.core.cpu_allocator import keep_freed_memory
from rapidtrain.core.launch_env import environment_problems
from rapidtrain.core.library_warnings import quiet_library_messages
from rapidtrain.core.metrics import Timers, tee_output
from rapidtrain.core.process import settle_collective_threads
from rapidtrain.core.shutdown import stop_rank_with_torchrun
from rapidtrain.data.loaders import ShardSettings
from rapidtrain.data.worker_start import start_worker_server
from rapidtrain.models.bert import BertModel
from rapidtrain.models.gpt import GPTModel
from rapidtrain.optim.lr_schedule import LRScheduler, lr_schedule_for
from rapidtrain.parallel.apply import parallelize
from rapidtrain.parallel.deepspeed import ensure_process_group, forget_process_groups, run_config
from rapidtrain.parallel.mesh import ParallelMesh, build_mesh
from rapidtrain.parallel.op_build import use_environment_build_tools
from rapidtrain.parallel.runner import Runner, StepOutcome
from rapidtrain.train.agreement import agree_on_configuration
from rapidtrain.train.own_loop import compose_own_loop, rebind_optimizer
from rapidtrain.train.step import StepContext, finish_step

_GLOBAL_ARGS: argparse.Namespace | None = None
_CURRENT_ENGINE: Engine | None = None  # the run's Engine, for Megatron's global-state API in user scripts


def get_args() -> argparse.Namespace:
    """The parsed flags, for user scripts (Rapidformer's `get_args`); internal code is handed its settings.

    Beside the flags it carries what Megatron's args carry once the model is known: `padded_vocab_size`.
    """
    if _GLOBAL_ARGS is None:
        raise RuntimeError("get_args() before the Engine parsed the flags: create Engine(...) first.")
    return _GLOBAL_ARGS


def current_engine() -> Engine:
    """The Engine of this run (the last one created), for `rapidtrain.mpu` and the other Megatron helpers."""
    if _CURRENT_ENGINE is None:
        raise RuntimeError("no Engine yet: create Engine(...) (RapidformerEngine) before using mpu / get_tokenizer.")
    return _CURRENT_ENGINE


def init_distributed(settings: DistributedSettings, device_type: str) -> None:
    """The default process group with the plan's backend per device type (NCCL for CUDA tensors, gloo for host
    ones such as the token count, as torchtitan does) and timeout; the device bound first."""
    global _GROUPS_STARTED
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    environment_problems()  # RANK < WORLD_SIZE, a master that resolves and a port to serve on: never a hang
    if device_type == "cuda":  # modulo: where each task sees one GPU, LOCAL_RANK may exceed the visible count
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    timeout = timedelta(minutes=settings.timeout_minutes)
    store = fresh_group_store(timeout)
    extra: dict[str, Any] = {}
    if store is not None:
        extra = {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(settings.backend, timeout=timeout, **extra)
    _GROUPS_STARTED += 1


def apply_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and cuDNN convolutions (the plan decides: --tf32 on CUDA only)."""
    if enabled:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # type: ignore[attr-defined]  # torch 2.9+, no stub


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


# The --user-script being run (rapidtrain/user_script.py sets it): its template classes may be built after runpy has
# put the process's own `__main__` back, so `__main__` alone would not name it.
USER_SCRIPT: str | None = None


def main_script() -> str | None:
    """The user's script: the --user-script being run, else the file run as `__main__` when it is not one of
    rapidtrain's own entry points (pretrain.py, ...)."""
    from pathlib import Path

    import __main__

    if USER_SCRIPT is not None:
        return USER_SCRIPT
    path = getattr(__main__, "__file__", None)
    if path is None or Path(__file__).resolve().parents[1] in Path(path).resolve().parents:
        return None
    return str(path)


def plan_for_built_model(plan: Plan, model: nn.Module) -> Plan:
    """The plan once the model exists: a model that is not a built-in GPT or BERT (a user script's own) replaces
    the built-in model's description and memory estimate, which the flags alone would have implied, so the plan
    and the checkpoints say what is really trained."""
    if isinstance(model, GPTModel | BertModel) or isinstance(getattr(model, "encoder", None), BertModel):
        return plan  # the built-in model itself, or the built-in BERT under a Megatron task's head (the plan says it)
    parameters = sum(p.numel() for p in model.parameters())
    return dataclasses.replace(plan, model=None, memory=None, estimate=None,
                               script_model=f"{type(model).__name__}, {parameters:,} parameters")


def built_summary(runner: Runner, mesh: ParallelMesh) -> dict[str, Any]:
    """What compose really built, in the Plan's words: the runner and the wrapper around the model, the optimizer
    class, the parameters' dtype and whether they are DTensors, and the mesh. Printed after compose, so a run's
    output shows that it did what its plan said (a test compares the two)."""
    parameters = list(runner.module.parameters())
    optimizer = getattr(runner.optimizer, "optimizer", runner.optimizer)  # DeepSpeed's ZeRO wraps the real one
    # Looked up, not imported: a run that built neither has not imported their modules, and importing
    # torch.distributed.optim only to ask would TorchScript-compile its functional optimizers (~0.45 s a process).
    oss = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    if oss is not None and isinstance(optimizer, oss):  # OSS: the local optimizer over this rank's shard
        optimizer = optimizer.optim
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in parameters})
    return {"runner": type(runner).__name__, "wrapper": type(runner.module).__name__,
            "optimizer": type(optimizer).__name__, "dtypes": dtypes,
            "dtensor": dtensor is not None and any(isinstance(p, dtensor) for p in parameters),
            "mesh": _mesh_sizes(mesh)}


def _mesh_sizes(mesh: ParallelMesh) -> dict[str, int]:
    """The device mesh's dimensions as torch built them (a single process has none)."""
    sizes: dict[str, int] = {}
    for device_mesh in (mesh.mesh, mesh.expert_mesh):
        if device_mesh is not None:
            sizes |= dict(zip(device_mesh.mesh_dim_names or (), device_mesh.mesh.shape, strict=True))
    return sizes


def shutdown_distributed() -> None:
    """Every rank reaches here, then the default process group is destroyed: its threads end while the ranks are
    alive, not while the interpreter shuts down (an undestroyed gloo group can abort the exit with "terminate called
    without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        forget_process_groups()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Engine:
    """What a run needs before its model exists: flags, the plan, process groups, seeds."""
    def __init__(
        self,
        extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
        argv: Sequence[str] | None = None,
        defaults: dict | None = None,
        args: argparse.Namespace | None = None,
        entry: str | None = None,
    ) -> None:
        global _GLOBAL_ARGS, _CURRENT_ENGINE
        self.args = args or arguments.parse_args(argv, extra_args_provider, defaults, entry=entry)
        self.context = RunContext.detect(self.args, script=main_script())
        rules.exit_on_conflicts(self.args, self.context)
        _GLOBAL_ARGS = self.args
        self.plan: Plan = from_args(self.args, self.context)
        quiet_library_messages(self.plan.logging.show_library_warnings)
        stop_rank_with_torchrun()  # torchrun gone (even SIGKILLed): SIGTERM, so this rank saves and exits
        self.warn_rank0(self.plan.warnings)
        if self.plan.layout.world_size > 1 and self.plan.data.num_workers > 0:
            start_worker_server()  # before the process group's threads exist (data/worker_start.py)
        use_environment_build_tools()  # before anything loads a DeepSpeed op (parallel/op_build.py)
        init_distributed(self.plan.distributed, self.context.device_type)
        agree_on_configuration(self.plan)  # one collective: a rank with other flags or data stops every rank here
        atexit.unregister(settle_collective_threads)  # once per process, however many Engines it creates
        atexit.register(settle_collective_threads)  # for a script's normal exit (core/process.py)
        apply_tf32(self.plan.switches.tf32)
        self.device = self._device()
        if self.device.type == "cpu" and self.plan.switches.cpu_allocator_tuning:
            keep_freed_memory()
        if self.device.type == "cpu" and self.plan.switches.cpu_threads:
            torch.set_num_threads(self.plan.switches.cpu_threads)  # the plan's "CPU threads" line says why
        seed_everything(self.plan.training.seed)
        self.mesh: ParallelMesh = build_mesh(self.plan.layout, self.context.device_type)
        self._runner: Runner | None = None  # set by compose()
        self.lr_scheduler: Any = None
        self.accumulation: Any = None  # an own loop's place in its global batch (own_loop.py)
        self._backward_losses: torch.Tensor | None = None  # an own loop's losses since the last step

        self.timers = Timers(self.device)  # the loop's, and user code's through rapidtrain.get_timers()
        self._tokenizer: Any = None
        _CURRENT_ENGINE = self
        self._megatron_args()
        if self.plan.logging.logging_path and (self.is_main_process or self.is_logging_rank):

            tee_output(self.plan.logging.logging_path)

    @property
    def runner(self) -> Runner:
        """The wrapped model and its optimizer, as `compose` built them."""
        if self._runner is None:
            raise RuntimeError("Engine.compose() has not run yet: there is no model to train")
        return self._runner

    def _megatron_args(self) -> None:
        """What Megatron's args carry once the run's layout is known, for user scripts (get_args())."""
        args, layout = self.args, self.plan.layout
        args.rank, args.world_size = self.rank, layout.world_size
        args.data_parallel_size = layout.data_parallel_size
        args.global_batch_size = self.plan.batches.global_batch_size
        if self.plan.model is not None:
            args.padded_vocab_size = self.plan.model.vocab_size
        args.train_iters = self.plan.training.train_iters  # --train-iters, or what --train-samples comes to
        args.deepspeed_configuration = None  # Megatron-DeepSpeed's: the config DeepSpeed runs with, if it runs
        if self.plan.switches.partitioning_engine == "deepspeed":

            args.deepspeed_configuration = run_config(self.plan)
            # DeepSpeed's communication layer up now, as Megatron-DeepSpeed's initialisation does: a script may
            # build its model inside deepspeed.zero.Init(mpu=mpu, ...) before the model is composed.
            ensure_process_group()

    @property
    def is_logging_rank(self) -> bool:
        """Megatron prints from the last pipeline stage; among its ranks, the first data-, context- and
        tensor-parallel."""
        mesh = self.mesh
        return (mesh.is_last_stage and mesh.data_parallel_rank == 0 and mesh.context_parallel_rank == 0
                and mesh.tensor_parallel_rank == 0)

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

    def warn_rank0(self, warnings: Sequence[str]) -> None:
        """Warnings of the plan, on standard error before anything is built (the plan is printed later)."""
        if int(os.environ.get("RANK", "0")) == 0:
            for warning in warnings:
                print(f"rapidtrain: warning: {warning}", file=sys.stderr, flush=True)

    def print_rank0(self, *message: Any) -> None:
        if self.is_main_process:
            print(*message, flush=True)

    def shard_settings(self) -> ShardSettings:
        """How this rank takes its share of a map-style dataset (the plan's data settings and the mesh)."""
        data = self.plan.data
        return ShardSettings(data.micro_batch_size, self.mesh.data_parallel_rank,
                             self.plan.layout.data_parallel_size, data.seed, data.num_workers,
                             data.pin_memory, self.mesh.group("dp"), data.keep_last)

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

        names = {id(p): n for n, p in model.named_parameters()} if optimizer is not None else {}
        if self.context.script or self.plan.model is not None:
            self.plan = plan_for_built_model(self.plan, model)
        self._runner = parallelize(model, self.plan, self.mesh, self.device, optimizer=optimizer,
                                  model_factory=model_factory)
        self.print_rank0(" built: " + json.dumps(built_summary(self.runner, self.mesh)))
        if optimizer is not None and self.runner.optimizer is optimizer:  # the user's, over the wrapped parameters

            rebind_optimizer(optimizer, names, self.runner.module)
        if train_dataloader is not None or eval_dataloader is not None:  # a user's own loop

            return compose_own_loop(self, train_dataloader, eval_dataloader, lr_scheduler_fn)
        self.lr_scheduler = self.build_scheduler(self.runner.optimizer, lr_scheduler_fn)
        return self.runner.module, self.runner.optimizer, self.lr_scheduler, train_dataloader, eval_dataloader

    def build_scheduler(self, optimizer: torch.optim.Optimizer, lr_scheduler_fn: Callable | None,
                        steps_per_epoch: int | None = None) -> Any:
        if lr_scheduler_fn is not None:
            # DeepSpeed's ZeRO optimizer is no torch Optimizer, which torch schedulers refuse; its inner one
            # holds the same param_groups.
            if not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = getattr(optimizer, "optimizer", optimizer)
            return lr_scheduler_fn(optimizer)

        schedule = self.plan.schedule
        if steps_per_epoch is not None:  # fine-tuning: the length is known only now; clamp a warm-up past it
            schedule = self._warmup_within(schedule, self.total_iterations(steps_per_epoch))
        settings = lr_schedule_for(schedule, self.plan.batches.global_batch_size,
                                   self.total_iterations(steps_per_epoch))
        return LRScheduler(optimizer, settings)

    def _warmup_within(self, schedule: Any, iterations: int) -> Any:
        """A warm-up of --lr-warmup-iters that does not end before an epoch-based run's decay horizon is
        shortened to one iteration less than the horizon (the peak --lr is then reached), with a warning: the
        number of iterations follows from the data, which the flags could not know."""
        horizon = schedule.decay_iters or iterations
        if schedule.warmup_fraction is not None or schedule.warmup_iters < horizon or horizon < 2:
            return schedule
        self.print_rank0(f" warning: --lr-warmup-iters {schedule.warmup_iters} is not shorter than this run's "
                         f"{horizon} iterations ({'--lr-decay-iters' if schedule.decay_iters else 'its epochs'}); "
                         f"the warm-up is shortened to {horizon - 1} iterations so that --lr is reached. Give a "
                         "smaller --lr-warmup-iters or --lr-warmup-fraction to choose it yourself.")
        return dataclasses.replace(schedule, warmup_iters=horizon - 1)

    def total_iterations(self, steps_per_epoch: int | None = None) -> int:
        training = self.plan.training
        if training.train_iters is not None:
            return training.train_iters
        if steps_per_epoch is None:
            return 0
        return steps_per_epoch * (training.epochs or 1)

    # ---- one iteration ----

    def backward(self, loss: torch.Tensor) -> None:
        """Use instead of `loss.backward()`: applies loss scaling / the DeepSpeed engine's backward."""
        if self.accumulation is not None:  # an own loop: the mean over the global batch's micro-batches
            loss = self.accumulation.scale(loss)
        detached = loss.detach().reshape(()).double()
        self._backward_losses = detached if self._backward_losses is None else self._backward_losses + detached
        self.runner.backward(loss)

    def step_context(self) -> StepContext:
        """What `train.step` needs of this run: the runner, the data-parallel group, the schedule, the timers."""
        plan = self.plan
        # Losses and token counts are reduced over data × context ranks (each context rank has its part of the
        # sequence); the samples are the data ranks'.
        return StepContext(self.runner, self.device, self.mesh.gradient_group(), plan.layout.data_parallel_size,
                           plan.data.micro_batch_size, plan.batches.global_batch_size, self.lr_scheduler,
                           self.timers if plan.logging.timers_to_tensorboard else None,
                           per_token_loss=plan.training.per_token_loss,
                           context_parallel_size=plan.layout.context_parallel_size)

    def step(self) -> StepOutcome:
        """An own loop's optimizer step: clip, step (skipped on fp16 overflow) and advance the schedule by one
        global batch; mid global batch it does nothing (gradients keep accumulating)."""
        if self.accumulation is not None and not self.accumulation.is_last:
            return StepOutcome(None)
        losses, self._backward_losses = self._backward_losses, None
        return finish_step(self.step_context(), losses).outcome

    def all_reduce_data_parallel(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over the data × context ranks: a loss or count of context-parallel ranks is of its part of the
        sequence (Megatron reduces losses over its dp_cp group likewise)."""
        group = self.mesh.gradient_group()
        if group is not None:
            dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def all_reduce_pipeline(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over the pipeline stages holding this rank's data- and tensor-parallel coordinates."""
        group = self.mesh.group("pp")
        if group is not None:
            dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def shutdown(self) -> None:
        shutdown_distributed()


RapidformerEngine = Engine
