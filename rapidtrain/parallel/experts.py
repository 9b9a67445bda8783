"""Expert parallelism (`--expert-model-parallel-size E`): each MoE layer's experts sharded over E
data-parallel ranks, tokens exchanged by all-to-all, expert gradients reduced over their own group.

Layout. The data-parallel ranks split into groups of E consecutive ranks (the "ep" dimension of
`ParallelMesh.expert_mesh`); rank j of a group holds experts [j·E/ep, (j+1)·E/ep) of every MoE layer.
Ranks at the same place of different groups hold the same experts and form the "expert_dp" group.
Under tensor parallelism the experts are replicated over the tensor-parallel ranks, which see the
same tokens; each tensor-parallel coordinate has its own expert-parallel groups, and under pipeline
parallelism each stage has its own (the mesh's "pp" dimension).

Routing, capacity and dropping stay local to each rank exactly as without expert parallelism; only
the experts' matmuls move: the [E, C, h] capacity buffers go to the ranks owning the experts, which
run [E/ep, ep·C, h], and come back. So EP E computes the same numbers as EP 1 at the same data-parallel
size (the matmuls only see more rows at once).

Gradients. The data-parallel wrapper (DDP, `replicate`) ignores the expert parameters. Before the
optimizer step the runner sums their gradients over the expert_dp group and divides by the
data-parallel size: the same mean over all data-parallel ranks that the wrapper takes for the other
parameters (the all-to-all's backward already summed the contributions of the ep group). Under FSDP2
(FSDP, SDP, and ZeRO-1/2 with EP) the slices are instead fully_shard-ed over expert_dp, whose
reduce-scatter does the same sum with the same divide factor (`shard_experts_with_fsdp`); under OSS they
stay out of ZeroRedundancyOptimizer's partitioning (parallel/zero_redundancy.py). The gradient norm
counts each expert once.

Checkpoints. A rank's [E/ep, ...] slices (weights and optimizer state) are saved as DTensor shards of
the full [E, ...] tensors, Shard(0) over the ep mesh (Replicate over tp), or under FSDP2 (Shard(1),
Shard(0)) over (expert_dp, ep), so torch.distributed.checkpoint reshards: EP 2 loads at EP 1 and back,
under any data-, tensor- and pipeline-parallel layout and partitioning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from rapidtrain.models.moe import Experts, moe_layers
from rapidtrain.parallel.mesh import ParallelMesh
from rapidtrain.parallel.runner import GradNorm, TorchRunner

EXPERT_WEIGHTS = ("w1", "w_gate", "b1", "b_gate", "w2", "b2")  # those the layer has (no w_gate without SwiGLU, ...)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its adjoint is the same exchange, so backward repeats it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        dist.all_to_all_single(output, tensor.contiguous(), group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None


def all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk j of dim 0 goes to rank j of `group`; chunk i of the result came from rank i."""
    return _AllToAll.apply(tensor, group)


class ExpertParallelExperts(Experts):
    """This rank's share of one MoE layer's experts. Takes and returns the layer's full [E, C, h]
    capacity buffers, so the MoE layer's routing, dispatch and combine are unchanged."""

    takes_grouped_rows = False  # the all-to-all exchanges equal [E, C, h] buffers (dropless: C = the tokens)

    def __init__(self, experts: Experts, group: dist.ProcessGroup, ep_rank: int, ep_size: int) -> None:
        nn.Module.__init__(self)
        self.num_experts = experts.w1.shape[0]
        self.ep_size = ep_size
        self.group = group
        local = self.num_experts // ep_size
        self.first_expert = ep_rank * local
        self.openai_gelu = experts.openai_gelu
        self.squared_relu = experts.squared_relu
        self.gated_unit = experts.gated_unit
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            if full is None:
                setattr(self, name, None)
                continue
            if isinstance(full, DTensor):
                raise ValueError(
                    "apply expert parallelism before tensor parallelism (it slices plain expert weights)"
                )
            if full.is_meta:
                raise ValueError(
                    "expert parallelism slices materialized expert weights: build the model on a real "
                    "device (not meta) before apply_expert_parallel"
                )
            shard = full.detach()[self.first_expert : self.first_expert + local].clone()
            setattr(self, name, nn.Parameter(shard, requires_grad=full.requires_grad))

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, buffers: torch.Tensor, offsets: torch.Tensor | None = None,
                row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """[E, C, h] (this rank's tokens for every expert) → [E, C, h] (those tokens' expert outputs)."""
        assert offsets is None and row_weights is None, \
            "expert parallelism exchanges capacity buffers (takes_grouped_rows is False)"
        experts, capacity, hidden = buffers.shape
        local, ep = self.num_local_experts, self.ep_size
        received = all_to_all(buffers, self.group)  # [ep · local, C, h]: chunk i holds rank i's tokens
        rows = (
            received.view(ep, local, capacity, hidden).transpose(0, 1).reshape(local, ep * capacity, hidden)
        )
        # Local values: expert slices are DTensors when placed beside data-parallel DTensors (replicate, FSDP2).
        output = self.run_experts(rows, _local(self.w1), _local_or_none(self.w_gate), _local_or_none(self.b1),
                                  _local(self.w2), _local_or_none(self.b2), _local_or_none(self.b_gate))
        back = output.view(local, ep, capacity, hidden).transpose(0, 1).reshape(experts, capacity, hidden)
        return all_to_all(back, self.group)


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh, ep_size: int) -> nn.Module:
    """Shard every MoE layer's experts over the expert-parallel group of `mesh` (in place).

    Call on a materialized model (weights initialized: each rank keeps its slice of the same values),
    before tensor parallelism (which then replicates the slice over the TP ranks), activation
    checkpointing, compile and data-parallel wrapping.
    """
    group = mesh.group("ep")
    if ep_size == 1 or group is None:
        return model
    ep_rank = dist.get_rank(group)
    for name, layer in moe_layers(model).items():
        if layer.num_experts % ep_size:
            raise ValueError(
                f"{name} has {layer.num_experts} experts, not divisible by "
                f"--expert-model-parallel-size {ep_size}: use expert counts that are multiples of it"
            )
        if not isinstance(layer.experts, ExpertParallelExperts):
            layer.experts = ExpertParallelExperts(layer.experts, group, ep_rank, ep_size)
    return model


def expert_modules(model: nn.Module) -> list[ExpertParallelExperts]:
    return [module for module in model.modules() if isinstance(module, ExpertParallelExperts)]


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The sharded expert parameters by their current (possibly wrapped) names."""
    return {
        f"{module_name}.{leaf}": param
        for module_name, module in model.named_modules()
        if isinstance(module, ExpertParallelExperts)
        for leaf, param in module.named_parameters(recurse=False)
    }


def exclude_experts_from_ddp(model: nn.Module) -> None:
    """Tell DDP (before wrapping) to neither broadcast nor all-reduce the sharded expert parameters."""
    names = list(expert_parameters(model))
    if names:
        already = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, already + names)


def place_experts_on_mesh_of_others(model: nn.Module) -> None:
    """Put the expert slices on the mesh that `replicate` or FSDP2 gave the other parameters.

    Left out of `replicate`/`fully_shard`, the experts stay plain tensors (or, under TP, replicated DTensors on
    the tp mesh) while the other parameters become DTensors on the (dp[, tp]) mesh; foreach kernels (gradient
    clipping, the optimizers) refuse lists that mix plain tensors and DTensors. On that mesh an expert slice is
    nominally Replicate over dp although its values differ across ep ranks: nothing redistributes it (the
    forward uses local values, the runner reduces and measures its gradient itself, checkpoints place it as a
    shard of the full tensor).
    """
    experts = {id(p) for p in expert_parameters(model).values()}
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor) and id(p) not in experts}
    if not experts or len(meshes) != 1:
        return
    (mesh,) = meshes
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            for name, param in list(module.named_parameters(recurse=False)):
                if not (isinstance(param, DTensor) and param.device_mesh == mesh):
                    value = DTensor.from_local(_local(param.detach()), mesh, [Replicate()] * mesh.ndim,
                                               run_check=False)
                    module.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))


def shard_experts_with_fsdp(model: nn.Module, mesh: ParallelMesh, reshard_after_forward: bool) -> None:
    """FSDP2 for the expert slices, before the blocks around them are wrapped (torchtitan's way): each layer's
    slice is fully_shard-ed over the ranks holding the same experts (expert_dp), on its second dimension since
    the first (the experts) is expert parallelism's. The reduce-scatter sums over expert_dp what the all-to-all's
    backward summed over ep; dividing by the data-parallel size gives the mean DDP would take."""
    from torch.distributed.fsdp import fully_shard

    expert_dp = mesh.submesh("expert_dp")
    assert expert_dp is not None  # expert parallelism made the expert mesh
    for module in expert_modules(model):
        sharded = fully_shard(module, mesh=expert_dp, reshard_after_forward=reshard_after_forward,
                              shard_placement_fn=lambda _param: Shard(1))  # the module itself, now an FSDPModule
        sharded.set_gradient_divide_factor(float(mesh.layout.data_context_parallel_size))
        if expert_dp.device_type == "cpu":  # gloo has no PREMUL_SUM: sum, then divide
            sharded.set_force_sum_reduction_for_comms(True)


def _map_tensors(value: Any, convert: Any) -> Any:
    if isinstance(value, dict):
        return {key: _map_tensors(item, convert) for key, item in value.items()}
    return convert(value) if isinstance(value, torch.Tensor) else value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own values: under tensor parallelism expert slices are replicated DTensors."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else _local(tensor)


@dataclass
class ExpertParallelism:
    """What expert parallelism adds to a runner of any layout: the expert gradients' reduction before the
    step, the experts' part of the gradient norm, and checkpoint state with expert slices as shards."""

    expert_params: list[nn.Parameter]
    gradient_average: int
    expert_data_parallel_group: dist.ProcessGroup | None
    expert_parallel_size: int
    # Where saved slices live, and how: Shard(0) over ep (Replicate over tp), or under FSDP2 (expert_dp, ep)
    # with Shard(1) over expert_dp, FSDP2's own split of each slice.
    checkpoint_mesh: DeviceMesh
    checkpoint_placements: tuple
    # The expert parameters' own DTensor mesh and placements (None: plain tensors).
    parameter_mesh: DeviceMesh | None = None
    parameter_placements: tuple = ()

    def reduce_expert_gradients(self) -> None:
        """Sum over the ranks holding the same experts, then divide by the data-parallel size (as DDP)."""
        grads = [_local(p.grad) for p in self.expert_params if p.grad is not None]
        if not grads:
            return
        if self.expert_data_parallel_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.expert_data_parallel_group)
            for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(reduced.view_as(grad))
        torch._foreach_div_(grads, float(self.gradient_average))

    # ---- checkpoints: expert slices as shards of the full [E, ...] tensors ----
    def _to_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:  # e.g. Adam's step count: the same on every rank
            return tensor
        # tensor.shape is the slice's ([E/ep, ...]; a DTensor's global shape when FSDP2 splits it further).
        shape = (tensor.shape[0] * self.expert_parallel_size, *tensor.shape[1:])
        return DTensor.from_local(_local(tensor), self.checkpoint_mesh, self.checkpoint_placements,
                                  run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape))

    def _from_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (isinstance(tensor, DTensor) and tensor.device_mesh == self.checkpoint_mesh):
            return tensor
        if self.parameter_mesh is None:
            return tensor.to_local()
        shape = (tensor.shape[0] // self.expert_parallel_size, *tensor.shape[1:])
        return DTensor.from_local(tensor.to_local(), self.parameter_mesh, self.parameter_placements,
                                  run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape))

    def to_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        storage = {_local(p).untyped_storage().data_ptr() for p in self.expert_params}
        names = {
            name
            for name, value in state["model"].items()
            if isinstance(value, torch.Tensor) and _local(value).untyped_storage().data_ptr() in storage
        }
        for name in names:
            state["model"][name] = self._to_shard(state["model"][name])
            if "optimizer" in state and name in state["optimizer"].get("state", {}):
                state["optimizer"]["state"][name] = _map_tensors(
                    state["optimizer"]["state"][name], self._to_shard
                )
        return state

    def from_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        return _map_tensors(state, self._from_shard)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def add_expert_parallelism(runner: TorchRunner, mesh: ParallelMesh) -> TorchRunner:
    """Give the runner of an expert-parallel model (any layout) the experts' reduction, norm and checkpoint
    transform; the runner is unchanged when the model has no sharded experts."""
    from torch.distributed.fsdp import FSDPModule

    params = list(expert_parameters(runner.module).values())
    if not params:
        return runner
    optimizers = [runner.optimizer]
    if isinstance(runner.optimizer, ZeroRedundancyOptimizer):  # its local optimizer steps the expert slices
        optimizers.append(runner.optimizer.optim)
    optimized = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    if any(id(p) not in optimized for p in params):
        raise ValueError(
            "--expert-model-parallel-size replaces each MoE layer's expert parameters by this rank's slices, "
            "so an optimizer built before Engine.compose does not hold them: leave `optimizer` out of "
            "Engine.compose (it is then built from the flags), or use --expert-model-parallel-size 1."
        )
    assert mesh.expert_mesh is not None
    by_fsdp = any(isinstance(module, FSDPModule) for module in expert_modules(runner.module))
    placements: tuple[Placement, Placement]
    if by_fsdp:  # FSDP2 reduces them and splits each slice over expert_dp (shard_experts_with_fsdp)
        checkpoint_mesh, placements = mesh.expert_mesh["expert_dp", "ep"], (Shard(1), Shard(0))
        norm_group = mesh.gradient_group()  # every data-parallel (× context) rank holds a different piece
    else:
        checkpoint_mesh, placements = mesh.expert_mesh["ep", "tp"], (Shard(0), Replicate())
        norm_group = mesh.group("ep")  # each ep rank holds other experts, the tp ranks the same ones
    first = params[0]
    experts = ExpertParallelism(
        expert_params=params,
        gradient_average=runner.gradient_average,
        expert_data_parallel_group=mesh.group("expert_dp"),
        expert_parallel_size=mesh.layout.expert_parallel_size,
        checkpoint_mesh=checkpoint_mesh,
        checkpoint_placements=placements,
        parameter_mesh=first.device_mesh if isinstance(first, DTensor) else None,
        parameter_placements=tuple(first.placements) if isinstance(first, DTensor) else (),
    )
    if not by_fsdp:
        runner.before_step.append(experts.reduce_expert_gradients)
    expert_ids = {id(p) for p in params}
    assert runner.grad_norm is not None
    shared = [p for p in runner.grad_norm.parameters if id(p) not in expert_ids]
    runner.grad_norm = GradNorm(shared, runner.grad_norm.pipeline_group, params, norm_group)
    runner.state_transforms.append((experts.to_saved, experts.from_saved))
    return runner
