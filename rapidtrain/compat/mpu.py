"""Megatron's `mpu` (parallel state) for user scripts: the ranks, sizes and process groups of the run's mesh
under Megatron's names, and `broadcast_data`. `from rapidtrain import mpu` replaces `from megatron import mpu`.

Groups are the mesh's own process groups (a dimension of size 1 has a group of one rank, as in Megatron);
in a single process without torch.distributed every rank is 0, every size 1 and every group None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def _engine() -> Any:
    from rapidtrain.train.engine import current_engine

    return current_engine()


def _mesh() -> Any:
    return _engine().mesh


def _group(name: str) -> dist.ProcessGroup | None:
    """The mesh's group of dimension `name`; "dp_cp" is data × context (the data dimension without context
    parallelism), and a dimension the mesh does not have ("cp" without context parallelism) has none."""
    mesh = _mesh()
    name = mesh._dimension(name)
    device_mesh = mesh._mesh_of(name)
    if device_mesh is None or not dist.is_initialized():
        return None
    if name == "dp_cp":
        return device_mesh["dp_cp"].get_group()
    if name not in (device_mesh.mesh_dim_names or ()):
        return None
    return device_mesh.get_group(name)


def _size(name: str) -> int:
    group = _group(name)
    return dist.get_world_size(group) if group is not None else 1


def _rank(name: str) -> int:
    group = _group(name)
    return dist.get_rank(group) if group is not None else 0


def model_parallel_is_initialized() -> bool:
    from rapidtrain.train import engine

    return engine._CURRENT_ENGINE is not None


# ---- tensor parallel ----
def get_tensor_model_parallel_group() -> dist.ProcessGroup | None:
    return _group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's group (broadcasts start there)."""
    group = _group("tp")
    return dist.get_global_rank(group, 0) if group is not None else 0


# ---- data parallel (with_context_parallel: Megatron's dp_cp group, the ranks that reduce gradients together) ----
def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup | None:
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank("dp_cp" if with_context_parallel else "dp")


# ---- context parallel ----
def get_context_parallel_group() -> dist.ProcessGroup | None:
    return _group("cp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_context_parallel_global_ranks() -> list[int]:
    group = _group("cp")
    return dist.get_process_group_ranks(group) if group is not None else [dist.get_rank() if dist.is_initialized()
                                                                             else 0]


# ---- pipeline parallel ----
def get_pipeline_model_parallel_group() -> dist.ProcessGroup | None:
    return _group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    stages = _engine().plan.layout.virtual_pipeline_stages
    return stages if stages > 1 else None


def get_embedding_group() -> dist.ProcessGroup | None:
    """First and last pipeline stage of this rank's data/tensor coordinates (Megatron's embedding group)."""
    return _mesh().embedding_group()


# ---- model parallel (tensor × pipeline) and experts ----
def get_model_parallel_world_size() -> int:
    """Megatron's older name for the tensor-parallel size."""
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()


def get_expert_model_parallel_world_size() -> int:
    return _engine().plan.layout.expert_parallel_size


def get_expert_model_parallel_rank() -> int:
    return _rank("ep") if get_expert_model_parallel_world_size() > 1 else 0


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    return _group("ep") if get_expert_model_parallel_world_size() > 1 else None


# ---- data broadcast (megatron.core.tensor_parallel.broadcast_data) ----
def broadcast_data(keys: Sequence[str], data: Mapping[str, Any] | None, datatype: torch.dtype) -> dict[str, Any]:
    """`data[key]` for each key as a tensor of `datatype` on the run's device, the same on every tensor-
    parallel rank: tensor-parallel rank 0's values are broadcast (Megatron's contract: the others may pass
    None). A value of another dtype is refused, as Megatron refuses it."""
    device = _engine().device
    group = _group("tp")
    if group is None or dist.get_world_size(group) == 1:
        return {key: _checked(key, data, datatype).to(device) for key in keys}
    source = get_tensor_model_parallel_src_rank()
    if dist.get_rank() == source:
        values = [_checked(key, data, datatype) for key in keys]
        sizes = torch.tensor([n for v in values for n in (v.dim(), *v.shape)] or [0], dtype=torch.int64)
        header = torch.tensor([sizes.numel()], dtype=torch.int64)
    else:
        values, header = [], torch.zeros(1, dtype=torch.int64)
    dist.broadcast(header, source, group=group)  # host tensors: the gloo side of "cpu:gloo,cuda:nccl"
    if dist.get_rank() != source:
        sizes = torch.zeros(int(header[0]), dtype=torch.int64)
    dist.broadcast(sizes, source, group=group)
    shapes = _shapes(sizes.tolist(), len(keys))
    flat = (torch.cat([v.reshape(-1) for v in values]).to(device) if values
            else torch.empty(sum(_numel(s) for s in shapes), dtype=datatype, device=device))
    dist.broadcast(flat, source, group=group)
    out, offset = {}, 0
    for key, shape in zip(keys, shapes, strict=True):
        out[key] = flat[offset:offset + _numel(shape)].view(shape)
        offset += _numel(shape)
    return out


def _checked(key: str, data: Mapping[str, Any] | None, datatype: torch.dtype) -> torch.Tensor:
    if data is None or key not in data:
        raise KeyError(f"broadcast_data: key {key!r} is missing from the batch on tensor-parallel rank 0")
    value = torch.as_tensor(data[key])
    if value.dtype != datatype:
        raise TypeError(f"broadcast_data: {key!r} has data type {value.dtype}, which is different from {datatype}")
    return value


def _shapes(sizes: list[int], count: int) -> list[tuple[int, ...]]:
    shapes, index = [], 0
    for _ in range(count):
        ndim = sizes[index]
        shapes.append(tuple(sizes[index + 1:index + 1 + ndim]))
        index += 1 + ndim
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
