"""The process group of one parallel axis of a DeviceMesh, as plain values a layer or function keeps."""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshGroup"]


@dataclass(frozen=True)
class MeshGroup:
    """What a layer or function needs of its axis's mesh, as plain values (constants under torch.compile).

    Attributes:
        mesh: the mesh of the axis, 1-D (parameters are placed on it); ``of_dim`` of a mesh without dim
            names keeps the N-D mesh (only the tensor-parallel layers, built with ``of``, place parameters).
        name: registered process-group name, passed to the ``tdx`` ops.
        size: number of ranks.
        rank: this process's rank within the group.
    """

    mesh: DeviceMesh
    name: str
    size: int
    rank: int

    @classmethod
    def of(cls, mesh: DeviceMesh, arg: str = "tp_mesh") -> "MeshGroup":
        """The group of a 1-D mesh; ``arg`` names the argument in error messages."""
        _check_mesh(mesh, arg)
        if mesh.ndim != 1:
            raise ValueError(
                f"{arg} must be a 1-D DeviceMesh (slice it, e.g. world_mesh['{arg.removesuffix('_mesh')}']), "
                f"got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
            )
        return cls(mesh=mesh, name=mesh.get_group().group_name, size=mesh.size(), rank=mesh.get_local_rank())

    @classmethod
    def of_dim(cls, mesh: DeviceMesh, dim: int, arg: str) -> "MeshGroup":
        """The group along dim ``dim`` of an N-D mesh (its ``mesh`` is that dim's 1-D slice when the dims are
        named, else the N-D mesh)."""
        _check_mesh(mesh, arg)
        names = mesh.mesh_dim_names
        axis_mesh = mesh[names[dim]] if names else mesh
        return cls(mesh=axis_mesh, name=mesh.get_group(mesh_dim=dim).group_name, size=mesh.size(dim),
                   rank=mesh.get_local_rank(mesh_dim=dim))


def _check_mesh(mesh, arg: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{arg} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"{arg} {mesh} does not include this process (global rank {dist.get_rank()}): build layers and call "
            "functions only on the ranks of their mesh"
        )
