"""Sharding a sequence over a context-parallel mesh, and back.

    layout="contiguous"  rank r holds block r of N equal blocks.
    layout="zigzag"      the sequence is cut into 2N chunks; rank r holds chunks r and
                         2N-1-r (in that order), so causal attention costs every rank the same.

For ``hybrid_attention`` pass ``cp_mesh=(ulysses_mesh, ring_mesh)``: the sequence
is sharded over the ring ranks with ``layout`` first, and each ring rank's
shard is then split into contiguous blocks over the Ulysses ranks. That way
the Ulysses all-to-all reassembles exactly the ring rank's shard.

``shard_sequence`` treats ``x`` as replicated (the same on every rank): each
rank keeps its part, and the gradient of ``x`` is gathered from all ranks.
``unshard_sequence`` returns the full tensor on every rank, and takes its
gradient as replicated. Together they let a single-process reference and a
context-parallel computation be compared value for value and gradient for gradient.
"""

import math

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.regions import gather_from_region, scatter_to_region

__all__ = ["shard_sequence", "unshard_sequence", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def zigzag_order(parts: int) -> list[int]:
    """The 2N chunks in rank order: rank r's chunks r and 2N-1-r are adjacent."""
    return [chunk for rank in range(parts) for chunk in (rank, 2 * parts - 1 - rank)]


def _reorder_chunks(x: Tensor, dim: int, order: list[int]) -> Tensor:
    chunks = x.chunk(len(order), dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def _mesh_groups(cp_mesh) -> tuple[MeshGroup | None, MeshGroup]:
    """(ulysses group or None, ring/outer group) from a mesh or a (ulysses_mesh, ring_mesh) pair."""
    if isinstance(cp_mesh, DeviceMesh):
        return None, MeshGroup.of(cp_mesh, "cp_mesh")
    if isinstance(cp_mesh, tuple) and len(cp_mesh) == 2:
        return MeshGroup.of(cp_mesh[0], "cp_mesh[0] (ulysses)"), MeshGroup.of(cp_mesh[1], "cp_mesh[1] (ring)")
    raise TypeError(f"cp_mesh must be a 1-D DeviceMesh or a (ulysses_mesh, ring_mesh) tuple, got {cp_mesh!r}")


def shard_sequence(x: Tensor, *, cp_mesh, dim: int, layout: str = "zigzag") -> Tensor:
    """This rank's part of the sequence dim ``dim`` of the replicated ``x``."""
    check_layout(layout)
    inner, outer = _mesh_groups(cp_mesh)
    _check_divisible_length(x, dim, outer, inner, layout)
    if layout == "zigzag":
        x = _reorder_chunks(x, dim, zigzag_order(outer.size))
    x = scatter_to_region(x, outer, dim)
    return scatter_to_region(x, inner, dim) if inner is not None else x


def unshard_sequence(x_local: Tensor, *, cp_mesh, dim: int, layout: str = "zigzag") -> Tensor:
    """The full sequence, on every rank, from each rank's part (the inverse of ``shard_sequence``)."""
    check_layout(layout)
    inner, outer = _mesh_groups(cp_mesh)
    x = gather_from_region(x_local, inner, dim) if inner is not None else x_local
    x = gather_from_region(x, outer, dim)
    if layout == "zigzag":
        order = zigzag_order(outer.size)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        x = _reorder_chunks(x, dim, inverse)
    return x


def _check_divisible_length(x: Tensor, dim: int, outer: MeshGroup, inner: MeshGroup | None, layout: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for x of shape {tuple(x.shape)}")
    # The outer layout needs N (or 2N) equal chunks; each outer shard must split evenly over the inner ranks.
    outer_chunks = outer.size * (2 if layout == "zigzag" else 1)
    parts = math.lcm(outer_chunks, outer.size * (inner.size if inner else 1))
    if x.shape[dim] % parts:
        raise ValueError(
            f"x.size({dim})={x.shape[dim]} must be divisible by {parts} to shard it with the {layout} layout "
            f"over this mesh"
        )
