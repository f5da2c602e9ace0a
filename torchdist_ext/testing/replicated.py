"""Moving a replicated tensor in and out of a sharded computation, with gradients.

Tests compute a reference on full tensors that every rank holds identically
(same seed), shard them, run the parallel code and gather the results back.
For gradients to compare too, both moves keep the *replicated* convention:
a replicated tensor's gradient is the same full tensor on every rank.

Each one's backward is the other, so gradients of any order flow through.

    shard_replicated(x, group, dim)    forward: this rank's torch.chunk block of x
                                       backward: all-gather of the blocks' grads
    gather_replicated(x, group, dim)   forward: all-gather of the blocks
                                       backward: this rank's block of the grad
"""

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["shard_replicated", "gather_replicated"]


def _all_gather(x: Tensor, group, dim: int) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _block(x: Tensor, group, dim: int) -> Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _block(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _Gather.apply(grad, ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _Shard.apply(grad, ctx.group, ctx.dim), None, None


def shard_replicated(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """This rank's block of the replicated ``x`` along ``dim`` (size divisible by the group size)."""
    return _Shard.apply(x, group, dim)


def gather_replicated(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """The replicated concatenation of every rank's equal-sized block ``x`` along ``dim``."""
    return _Gather.apply(x, group, dim)
