"""Data-parallel wrapping of a transformed model: DDP (composable `replicate` when parameters are
tensor-parallel DTensors) or FSDP2 over the mesh's data-parallel dimension; and `unwrap`, the user's model
inside whatever wrapped it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.transforms import transformer_blocks


def unwrap(module: Any) -> nn.Module:
    """The user's model inside DDP, the DeepSpeed engine, ORTModule or a compiled root."""
    seen = 0
    while seen < 8:
        seen += 1
        if (
            isinstance(module, nn.parallel.DistributedDataParallel)
            or type(module).__name__ == "DeepSpeedEngine"
        ):
            module = module.module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        elif type(module).__name__ == "ORTModule":
            module = module.module
        else:
            break
    return module


def apply_ddp(model: nn.Module, mesh: ParallelMesh, device: torch.device) -> nn.Module:
    group = mesh.gradient_group()  # data × context ranks
    if group is None:
        return model
    if mesh.layout.tensor_parallel_size > 1:  # DDP cannot reduce DTensor parameters
        return apply_replicate(model, mesh)
    device_ids = [device.index] if device.type == "cuda" else None
    from rapidtrain.parallel.experts import exclude_experts_from_ddp

    exclude_experts_from_ddp(model)  # sharded experts are reduced over their own group (parallel/experts.py)
    # Gradients as views into DDP's reduction buckets: otherwise the buckets are a second copy of every gradient
    # (one more fp32 copy of the model per rank, which the plan's memory estimate does not count).
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group, gradient_as_bucket_view=True,
                                   find_unused_parameters=may_leave_weights_unused(model))


def may_leave_weights_unused(model: nn.Module) -> bool:
    """Whether a step's loss may leave some trainable weights without a gradient, so DDP must look for them each
    iteration (find_unused_parameters): any model but the built-in GPT and BERT, whose loss reads every weight. A
    fine-tuned model may hold a head its task does not use, or experts no token reached (Hugging Face MoE models
    run only the experts that receive tokens); DDP would otherwise stop at the next iteration ("Expected to have
    finished reduction"). Hugging Face Trainer assumes the same by default."""
    from rapidtrain.models.bert import BertModel
    from rapidtrain.models.gpt import GPTModel

    inner = getattr(model, "_orig_mod", model)
    return not isinstance(inner, (GPTModel, BertModel))


def apply_replicate(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Data parallelism in 3D: composable `replicate` (FSDP2's machinery, so tensor-parallel DTensor
    parameters become 2D dp × tp DTensors) over the dp mesh dimension; gradients averaged after backward.
    Sharded experts are left out: they are reduced over their own group (parallel/experts.py)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    from rapidtrain.parallel.experts import expert_parameters, place_experts_on_mesh_of_others

    replicate(model, mesh=mesh.submesh("dp_cp"), ignored_params=set(expert_parameters(model).values()) or None)
    place_experts_on_mesh_of_others(model)  # one mesh for all parameters: foreach clipping/optimizers need it
    return model


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, reshard_after_forward: bool,
               precision: str = "fp32") -> nn.Module:
    """FSDP2 over the data-parallel dimension: each block a unit, then the root.

    Under bf16/fp16 the blocks get a `MixedPrecisionPolicy`: their parameters are all-gathered and computed in
    the low precision (half the all-gather bytes), gradients are reduced and accumulated in fp32. Block inputs
    are not cast and the root (embeddings, final norm, head) keeps fp32 parameters, so the residual stream
    and the loss stay fp32 as in the one-process autocast run: losses and fp16 overflow decisions match
    the other layouts.

    Expert slices (expert parallelism) are sharded over their own ranks first where the plan says so
    (`plan.experts_sharded_by_fsdp2`); otherwise they stay out of FSDP2, placed beside the other parameters'
    DTensors, and are reduced over their own group (parallel/experts.py)."""
    from torch.distributed.fsdp import fully_shard

    from rapidtrain.config.memory import experts_sharded_by_fsdp2
    from rapidtrain.parallel.experts import expert_parameters, place_experts_on_mesh_of_others, shard_experts_with_fsdp

    experts = set(expert_parameters(model).values())
    if experts and experts_sharded_by_fsdp2(mesh.layout, tuple({p.shape[1] for p in experts})):
        shard_experts_with_fsdp(model, mesh, reshard_after_forward)
        experts = set()
    ignored = experts or None
    dp_mesh = mesh.submesh("dp_cp")  # context-parallel ranks hold the same weights: sharded over them too
    blocks_policy = mixed_precision_policy(precision)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored,
                    **blocks_policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    if ignored:
        place_experts_on_mesh_of_others(model)
    return model


LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(precision: str) -> dict[str, Any]:
    """`fully_shard` keyword arguments for a run in `precision` ("fp32": none)."""
    if precision not in LOW_PRECISION:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=LOW_PRECISION[precision], reduce_dtype=torch.float32)
    return {"mp_policy": policy}
