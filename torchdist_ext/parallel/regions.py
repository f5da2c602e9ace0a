"""Megatron's tensor-parallel regions: a collective in one direction, its adjoint in the other.

Inside a tensor-parallel region every rank of the group computes on the same
replicated activations (or on its own shard); these functions move tensors in
and out of it so that forward values and gradients both match one process:

    copy_to_region(x)                     forward: x                 backward: all-reduce
    reduce_from_region(x)                 forward: all-reduce        backward: identity
    scatter_to_region(x, dim)             forward: this rank's block backward: all-gather
    gather_from_region(x, dim)            forward: all-gather        backward: this rank's block
    reduce_scatter_to_sequence_region(x, dim)
                                          forward: reduce-scatter    backward: all-gather
    gather_from_sequence_region(x, dim)   forward: all-gather        backward: reduce-scatter

The functions come in adjoint pairs and each one's backward calls its partner,
so gradients of any order flow through. Blocks follow ``torch.chunk`` order.
"""

import torch
from torch import Tensor

from torchdist_ext import _collectives as collectives
from torchdist_ext.parallel.mesh_group import MeshGroup

__all__ = [
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence_region",
    "reduce_from_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_region",
]


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_from_region(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return collectives.all_reduce(x, group.name)

    @staticmethod
    def backward(ctx, grad):
        return copy_to_region(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.chunk(group.size, dim=dim)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_from_region(grad, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return collectives.all_gather(x, group.name, group.size, dim)

    @staticmethod
    def backward(ctx, grad):
        return scatter_to_region(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return collectives.reduce_scatter(x, group.name, group.size, dim)

    @staticmethod
    def backward(ctx, grad):
        return gather_from_sequence_region(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return collectives.all_gather(x, group.name, group.size, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_to_sequence_region(grad, ctx.group, ctx.dim), None, None


def copy_to_region(x: Tensor, group: MeshGroup) -> Tensor:
    """Enters a region with a replicated tensor: its gradient is summed over the group."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: Tensor, group: MeshGroup) -> Tensor:
    """Leaves a region with the sum of the ranks' partial results (replicated)."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """Enters a region with this rank's block of a replicated tensor."""
    return _ScatterToRegion.apply(x, group, dim)


def gather_from_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """Leaves a region with the concatenated blocks (replicated)."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _GatherFromRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """Sums the ranks' partial results and keeps this rank's block along the sequence ``dim``."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group, dim)


def gather_from_sequence_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """All-gathers sequence blocks; each rank's use of the full sequence sends gradient back to every block."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _GatherFromSequenceRegion.apply(x, group, dim)
