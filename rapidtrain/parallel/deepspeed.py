"""DeepSpeed ZeRO stages 1-3 (and ZeRO-Offload) behind the runner interface the trainer uses.

`deepspeed_config` turns the plan into DeepSpeed's configuration; `deepspeed_runner` calls
`deepspeed.initialize` and returns a `DeepSpeedRunner`. Checkpoint state is the same
torch.distributed.checkpoint layout every other mode writes (full fp32 weights and per-parameter
optimizer state keyed by parameter name), so a ZeRO checkpoint loads under DDP, FSDP or another stage
and world size, and the other way round (see `parallel/deepspeed_state.py`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rapidtrain.config.resolve import read_user_config
from rapidtrain.config.settings import Plan, Precision, ZeroSettings
from rapidtrain.core.errors import UserError
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.transformer import canonical_name
from rapidtrain.optim.grad_scaler import LossScaleSettings
from rapidtrain.optim.optimizers import OFFLOAD_OPTIMIZERS, OptimizerSettings, build_optimizer, param_groups
from rapidtrain.parallel.deepspeed_state import ZeroState
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.runner import (
    EvalTotals,
    LossTotal,
    StepOutcome,
    autocast,
    evaluate_micro_batches,
    run_micro_batches,
)


def zero_stage_of(plan: Plan) -> int:
    partitioning = plan.switches.partitioning
    if not partitioning.startswith("zero-"):
        raise ValueError(f"the plan partitions with {partitioning!r}, not a DeepSpeed ZeRO stage")
    return int(partitioning.removeprefix("zero-"))


def deepspeed_config(
    plan: Plan, optimizer_settings: OptimizerSettings, clip_grad: float, loss_scale: LossScaleSettings
) -> dict[str, Any]:
    """DeepSpeed's configuration for the plan: batch arithmetic, clipping, ZeRO stage and its communication
    settings, precision, offload.

    Without an optimizer offload the optimizer is rapidtrain's (passed to `deepspeed.initialize`); with one
    (--cpu-offload, --nvme-offload-dir) the config names Adam/AdamW so that DeepSpeed builds DeepSpeedCPUAdam next
    to the offloaded state.
    """
    batches = plan.batches
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batches.micro_batch_size,
        "gradient_accumulation_steps": batches.accumulation_steps,
        "train_batch_size": batches.micro_batch_size
        * batches.accumulation_steps
        * plan.layout.data_parallel_size,
        "gradient_clipping": float(clip_grad),
        "zero_optimization": zero_optimization_config(zero_settings_of(plan)),
        # Which optimizers may run under ZeRO is decided by rapidtrain's conflict table (elementwise ones).
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
    }
    config.update(precision_config(plan.precision, loss_scale))
    if plan.layout.context_parallel_size > 1:
        # DeepSpeed's batch check counts world / sequence_parallel_size data ranks (Megatron-DeepSpeed's Ulysses
        # config); its gradients are still averaged over every rank, data × context (no mpu is given).
        config["sequence_parallel_size"] = plan.layout.context_parallel_size
    if optimizer_offloaded(plan):
        config["optimizer"] = offload_optimizer_config(optimizer_settings)
    if zero_settings_of(plan).nvme_path:
        config["aio"] = AIO_CONFIG
    return config


# DeepSpeed's documented async I/O defaults, written out so the generated config says what runs.
AIO_CONFIG = {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
              "overlap_events": True}


def zero_settings_of(plan: Plan) -> ZeroSettings:
    """The plan's ZeRO settings (plans built without them, as in older callers, get the defaults)."""
    return plan.zero or ZeroSettings(stage=zero_stage_of(plan), offload_optimizer="cpu" if plan.switches.cpu_offload
                                     else "none")


def optimizer_offloaded(plan: Plan) -> bool:
    """Whether DeepSpeed builds DeepSpeedCPUAdam from the config (optimizer state on the CPU or NVMe)."""
    return zero_settings_of(plan).offload_optimizer != "none"


def zero_optimization_config(zero: ZeroSettings) -> dict[str, Any]:
    """DeepSpeed's `zero_optimization` section: stage, overlap, buckets, stage-3 fetching, offload targets."""
    section: dict[str, Any] = {
        "stage": zero.stage,
        "overlap_comm": zero.overlap_comm,
        "contiguous_gradients": zero.contiguous_gradients,
        "reduce_bucket_size": zero.reduce_bucket_size,
    }
    if zero.stage == 3:
        section.update(stage3_prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
                       stage3_param_persistence_threshold=zero.stage3_param_persistence_threshold,
                       stage3_max_live_parameters=zero.stage3_max_live_parameters)
    else:
        section["allgather_bucket_size"] = zero.allgather_bucket_size
    for key, target in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_params)):
        if target != "none":
            section[key] = {"device": target, "pin_memory": zero.pin_memory}
            if target == "nvme":
                section[key]["nvme_path"] = zero.nvme_path
    if zero.offload_params == "nvme":
        # DeepSpeed keeps up to max_in_cpu elements of NVMe-offloaded parameters in host memory (1e9 by default:
        # every model under a billion parameters would never touch the disk); 0 sends them all to NVMe.
        section["offload_param"]["max_in_cpu"] = 0
    return section


def size_nvme_buffers(config: dict[str, Any], model: nn.Module, world_size: int = 1) -> None:
    """ZeRO-Infinity reads parameter shards back from NVMe through `buffer_count` buffers of `buffer_size`
    elements. Each buffer must hold the largest parameter (DeepSpeed's 1e8-element default pins 2 GB per buffer),
    and there must be one per shard in flight: the prefetch window (stage3_prefetch_bucket_size) plus the layer
    being computed, and never more than the shards that are swapped at all (those of at least one I/O block)."""
    zero = config["zero_optimization"]
    offload = zero.get("offload_param", {})
    if offload.get("device") != "nvme":
        return
    sizes = [p.numel() for p in model.parameters()]
    largest = max(max(sizes, default=1), NVME_MIN_BUFFER)
    block = config.get("aio", AIO_CONFIG)["block_size"] // 4  # fp32 elements of one I/O block
    swapped = sum(1 for n in sizes if math.ceil(n / world_size) >= block)
    window = math.ceil(zero.get("stage3_prefetch_bucket_size", 0) / largest) + 2
    offload["buffer_size"] = largest
    offload["buffer_count"] = max(min(max(swapped, 1), max(NVME_MIN_BUFFERS, window)), 1)


NVME_MIN_BUFFERS = 5  # DeepSpeed's default buffer_count
NVME_MIN_BUFFER = 1 << 16  # elements; DeepSpeed aligns swap buffers to its I/O block size


def precision_config(precision: Precision, loss_scale: LossScaleSettings) -> dict[str, Any]:
    """DeepSpeed's own bf16/fp16 modes (16-bit weights, fp32 master weights in the optimizer)."""
    if precision.dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if precision.dtype == "fp16":
        s = loss_scale
        initial_power = max(round(math.log2(s.initial_loss_scale)), 0)
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": float(s.loss_scale or 0.0),  # 0 = dynamic
                "initial_scale_power": initial_power,
                "loss_scale_window": s.loss_scale_window,
                "hysteresis": s.hysteresis,
                "min_loss_scale": s.min_loss_scale,
                "consecutive_hysteresis": False,
            }
        }
    return {}


def offload_optimizer_config(settings: OptimizerSettings) -> dict[str, Any]:
    if settings.name not in OFFLOAD_OPTIMIZERS:
        raise ValueError(
            f"--cpu-offload runs DeepSpeedCPUAdam; --optimizer {settings.name} cannot be offloaded. "
            "Use --optimizers apex_adam (AdamW), --optimizer adamw or adam, or drop --cpu-offload."
        )
    kind, decoupled = OFFLOAD_OPTIMIZERS[settings.name]
    return {
        "type": kind,
        "params": {
            "lr": settings.lr,
            "betas": [settings.adam_beta1, settings.adam_beta2],
            "eps": settings.adam_eps,
            "weight_decay": settings.weight_decay,
            "adam_w_mode": decoupled,
        },
    }


# ---- building the engine ----


def ensure_process_group() -> None:
    """DeepSpeed needs torch.distributed; a single process started without torchrun gets a one-rank group.

    DeepSpeed's own communication layer then wraps that group (zero.Init reads its world size from it).
    """
    import deepspeed

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)  # DeepSpeed reads torchrun's variables
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)


# DeepSpeed's module-level caches of the groups it made (deepspeed.utils.groups) and its communication backend.
_DEEPSPEED_GROUP_CACHES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                           "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")
_DEEPSPEED_GROUPS = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mesh_device", "_TENSOR_MODEL_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                     "_MPU_TENSOR_MODEL_PARALLEL_RANK")


def forget_process_groups() -> None:
    """After the default group is destroyed, DeepSpeed still holds the groups it cloned from it; a second run in
    this process (a script that trains twice, the launch-script tests) would hand those dead groups to ZeRO
    ("Group ... is not registered"). Back to their import-time values, as in a fresh process."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return  # DeepSpeed never ran here
    for name in _DEEPSPEED_GROUP_CACHES:
        if hasattr(groups, name):
            setattr(groups, name, {})
    for name in _DEEPSPEED_GROUPS:
        if hasattr(groups, name):
            setattr(groups, name, None)
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        setattr(comm, "cdb", None)  # its communication backend, bound to the destroyed group  # noqa: B010


def build_partitioned(
    model: nn.Module,
    model_factory: Callable[[], nn.Module],
    config: dict[str, Any],
    prepare: Callable[[nn.Module], nn.Module],
    seed: int | None = None,
) -> nn.Module:
    """ZeRO-3: build the model again under `deepspeed.zero.Init` (each parameter partitioned as it is
    created) and give it the initial values of every other layout: `model`'s, or, when `model` was built on
    the meta device (nothing to copy: no rank ever held it whole), the built-in models' values by (`seed`, name),
    one parameter gathered at a time."""
    import deepspeed

    # The factory's own initialisation must not advance the global RNG (data order, dropout).
    with torch.random.fork_rng(devices=[]), deepspeed.zero.Init(config_dict_or_path=config):
        partitioned = model_factory()
    undo_skip_init_patch()
    partitioned = prepare(partitioned)
    if any(p.is_meta for p in model.parameters()):
        assert seed is not None, "a model built on meta is initialised from the plan's seed"
        initialise_partitioned(partitioned, seed)
        return partitioned
    source = {canonical_name(n): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in partitioned.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(source[canonical_name(name)].data)
        buffers = {canonical_name(n): b for n, b in model.named_buffers()}
        for name, buffer in partitioned.named_buffers():
            buffer.copy_(buffers[canonical_name(name)])
    return partitioned


def initialise_partitioned(model: nn.Module, seed: int) -> None:
    """The built-in initialisation on a ZeRO-3 model: each parameter gathered whole (one at a time), drawn by
    (seed, name) on rank 0 and scattered back into every rank's partition."""
    import deepspeed

    from rapidtrain.models.transformer import canonical_parameters, initial_value

    # The built-in models keep their ModelConfig as .config (nn.Module's __getattr__ types it Tensor | Module).
    config = cast(ModelConfig, model.config)
    rank = dist.get_rank()
    with torch.no_grad():
        for name, module, param in canonical_parameters(model):
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    param.data.copy_(initial_value(name, module, param.shape, config, seed))


def undo_skip_init_patch() -> None:
    """Undo what zero.Init leaves behind when a module is created with `device="meta"` inside it.

    DeepSpeed takes that for torch's `skip_init` and wraps `Module._apply` until the module's `to_empty`
    runs, so every later `.to()` / `.float()` in the process would turn parameters into ZeRO-3 ones. The
    built-in tied output layer builds its placeholder weight on meta (it is replaced at once), which is
    not skip_init: restore the methods as DeepSpeed's own `to_empty` hook would.
    """
    classes, pending = [], [nn.Module]
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending.extend(cls.__subclasses__())
    for cls in classes:
        if "_apply" in cls.__dict__ and hasattr(cls, "_old_apply_of_skip_init_hook"):
            # Putting back the method DeepSpeed's hook replaced is the point, so mypy's method-assign is moot.
            cls._apply = cls._old_apply_of_skip_init_hook  # type: ignore[method-assign]


def prepare_model(module: nn.Module, plan: Plan, mesh: ParallelMesh) -> nn.Module:
    """The transforms every layout applies before data-parallel wrapping (no tensor parallelism here)."""
    from rapidtrain.parallel.transforms import apply_transforms

    return apply_transforms(module, plan, mesh)


def client_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    settings: OptimizerSettings,
    plan: Plan,
    device: torch.device,
) -> tuple[torch.optim.Optimizer | None, list[dict[str, Any]]]:
    """(the optimizer to hand to DeepSpeed, or None for the config's DeepSpeedCPUAdam; its parameter groups).

    The groups are Megatron's (no weight decay on biases and norms) unless the caller brought an optimizer.
    """
    if optimizer is not None:
        if optimizer_offloaded(plan):
            raise ValueError(
                "--cpu-offload / --nvme-offload-dir build DeepSpeedCPUAdam from the flags, so an optimizer passed to "
                "Engine.compose cannot be offloaded: leave `optimizer` out, or drop the offload flag."
            )
        return optimizer, [dict(group) for group in optimizer.param_groups]  # before DeepSpeed flattens them
    groups = param_groups(model, settings.weight_decay, settings.decoupled)
    if optimizer_offloaded(plan):
        return None, groups
    return build_optimizer(groups, settings, device.type)[0], groups


def deepspeed_runner(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    device: torch.device,
    *,
    optimizer: torch.optim.Optimizer | None,
    model_factory: Callable[[], nn.Module] | None = None,
) -> DeepSpeedRunner:
    """`deepspeed.initialize` with the generated config; returns the runner the trainer drives.

    `mesh` is not consulted: DeepSpeed serves ZeRO only without tensor/pipeline/expert parallelism, so its
    data-parallel group is the world, which DeepSpeed uses by default.
    """
    import deepspeed

    from rapidtrain.parallel.op_build import announce_op_builds, clear_stale_op_build_locks, use_environment_build_tools

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # keep Megatron's log lines readable
    use_environment_build_tools()  # the ninja and folder that built the ops check them (others would rebuild them)
    clear_stale_op_build_locks()  # a killed first build of cpu_adam / shm_comm would make DeepSpeed wait for ever
    announce_op_builds(["deepspeed_shm_comm"] * (device.type == "cpu") + ["cpu_adam"] * optimizer_offloaded(plan))
    ensure_process_group()
    if plan.layout.data_context_parallel_size != dist.get_world_size():
        raise ValueError(
            f"DeepSpeed ZeRO runs data parallel over all {dist.get_world_size()} ranks, but the plan "
            f"has data × context parallel size {plan.layout.data_context_parallel_size}"
        )
    optimizer_settings = plan.optimizer
    assert optimizer_settings is not None and plan.loss_scale is not None
    config = run_config(plan)  # generated from the flags, --deepspeed_config merged in
    size_nvme_buffers(config, model, dist.get_world_size())
    threads = zero_settings_of(plan).cpu_adam_threads
    if threads:
        use_cpu_threads(threads)
    prepare = functools.partial(prepare_model, plan=plan, mesh=mesh)
    if zero_stage_of(plan) == 3 and model_factory is not None and optimizer is None:
        model = build_partitioned(model, model_factory, config, prepare, seed=plan.training.seed)
    else:
        model = prepare(model)
    optimizer, groups = client_optimizer(model, optimizer, optimizer_settings, plan, device)
    # Read before DeepSpeed points its optimizer's groups (these very dicts under --cpu-offload) at flat partitions.
    trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=config,
        dist_init_required=False,
        model_parameters=groups if optimizer is None else None,
    )
    return DeepSpeedRunner(
        engine=engine,
        precision=plan.precision,
        device_type=device.type,
        gradient_average=plan.layout.data_context_parallel_size,  # context ranks reduce gradients with the data ranks
        checkpoint_state=ZeroState(engine, [g for g in trainable if g]),
    )


def parameter_residency(module: nn.Module, offload_params: str = "none") -> dict[str, int]:
    """This rank's parameter bytes by where they live now: full values in the module's own tensors on the
    device (ZeRO-3's persistent small parameters, or every parameter below stage 3), ZeRO-3 shards on the device,
    shards offloaded to host memory (--cpu-offload-params, or NVMe-offloaded ones held in host buffers) and shards
    swapped out to --nvme-offload-dir. A CPU-only machine's device and host memory are the same RAM: there the
    split follows DeepSpeed's configuration (`offload_params`), not a physical place."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    residency = {"gathered on device": 0, "shard on device": 0, "shard in host memory": 0, "shard on nvme": 0}
    for param in module.parameters():
        residency["gathered on device"] += param.data.numel() * param.element_size()
        shard = getattr(param, "ds_tensor", None)
        if shard is None:
            continue
        swapped = (getattr(shard, "final_location", None) == OffloadDeviceEnum.nvme
                   and shard.status == PartitionedParamStatus.NOT_AVAILABLE)
        if swapped:
            # shard: a placeholder. partition_numel is DeepSpeed's, added to a ZeRO-3 parameter.
            residency["shard on nvme"] += cast(Any, param).partition_numel() * param.element_size()
        else:
            where = "shard in host memory" if offload_params != "none" else "shard on device"
            residency[where] += shard.numel() * shard.element_size()
    return residency


def use_cpu_threads(threads: int) -> None:
    """Give DeepSpeedCPUAdam its threads. Its step is an OpenMP loop that reads OMP_NUM_THREADS when the
    runtime starts (DeepSpeed's own launcher sets it to the cores per rank; torchrun sets 1): set it before the op
    loads, and set torch's count too, which also drives a runtime torch shares with the op."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


class DeepSpeedRunner:
    """A DeepSpeed engine with TorchRunner's methods (`parallel/runner.py`).

    `module` is the engine itself (its forward gathers ZeRO-3 parameters); `optimizer` is DeepSpeed's
    ZeRO optimizer, whose `param_groups` are the real optimizer's, so rapidtrain's schedule sets the rate
    that is used. DeepSpeed's own scheduler is never configured. DeepSpeed checks fp16 overflow itself
    (and skips the step on every rank), so `unscale_gradients` has no flag to add.
    """

    def __init__(
        self,
        engine: Any,
        precision: Precision,
        device_type: str,
        gradient_average: int,
        checkpoint_state: Any,
    ) -> None:
        self.engine = engine
        self.module = engine
        self.optimizer = engine.optimizer
        self.precision = precision
        self.device_type = device_type
        # DeepSpeed averages gradients over the data-parallel ranks, as DDP does.
        self.gradient_average = gradient_average
        self.checkpoint_state = checkpoint_state

    @contextlib.contextmanager
    def micro_batch(self, is_last: bool) -> Iterator[None]:
        """Gradients are reduced (ZeRO-1) or the step armed only on the last micro-batch of a global batch."""
        self.engine.set_gradient_accumulation_boundary(is_last)
        # DeepSpeed's bf16/fp16 mode runs 16-bit weights; autocast on top keeps norms, softmax and the loss in
        # fp32 as the torch path computes them.
        with autocast(self.precision, self.device_type):
            yield

    def forward_backward(self, micro_batches: list[Any], forward_step: Callable,
                         global_tokens: torch.Tensor | int | None) -> LossTotal:
        return run_micro_batches(self, micro_batches, forward_step, global_tokens)

    def evaluate(self, micro_batches: list[Any], forward_step: Callable) -> EvalTotals:
        return evaluate_micro_batches(self, micro_batches, forward_step)

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer already normalised the loss over the global batch; DeepSpeed must not divide by the
        # accumulation steps again (its default), only apply its loss scale.
        self.engine.backward(loss, scale_wrt_gas=False)

    def unscale_gradients(self) -> torch.Tensor | None:
        return None

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def step(self, skip: bool = False) -> StepOutcome:
        """DeepSpeed's step (it unscales, checks overflow, clips); `skip` (a non-finite loss elsewhere) is
        DeepSpeed's own decision under fp16, and stops the run before this call otherwise."""
        self.engine.step()
        if not self.engine.was_step_applied():
            return StepOutcome(None, skipped=True)
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return StepOutcome(None)
        # A copy: ZeRO-3 keeps its norm in a buffer the next step overwrites, and the loop reads it later.
        return StepOutcome(norm.detach().clone() if torch.is_tensor(norm) else torch.tensor(float(norm)))

    def params_norm(self) -> torch.Tensor:
        """The L2 norm of the parameters (--log-params-norm); ZeRO-3's partitions summed over the ranks."""
        from rapidtrain.parallel.runner import squared_norm

        parameters = [p for p in self.engine.module.parameters() if p.requires_grad]
        if hasattr(parameters[0], "ds_tensor") if parameters else False:
            squared = squared_norm([p.ds_tensor.detach() for p in parameters]).to(parameters[0].ds_tensor.device)
            dist.all_reduce(squared)
        else:
            squared = squared_norm([p.detach() for p in parameters])
        return squared.sqrt()

    @property
    def skips_nonfinite(self) -> bool:
        return self.precision.loss_scaling != "none"

    @property
    def loss_scale(self) -> float:
        return float(getattr(self.optimizer, "loss_scale", 1.0)) if self.skips_nonfinite else 1.0

    @property
    def backward_scale(self) -> float:
        """What `backward` multiplies a loss by: DeepSpeed's loss scale."""
        return self.loss_scale

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    # ---- checkpoint state (torch.distributed.checkpoint, reshardable, same layout as TorchRunner) ----
    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint_state.state_dict()

    def state_dict_for_loading(self, load_optimizer: bool) -> dict[str, Any]:
        return self.checkpoint_state.template(load_optimizer)

    def optimizer_stepped(self) -> bool:
        return self.checkpoint_state.optimizer_stepped()

    def forget_optimizer_state(self) -> None:
        self.checkpoint_state.forget_optimizer_state()

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None:
        self.checkpoint_state.load(state, load_optimizer)


# ---- --deepspeed_config FILE (Megatron-DeepSpeed's habit): the user's JSON merged with the generated config ----

# Keys rapidtrain sets only for quiet, permissive defaults, or from the device rather than a flag (pinned offload
# buffers on CUDA only: a config written for GPUs pins them, and DeepSpeed's CPU accelerator leaves tensors as they
# are): a user's value replaces them.
_OVERRIDABLE = ("wall_clock_breakdown", "zero_allow_untested_optimizer",
                "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory")
# Where each generated key comes from, for the conflict message.
_FLAG_OF_KEY = {
    "train_batch_size": "--global-batch-size", "train_micro_batch_size_per_gpu": "--micro-batch-size",
    "gradient_accumulation_steps": "--global-batch-size / --micro-batch-size", "gradient_clipping": "--clip-grad",
    "zero_optimization.stage": "--zero-N-memory-optimization", "bf16": "--bf16 / --mixed-precision",
    "fp16": "--fp16 / --loss-scale flags", "optimizer": "--cpu-offload / --optimizers",
    "zero_optimization.offload_optimizer": "--cpu-offload",
    **{f"zero_optimization.{key}": "--zero-" + key.replace("_", "-") for key in (
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters")},
    "zero_optimization.overlap_comm": "--no-zero-overlap-comm",
    "zero_optimization.contiguous_gradients": "--no-zero-contiguous-gradients",
}


class DeepSpeedConfigConflict(UserError, ValueError):
    """--deepspeed_config sets something the flags set otherwise."""


def merge_user_config(user: dict[str, Any], generated: dict[str, Any], path: str,
                      defaulted: tuple[str, ...] = ()) -> dict[str, Any]:
    """The generated config with the keys only the user's JSON sets added (nested objects merged); a key both
    set must agree, but for `defaulted` ones (dotted names no flag set: the JSON's value wins). The schedule and a
    client optimizer are rapidtrain's: the JSON may not configure them."""
    conflicts: list[str] = []
    owners = {"scheduler": "the learning-rate schedule from --lr / --lr-decay-style",
              "optimizer": "the optimizer from --optimizers"}
    for owned, what in owners.items():
        if owned in user and not (owned == "optimizer" and "optimizer" in generated):
            conflicts.append(f"{owned}: --deepspeed_config sets one, but rapidtrain builds {what}")
    for precision in ("fp16", "bf16"):
        wanted = bool((user.get(precision) or {}).get("enabled", False))
        have = bool((generated.get(precision) or {}).get("enabled", False))
        if precision in user and wanted != have:
            conflicts.append(f"{precision}.enabled: --deepspeed_config {str(wanted).lower()}, the flags "
                             f"{str(have).lower()} ({_FLAG_OF_KEY[precision]})")
    merged = _merge(user, generated, "", conflicts, frozenset(defaulted))
    if conflicts:
        raise DeepSpeedConfigConflict(
            f"--deepspeed_config {path} contradicts the flags: " + "; ".join(conflicts)
            + ". Remove those keys from the file (the flags set them) or change the flags to match.")
    return merged


def _merge(user: dict[str, Any], generated: dict[str, Any], prefix: str, conflicts: list[str],
           defaulted: frozenset[str] = frozenset()) -> dict[str, Any]:
    merged = dict(generated)
    for key, value in user.items():
        name = f"{prefix}{key}"
        if (key not in generated or name in _OVERRIDABLE or name in defaulted
                or key in ("fp16", "bf16") and not generated.get(key)):
            merged[key] = value
        elif isinstance(value, dict) and isinstance(generated[key], dict):
            merged[key] = _merge(value, generated[key], f"{name}.", conflicts, defaulted)
        elif value != generated[key]:
            flag = _FLAG_OF_KEY.get(name, "the flags")
            conflicts.append(f"{name}: --deepspeed_config {value!r}, the flags {generated[key]!r} ({flag})")
    return merged


def run_config(plan: Plan) -> dict[str, Any]:
    """The config DeepSpeed runs with: generated from the plan, with --deepspeed_config merged in."""
    assert plan.optimizer is not None and plan.loss_scale is not None
    config = deepspeed_config(plan, plan.optimizer, plan.clip_grad, plan.loss_scale)
    path = plan.switches.deepspeed_config_file
    if path:
        try:
            user = read_user_config(path)
        except ValueError as error:
            raise DeepSpeedConfigConflict(str(error)) from None
        defaulted = tuple(f"zero_optimization.{key}" for key in (plan.zero.defaulted if plan.zero else ()))
        config = merge_user_config(user, config, path, defaulted)
    return config
