"""Apply the plan to a model, in a fixed order: tensor parallel → activation checkpointing → compile →
data-parallel wrapping (DDP, ZeroRedundancyOptimizer, FSDP2, or the DeepSpeed engine).

Each step is a free function that knows one engine; `parallelize` calls them as the plan says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rapidtrain.optim.grad_scaler import LossScaler, LossScaleSettings
from rapidtrain.optim.optimizers import OptimizerSettings, build_optimizer
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.runner import TorchRunner
from rapidtrain.plan import Plan


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the built-in models' `layers`, or a Hugging Face model's largest ModuleList."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not candidates:
        return []
    return list(max(candidates, key=lambda m: sum(p.numel() for p in m.parameters())))


def _replace_blocks(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> None:
    blocks = set(map(id, transformer_blocks(model)))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in blocks:
                setattr(parent, name, wrap(child)) if not isinstance(parent, nn.ModuleDict) else parent.update(
                    {name: wrap(child)})


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (torch.utils.checkpoint, non-reentrant)."""
    if hasattr(model, "gradient_checkpointing_enable"):  # Hugging Face models know their own blocks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # The wrapper's prefix is stripped by torch.distributed.checkpoint, so checkpoints keep their names.
    _replace_blocks(model, checkpoint_wrapper)


def apply_compile(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> None:
    """torch.compile each block in place (module.compile keeps parameter names for checkpoints), with the
    plan's backend and mode (--torch-compile-backend, --torch-compile-mode)."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(backend=backend, mode=mode)
    if not blocks:
        model.compile(backend=backend, mode=mode)


def apply_ddp(model: nn.Module, mesh: ParallelMesh, device: torch.device) -> nn.Module:
    group = mesh.group("dp")
    if group is None:
        return model
    if mesh.layout.tensor_parallel_size > 1:  # DDP cannot reduce DTensor parameters
        return apply_replicate(model, mesh)
    device_ids = [device.index] if device.type == "cuda" else None
    from rapidtrain.parallel.experts import exclude_experts_from_ddp

    exclude_experts_from_ddp(model)  # sharded experts are reduced over their own group (parallel/experts.py)
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group)


def apply_replicate(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Data parallelism in 3D: composable `replicate` (FSDP2's machinery, so tensor-parallel DTensor
    parameters become 2D dp × tp DTensors) over the dp mesh dimension; gradients averaged after backward.
    Sharded experts are left out: they are reduced over their own group (parallel/experts.py)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    from rapidtrain.parallel.experts import expert_parameters, place_experts_on_mesh_of_others

    replicate(model, mesh=mesh.submesh("dp"), ignored_params=set(expert_parameters(model).values()) or None)
    place_experts_on_mesh_of_others(model)  # one mesh for all parameters: foreach clipping/optimizers need it
    return model


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, reshard_after_forward: bool) -> nn.Module:
    """FSDP2 over the data-parallel dimension: each block a unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.submesh("dp")
    for block in transformer_blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def parallelize(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    device: torch.device,
    *,
    optimizer: torch.optim.Optimizer | None,
    optimizer_settings: OptimizerSettings,
    clip_grad: float,
    loss_scale: LossScaleSettings,
    model_factory: Callable[[], nn.Module] | None = None,
):
    """Wrap `model` as the plan says and return its runner (TorchRunner or DeepSpeedRunner)."""
    switches = plan.switches
    if switches.partitioning_engine == "deepspeed":
        from rapidtrain.parallel.deepspeed import deepspeed_runner

        return deepspeed_runner(model, plan, mesh, device, optimizer=optimizer,
                                optimizer_settings=optimizer_settings, clip_grad=clip_grad,
                                loss_scale=loss_scale, model_factory=model_factory)
    if plan.layout.expert_parallel_size > 1:
        from rapidtrain.parallel.experts import apply_expert_parallel

        # Before tensor parallelism, which then replicates each rank's expert slice over its TP ranks.
        apply_expert_parallel(model, mesh, plan.layout.expert_parallel_size)
    if plan.layout.pipeline_parallel_size > 1:  # split first; each stage then goes through the same order
        from rapidtrain.parallel.pipeline import pipeline_runner

        return pipeline_runner(model, plan, mesh, device, optimizer=optimizer, optimizer_settings=optimizer_settings,
                               clip_grad=clip_grad, loss_scale=loss_scale)
    if plan.layout.tensor_parallel_size > 1:
        from rapidtrain.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh.submesh("tp"), sequence_parallel=plan.layout.sequence_parallel)
    if switches.activation_checkpointing:
        apply_activation_checkpointing(model)
    if switches.compile != "none":
        from rapidtrain.parallel.compile import apply_graph_optimization

        model = apply_graph_optimization(model, switches)
    model.to(device)
    gradient_average = plan.layout.data_parallel_size
    if switches.partitioning_engine == "fsdp2":
        reshard = switches.partitioning == "fsdp"
        model = apply_fsdp(model, mesh, reshard_after_forward=reshard) if mesh.group("dp") else model
    elif switches.partitioning_engine == "fairscale":
        from rapidtrain.parallel.fairscale_backend import fairscale_runner

        return fairscale_runner(model, plan, mesh, device, optimizer_settings, clip_grad, optimizer=optimizer,
                                loss_scale=loss_scale)
    else:
        model = apply_ddp(model, mesh, device)
    runner_class = TorchRunner
    if switches.partitioning_engine == "zero-redundancy" and mesh.group("dp") is not None:
        from rapidtrain.parallel.zero_redundancy import OSSRunner, oss_from_optimizer, oss_optimizer

        runner_class = OSSRunner
        optimizer = (oss_optimizer(model, optimizer_settings, device.type, mesh) if optimizer is None
                     else oss_from_optimizer(optimizer, mesh))
    elif optimizer is None:
        optimizer, _ = build_optimizer(model, optimizer_settings, device.type)
    scaler = LossScaler(loss_scale) if plan.precision.loss_scaling != "none" else None
    runner = runner_class(module=model, optimizer=optimizer, precision=plan.precision, device_type=device.type,
                          clip_grad=clip_grad, gradient_average=gradient_average if mesh.group("dp") else 1,
                          pipeline_group=mesh.group("pp"), scaler=scaler, found_inf_group=None)
    if plan.layout.expert_parallel_size > 1:
        from rapidtrain.parallel.experts import expert_parallel_runner

        runner = expert_parallel_runner(runner, mesh)
    return runner
