"""The device mesh: one owner of the parallel layout, with dimensions named in Megatron's order.

Pipeline outermost, then data, context, tensor innermost, so tensor-parallel ranks are neighbours (same node) and
context-parallel ranks next to them. Gradients are reduced over data × context ranks ("dp_cp", Megatron's
data-parallel group with context parallel): every context-parallel rank holds the whole weights and a gradient from
its part of the sequence. Degree checks live in the conflict table (`rules.py`); this module only builds what the
plan says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rapidtrain.config.settings import Layout


@dataclass
class ParallelMesh:
    """Named process groups of a run; `mesh` is None in a single process."""

    layout: Layout
    mesh: DeviceMesh | None
    # ("pp", "expert_dp", "ep", "tp") with --expert-model-parallel-size > 1: the dp dimension split into
    # groups of ep consecutive ranks ("ep", sharing out the experts) and the ranks holding the same experts.
    expert_mesh: DeviceMesh | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _coordinate(self, name: str) -> int:
        if self.mesh is None or name not in (self.mesh.mesh_dim_names or ()):  # no "cp" dimension without CP
            return 0
        return self.mesh.get_local_rank(name)

    @property
    def data_parallel_rank(self) -> int:
        return self._coordinate("dp")

    @property
    def context_parallel_rank(self) -> int:
        return self._coordinate("cp")

    @property
    def data_context_parallel_rank(self) -> int:
        """This rank's place among the ranks that reduce gradients together (d · CP + c)."""
        return self.data_parallel_rank * self.layout.context_parallel_size + self.context_parallel_rank

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

    def _mesh_of(self, name: str) -> DeviceMesh | None:
        if self.expert_mesh is not None and name in ("ep", "expert_dp"):
            return self.expert_mesh
        return self.mesh

    def _dimension(self, name: str) -> str:
        """"dp_cp" is "dp" itself without context parallelism (no flattened dimension is made then)."""
        return "dp" if name == "dp_cp" and self.layout.context_parallel_size == 1 else name

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of one dimension ("pp", "dp", "cp", "tp", "dp_cp", "ep", "expert_dp"), or None when it
        has a single rank (nothing to reduce). "dp_cp" is the gradient-reduction group: data × context ranks."""
        name = self._dimension(name)
        mesh = self._mesh_of(name)
        if mesh is None:
            return None
        if name == "dp_cp":
            return mesh["dp_cp"].get_group() if self.layout.data_context_parallel_size > 1 else None
        names = mesh.mesh_dim_names  # ours are always named
        if names is None or name not in names or mesh.size(names.index(name)) == 1:
            return None
        return mesh.get_group(name)

    def gradient_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold the same weights and average their gradients (DDP / ZeRO / FSDP): data × context."""
        return self.group("dp_cp")

    def submesh(self, name: str) -> DeviceMesh | None:
        name = self._dimension(name)
        mesh = self._mesh_of(name)
        return None if mesh is None else mesh[name]

    def pipeline_global_rank(self, stage_rank: int) -> int:
        """The global rank of pipeline rank `stage_rank` with this rank's data, context and tensor coordinates."""
        grid = self.layout.rank_grid()
        return grid[stage_rank][self.data_context_parallel_rank][self.tensor_parallel_rank]

    def embedding_group(self) -> dist.ProcessGroup | None:
        """First and last pipeline rank with this rank's data/tensor coordinates (Megatron's embedding
        group: they sum the gradients of the tied word embedding). Collective: every rank must call it."""
        pp = self.layout.pipeline_parallel_size
        if self.mesh is None or pp == 1:
            return None
        if pp == 2:
            return self.mesh.get_group("pp")
        mine = None
        for data_rows in zip(*[self.layout.rank_grid()[stage] for stage in (0, pp - 1)], strict=True):
            # (first-stage rank, last-stage rank) of each tensor-parallel coordinate
            for ranks in zip(*data_rows, strict=True):
                group = dist.new_group(list(ranks))  # every rank creates every group, in the same order
                if self.rank in ranks:
                    mine = group
        return mine


def build_mesh(layout: Layout, device_type: str) -> ParallelMesh:
    if layout.world_size == 1 or not dist.is_initialized():
        return ParallelMesh(layout, None)
    cp = layout.context_parallel_size
    if cp > 1:
        mesh = init_device_mesh(
            device_type, (layout.pipeline_parallel_size, layout.data_parallel_size, cp, layout.tensor_parallel_size),
            mesh_dim_names=("pp", "dp", "cp", "tp"))
        mesh["dp", "cp"]._flatten("dp_cp")  # torchtitan's way to the gradient group (dp_shard_cp)
    else:
        mesh = init_device_mesh(
            device_type, (layout.pipeline_parallel_size, layout.data_parallel_size, layout.tensor_parallel_size),
            mesh_dim_names=("pp", "dp", "tp"))
    expert_mesh = None
    ep = layout.expert_parallel_size
    if ep > 1:  # gradient rank d·cp + c = expert_dp · ep + ep rank: the same ranks as the main mesh's dp (× cp)
        expert_shape = (layout.pipeline_parallel_size, layout.data_context_parallel_size // ep, ep,
                        layout.tensor_parallel_size)
        expert_mesh = init_device_mesh(device_type, expert_shape, mesh_dim_names=("pp", "expert_dp", "ep", "tp"))
    return ParallelMesh(layout, mesh, expert_mesh)
