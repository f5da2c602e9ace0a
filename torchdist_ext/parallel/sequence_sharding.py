"""Sharding a sequence over a context-parallel mesh, in the order the attention expects (``shard_sequence``),
and back (``unshard_sequence``).

    tokens = shard_sequence(tokens_full, cp_mesh=mesh["cp"], dim=1)   # zigzag by default
    out_full = unshard_sequence(out, cp_mesh=mesh["cp"], dim=1)
"""

import math

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.regions import gather_from_region, scatter_to_region

__all__ = ["ORDERS", "check_order", "context_parallel_groups", "shard_sequence", "unshard_sequence"]

ORDERS = ("contiguous", "zigzag")


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def context_parallel_groups(cp_mesh: DeviceMesh) -> tuple[MeshGroup, MeshGroup | None]:
    """(ring group, Ulysses group or None) of a 1-D mesh, or of a 2-D ``[ring, ulysses]`` mesh."""
    if isinstance(cp_mesh, DeviceMesh) and cp_mesh.ndim == 2:
        return MeshGroup.of_dim(cp_mesh, 0, "cp_mesh (dim 0: ring)"), MeshGroup.of_dim(
            cp_mesh, 1, "cp_mesh (dim 1: ulysses)")
    if isinstance(cp_mesh, DeviceMesh) and cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh must be a 1-D or a 2-D [ring, ulysses] DeviceMesh, got a {cp_mesh.ndim}-D mesh")
    return MeshGroup.of(cp_mesh, "cp_mesh"), None


def zigzag_order(parts: int) -> list[int]:
    """The 2N chunks in rank order: rank r's chunks r and 2N-1-r are adjacent."""
    return [chunk for rank in range(parts) for chunk in (rank, 2 * parts - 1 - rank)]


def _reorder_chunks(x: Tensor, dim: int, order: list[int]) -> Tensor:
    chunks = x.chunk(len(order), dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def shard_sequence(x: Tensor, *, cp_mesh: DeviceMesh, dim: int, order: str = "zigzag") -> Tensor:
    """This rank's part of the sequence dim ``dim`` of the replicated ``x``.

    ``x`` is taken as replicated: each rank keeps its part, and the gradient of ``x`` is gathered from all
    ranks. With ``unshard_sequence`` this lets a single-process reference and a context-parallel computation be
    compared value for value and gradient for gradient.

    Args:
        x: the full tensor, the same on every rank.
        cp_mesh: the context-parallel mesh the attention runs on: 1-D for ``ring_attention`` and
            ``ulysses_attention``; 2-D ``[ring, ulysses]`` for ``hybrid_attention``, where the sequence is sharded
            over the ring ranks in ``order`` first and each ring rank's shard is then split into contiguous blocks
            over the Ulysses ranks. Pass the attention the same ``cp_mesh`` and ``order``.
        dim: the sequence dim; its size must split into the order's equal pieces (N blocks, or 2N chunks for
            zigzag; with a 2-D mesh each ring shard also over the Ulysses ranks).
        order: "zigzag" (the default): the sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r,
            in that order, so causal attention costs every rank the same. "contiguous": rank r holds block r
            of N.
    """
    check_order(order)
    ring, ulysses = context_parallel_groups(cp_mesh)
    dim = _check_sequence(x, dim, "x")
    parts = _parts(ring, ulysses, order)
    if x.shape[dim] % parts:
        raise ValueError(
            f"x.size({dim})={x.shape[dim]} must be divisible by {parts} to shard it with the {order} order "
            f"over this mesh"
        )
    if order == "zigzag":
        x = _reorder_chunks(x, dim, zigzag_order(ring.size))
    x = scatter_to_region(x, ring, dim)
    return scatter_to_region(x, ulysses, dim) if ulysses is not None else x


def unshard_sequence(x_local: Tensor, *, cp_mesh: DeviceMesh, dim: int, order: str = "zigzag") -> Tensor:
    """The full sequence, on every rank, from each rank's part ``x_local`` (the inverse of ``shard_sequence``,
    with the same ``cp_mesh``, ``dim`` and ``order``); its gradient is taken as replicated (each rank keeps its
    part)."""
    check_order(order)
    ring, ulysses = context_parallel_groups(cp_mesh)
    dim = _check_sequence(x_local, dim, "x_local")
    local_parts = _parts(ring, ulysses, order) // (ring.size * (ulysses.size if ulysses else 1))
    if x_local.shape[dim] % local_parts:
        raise ValueError(
            f"x_local.size({dim})={x_local.shape[dim]} must be divisible by {local_parts}: with the {order} "
            f"order over this mesh, every rank holds {local_parts} equal chunks"
        )
    x = gather_from_region(x_local, ulysses, dim) if ulysses is not None else x_local
    x = gather_from_region(x, ring, dim)
    if order == "zigzag":
        order = zigzag_order(ring.size)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        x = _reorder_chunks(x, dim, inverse)
    return x


def _parts(ring: MeshGroup, ulysses: MeshGroup | None, order: str) -> int:
    """The number of equal pieces the full sequence is cut into: the ring order needs N (or 2N) chunks,
    and each ring shard must split evenly over the Ulysses ranks."""
    ring_chunks = ring.size * (2 if order == "zigzag" else 1)
    return math.lcm(ring_chunks, ring.size * (ulysses.size if ulysses else 1))


def _check_sequence(x, dim: int, arg: str) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is out of range for {arg} of shape {tuple(x.shape)}")
    return dim % x.dim()
