"""The device mesh: one owner of the parallel layout, with dimensions named in Megatron's order.

Pipeline outermost, then data, tensor innermost, so tensor-parallel ranks are neighbours (same node).
Degree checks live in the conflict table (`rules.py`); this module only builds what the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rapidtrain.plan import Layout


@dataclass
class ParallelMesh:
    """Named process groups of a run; `mesh` is None in a single process."""

    layout: Layout
    mesh: DeviceMesh | None

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _coordinate(self, name: str) -> int:
        if self.mesh is None:
            return 0
        return self.mesh.get_local_rank(name)

    @property
    def data_parallel_rank(self) -> int:
        return self._coordinate("dp")

    @property
    def tensor_parallel_rank(self) -> int:
        return self._coordinate("tp")

    @property
    def pipeline_rank(self) -> int:
        return self._coordinate("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_rank == self.layout.pipeline_parallel_size - 1

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of one dimension, or None when it has a single rank (nothing to reduce)."""
        if self.mesh is None or self.mesh.size(self.mesh.mesh_dim_names.index(name)) == 1:
            return None
        return self.mesh.get_group(name)

    def submesh(self, name: str) -> DeviceMesh | None:
        return None if self.mesh is None else self.mesh[name]


def build_mesh(layout: Layout, device_type: str) -> ParallelMesh:
    if layout.world_size == 1 or not dist.is_initialized():
        return ParallelMesh(layout, None)
    shape = (layout.pipeline_parallel_size, layout.data_parallel_size, layout.tensor_parallel_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "tp"))
    return ParallelMesh(layout, mesh)
