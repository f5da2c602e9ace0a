"""Ulysses re-sharding (``tdx::all_to_all_seq_to_heads`` family): sequence shard <-> head shard.

    all_to_all_seq_to_heads: [B, H, S/N, D] (rank r: sequence block r) -> [B, H/N, S, D] (rank r: head block r)
    all_to_all_heads_to_seq: the inverse

One all-to-all each; the head/sequence re-layout is fused into the pack and
unpack of the exchange buffers. Each is the other's gradient.
"""

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _get_group_size_by_name

__all__ = ["all_to_all_seq_to_heads", "all_to_all_heads_to_seq"]


def all_to_all_seq_to_heads(x: Tensor, group_name: str) -> Tensor:
    """``[B, H, S/N, D]`` sequence shard -> ``[B, H/N, S, D]`` head shard (H divisible by N)."""
    return torch.ops.tdx.all_to_all_seq_to_heads(x, group_name)


def all_to_all_heads_to_seq(x: Tensor, group_name: str) -> Tensor:
    """``[B, H/N, S, D]`` head shard -> ``[B, H, S/N, D]`` sequence shard (S divisible by N)."""
    return torch.ops.tdx.all_to_all_heads_to_seq(x, group_name)


@torch.library.register_fake("tdx::all_to_all_seq_to_heads")
def _(x, group_name):
    n = _get_group_size_by_name(group_name)
    return x.new_empty(x.shape[0], x.shape[1] // n, x.shape[2] * n, x.shape[3])


@torch.library.register_fake("tdx::all_to_all_heads_to_seq")
def _(x, group_name):
    n = _get_group_size_by_name(group_name)
    return x.new_empty(x.shape[0], x.shape[1] * n, x.shape[2] // n, x.shape[3])


def _setup_context(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _seq_to_heads_backward(ctx, grad):
    return all_to_all_heads_to_seq(grad.contiguous(), ctx.group_name), None


def _heads_to_seq_backward(ctx, grad):
    return all_to_all_seq_to_heads(grad.contiguous(), ctx.group_name), None


torch.library.register_autograd(
    "tdx::all_to_all_seq_to_heads", _seq_to_heads_backward, setup_context=_setup_context
)
torch.library.register_autograd(
    "tdx::all_to_all_heads_to_seq", _heads_to_seq_backward, setup_context=_setup_context
)
