"""Megatron's tensor-parallel regions: a collective in one direction, its adjoint in the other.

Inside a tensor-parallel region every rank of the group computes on the same
replicated activations (or on its own shard); these functions move tensors in
and out of it so that forward values and gradients both match one process:

    copy_to_region(x)            forward: x                 backward: all-reduce
    reduce_from_region(x)        forward: all-reduce        backward: identity
    gather_from_region(x, dim)   forward: all-gather        backward: this rank's block
    scatter_to_region(x, dim)    forward: this rank's block backward: all-gather
    reduce_scatter_to_region(x, dim)
                                 forward: reduce-scatter    backward: all-gather

(the last is sequence parallelism's exit from a region: Korthikanti et al. 2022's ḡ).
"""

import torch
from torch import Tensor

from torchdist_ext.ops import collectives
from torchdist_ext.parallel.tp_group import TPGroup

__all__ = [
    "copy_to_region",
    "gather_from_region",
    "reduce_from_region",
    "reduce_scatter_to_region",
    "scatter_to_region",
]


def _block(x: Tensor, group: TPGroup, dim: int) -> Tensor:
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad, ctx.group.name), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return collectives.all_reduce(x, group.name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return collectives.all_gather(x, group.name, group.size, dim)

    @staticmethod
    def backward(ctx, grad):
        return _block(grad, ctx.group, ctx.dim), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _block(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, ctx.group.name, ctx.group.size, ctx.dim), None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return collectives.reduce_scatter(x, group.name, group.size, dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, ctx.group.name, ctx.group.size, ctx.dim), None, None


def copy_to_region(x: Tensor, group: TPGroup) -> Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: Tensor, group: TPGroup) -> Tensor:
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: Tensor, group: TPGroup, dim: int) -> Tensor:
    return _GatherFromRegion.apply(x, group, dim)


def scatter_to_region(x: Tensor, group: TPGroup, dim: int) -> Tensor:
    return _ScatterToRegion.apply(x, group, dim)


def reduce_scatter_to_region(x: Tensor, group: TPGroup, dim: int) -> Tensor:
    return _ReduceScatterToRegion.apply(x, group, dim)
