"""Apply the plan to a model: expert sharding, pipeline splitting, then the fixed transforms (tensor parallel →
activation checkpointing → compile, `parallel/transforms.py`) and data-parallel wrapping (DDP,
ZeroRedundancyOptimizer, FSDP2, FairScale, or the DeepSpeed engine).

Each step is a free function that knows one engine; `parallelize` calls them as the plan says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rapidtrain.config.memory import bf16_weight_copies, flat_optimizer_step
from rapidtrain.config.settings import Plan
from rapidtrain.core.errors import UserError
from rapidtrain.optim.flat_buffers import FlatAdam
from rapidtrain.optim.grad_scaler import LossScaler
from rapidtrain.optim.optimizers import build_optimizer, is_embedding_or_output
from rapidtrain.parallel.data_parallel import apply_ddp, apply_fsdp
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.meta_init import is_on_meta, materialize
from rapidtrain.parallel.runner import Runner, TorchRunner
from rapidtrain.parallel.transforms import apply_transforms


def parallelize(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    device: torch.device,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model_factory: Callable[[], nn.Module] | None = None,
) -> Runner:
    """Wrap `model` as the plan says and return its runner (TorchRunner or DeepSpeedRunner)."""
    check_adapters(model, plan)
    if plan.optimizer is not None and plan.optimizer.decoupled_lr is not None:
        check_decoupled_lr(model, optimizer)
    switches = plan.switches
    if switches.partitioning_engine == "deepspeed":
        from rapidtrain.parallel.deepspeed import deepspeed_runner

        return deepspeed_runner(model, plan, mesh, device, optimizer=optimizer, model_factory=model_factory)
    if plan.layout.expert_parallel_size > 1:
        from rapidtrain.parallel.experts import apply_expert_parallel

        # Before tensor parallelism, which then replicates each rank's expert slice over its TP ranks.
        apply_expert_parallel(model, mesh, plan.layout.expert_parallel_size)
    runner: TorchRunner  # every torch layout; the expert reduction below is added to it
    if plan.layout.pipeline_parallel_size > 1:  # split first; each stage then goes through the same order
        from rapidtrain.parallel.pipeline import pipeline_runner

        runner = pipeline_runner(model, plan, mesh, device, optimizer=optimizer)
    else:
        runner = _data_parallel_runner(apply_transforms(model, plan, mesh), plan, mesh, device, optimizer)
    if plan.layout.expert_parallel_size > 1:
        from rapidtrain.parallel.experts import add_expert_parallelism

        add_expert_parallelism(runner, mesh)
    return runner


def check_adapters(model: nn.Module, plan: Plan) -> None:
    """--lora-rank on a built-in model: the model composed must carry the adapters (the built-in pretraining adds
    them; a user script's own model has none, and training it whole would ignore the flag)."""
    lora = plan.lora
    if lora is None or not lora.builtin or lora.rank <= 0:
        return
    if not any(".lora." in f".{name}" for name, _ in model.named_parameters()):
        raise UserError(f"--lora-rank {lora.rank}: the model given to Engine.compose ({type(model).__name__}) has no "
                        "LoRA adapters; rapidtrain adds them to the built-in model it builds (rapidtrain/pretrain.py, "
                        "MegatronPreTrainer) and to Hugging Face models (--pretrained-model-name-or-path); add your "
                        "own in the script, or drop --lora-rank")


def check_decoupled_lr(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """--decoupled-lr needs rapidtrain's own optimizer and a model with the built-in models' embedding and output
    layer names; checked on the whole model, before a pipeline stage (which may hold neither) is cut from it."""
    if optimizer is not None:
        raise UserError("--decoupled-lr: the optimizer passed to Engine.compose has its own parameter groups, so the "
                        "embedding and output layer cannot get their own rate; leave `optimizer` out (rapidtrain "
                        "builds it from the flags) or drop --decoupled-lr")
    if not any(is_embedding_or_output(name) for name, _ in model.named_parameters()):
        raise UserError("--decoupled-lr: this model has no word embedding or output layer named as the built-in "
                        "models name them (embedding.word_embeddings, output); leave --decoupled-lr out")


def _data_parallel_runner(model: nn.Module, plan: Plan, mesh: ParallelMesh, device: torch.device,
                          optimizer: torch.optim.Optimizer | None) -> TorchRunner:
    """The transformed model wrapped for data parallelism (DDP, ZeroRedundancyOptimizer, FSDP2, FairScale).

    A model built on meta is wrapped first and then materialized (each rank allocates its own shards only)."""
    switches = plan.switches
    assert plan.optimizer is not None and plan.loss_scale is not None
    on_meta = is_on_meta(model)
    if not on_meta:
        model = model.to(device)
    if switches.partitioning_engine == "fairscale":
        from rapidtrain.parallel.fairscale_backend import fairscale_runner

        return fairscale_runner(model, plan, mesh, device, optimizer=optimizer)
    if switches.partitioning_engine == "fsdp2":
        reshard = switches.partitioning == "fsdp"
        if mesh.gradient_group():
            model = apply_fsdp(model, mesh, reshard_after_forward=reshard, precision=plan.precision.dtype)
    else:
        model = apply_ddp(model, mesh, device)
    if on_meta:
        materialize(model, device, plan)
    runner_class = TorchRunner
    flat = None
    if switches.partitioning_engine == "zero-redundancy" and mesh.gradient_group() is not None:
        from rapidtrain.parallel.zero_redundancy import OSSRunner, oss_from_optimizer, oss_optimizer

        runner_class = OSSRunner
        optimizer = (oss_optimizer(model, plan.optimizer, device.type, mesh) if optimizer is None
                     else oss_from_optimizer(optimizer, mesh))
    elif optimizer is None:
        optimizer, _ = build_optimizer(model, plan.optimizer, device.type)
        flat = flat_buffers_for(model, optimizer, plan, device)
    scaler = LossScaler(plan.loss_scale) if plan.precision.loss_scaling != "none" else None
    runner = runner_class(module=model, optimizer=optimizer, precision=plan.precision, device_type=device.type,
                          clip_grad=plan.clip_grad, gradient_average=plan.layout.data_context_parallel_size
                          if mesh.gradient_group() else 1, pipeline_group=mesh.group("pp"), scaler=scaler,
                          flat=flat)
    if bf16_weight_copies(plan.precision, plan.layout, switches):
        from rapidtrain.parallel.low_precision_weights import LowPrecisionWeights

        # Over the flat parameters when there are some: the copies mirror that buffer, refreshed by one copy.
        copies = LowPrecisionWeights(model, flat_master=flat.params if flat is not None else None)
        runner.after_update.append(copies.refresh)
    return runner


def flat_buffers_for(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
                     device: torch.device) -> FlatAdam | None:
    """The optimizer's parameters, gradients and moments moved into flat buffers where the plan says so
    (config/memory.py's flat_optimizer_step), for the built-in GPT and BERT, whose loss reads every weight."""
    from rapidtrain.parallel.data_parallel import may_leave_weights_unused

    if not flat_optimizer_step(plan.model, plan.precision, plan.layout, plan.switches, plan.optimizer, device.type):
        return None
    if may_leave_weights_unused(model) or FlatAdam.problem(optimizer) is not None:
        return None
    return FlatAdam(optimizer)
