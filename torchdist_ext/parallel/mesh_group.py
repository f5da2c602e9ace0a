"""The process group of a 1-D DeviceMesh (one parallel axis), parameter placement, and shared argument checks."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

__all__ = [
    "MeshGroup",
    "check_divisible",
    "check_features",
    "check_floating_input",
    "distribute_parameter",
    "sequence_dim",
]


@dataclass(frozen=True)
class MeshGroup:
    """What a layer or function needs of its axis's mesh, as plain values (constants under torch.compile).

    Attributes:
        mesh: the 1-D mesh the parameters are placed on.
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
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{arg} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise ValueError(
                f"{arg} must be a 1-D DeviceMesh (slice it, e.g. world_mesh['{arg.removesuffix('_mesh')}']), "
                f"got a {mesh.ndim}-D mesh "
                f"of shape {tuple(mesh.shape)}"
            )
        group = mesh.get_group()
        return cls(mesh=mesh, name=group.group_name, size=mesh.size(), rank=mesh.get_local_rank())


def distribute_parameter(full: torch.Tensor, group: MeshGroup, placement: Placement,
                         src_data_rank: int | None) -> nn.Parameter:
    """A DTensor parameter on ``group.mesh`` from the full tensor.

    ``src_data_rank=0`` takes rank 0's values (a scatter/broadcast: all ranks
    agree whatever they drew); ``None`` slices each rank's own copy without
    communicating (every rank must hold the same full tensor). Meta tensors
    stay meta, with the right local shape.
    """
    if full.is_meta:
        local = full.chunk(group.size, dim=placement.dim)[group.rank] if isinstance(placement, Shard) else full
        dtensor = DTensor.from_local(local, group.mesh, [placement], run_check=False, shape=full.shape,
                                     stride=full.stride())
    else:
        dtensor = distribute_tensor(full, group.mesh, [placement], src_data_rank=src_data_rank)
    return nn.Parameter(dtensor)


def check_divisible(arg: str, value: int, group: MeshGroup, what: str = "the tensor-parallel size") -> None:
    if value % group.size != 0:
        raise ValueError(f"{arg}={value} must be divisible by {what} {group.size}")


def check_floating_input(x, arg: str, expected_dtype: torch.dtype) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != expected_dtype:
        raise TypeError(f"{arg} has dtype {x.dtype} but the layer's parameters are {expected_dtype}; cast one of them")


def check_features(x: torch.Tensor, arg: str, expected: int, rule: str) -> None:
    if x.dim() < 1 or x.shape[-1] != expected:
        raise ValueError(f"{arg} has shape {tuple(x.shape)}; its last dim must be {expected} ({rule})")


def sequence_dim(x: torch.Tensor, seq_dim: int, arg: str = "input") -> int:
    """``seq_dim`` normalised for ``x``; it must exist and not be the feature dim."""
    dim = seq_dim + x.dim() if seq_dim < 0 else seq_dim
    if not 0 <= dim < x.dim() - 1:
        raise ValueError(
            f"{arg} has shape {tuple(x.shape)}; seq_dim={seq_dim} must name one of its dims before the last"
        )
    return dim
