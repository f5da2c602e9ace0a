"""Megatron's tensor-parallel regions: functions that move tensors into and out of a region where every rank of a
group computes on the same replicated activations (or on its own shard), so that forward values and gradients
both match one process. They come in adjoint pairs, each one's backward calling its partner, so gradients of any
order flow through; blocks follow ``torch.chunk`` order.

    h = copy_to_region(x, group)                  # forward: x           backward: all-reduce
    y = reduce_from_region(h @ w_shard.T, group)  # forward: all-reduce  backward: identity
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
    """Enters a region with a replicated tensor: forward ``x``; backward all-reduces (sums) the gradient over the
    group."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: Tensor, group: MeshGroup) -> Tensor:
    """Leaves a region with the sum of the ranks' partial results (replicated): forward all-reduce; backward
    identity."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """Enters a region with this rank's block along ``dim`` of a replicated tensor; backward all-gathers the
    gradient's blocks."""
    return _ScatterToRegion.apply(x, group, dim)


def gather_from_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """Leaves a region with the blocks all-gathered along ``dim`` (replicated); backward keeps this rank's block
    of the gradient."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _GatherFromRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """Sums the ranks' partial results and keeps this rank's block along the sequence ``dim`` (reduce-scatter);
    backward all-gathers the gradient."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group, dim)


def gather_from_sequence_region(x: Tensor, group: MeshGroup, dim: int) -> Tensor:
    """All-gathers sequence blocks along ``dim``; backward reduce-scatters the gradient, since each rank's use of
    the full sequence sends gradient back to every block."""
    if group.size == 1:  # a one-rank collective is a copy
        return x
    return _GatherFromSequenceRegion.apply(x, group, dim)
