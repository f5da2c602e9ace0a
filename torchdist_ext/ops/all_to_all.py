"""Ulysses re-sharding (``tdx::all_to_all_seq_to_heads`` family): sequence shard <-> head shard.

    all_to_all_seq_to_heads: [B, H, S/N, D] (rank r: its sequence shard in ``order``)
                             -> [B, H/N, S, D] (rank r: head block r of the whole sequence, in order)
    all_to_all_heads_to_seq: the inverse

``order`` is how the sequence is sharded: "contiguous" (rank r holds block r of N)
or "zigzag" (chunks r and 2N-1-r of 2N; the local sequence is even). One
all-to-all each; the head/sequence re-layout and the zigzag chunk order are
fused into the pack and unpack of the exchange buffers. Each is the other's gradient.
"""

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _get_group_size_by_name

__all__ = ["all_to_all_seq_to_heads", "all_to_all_heads_to_seq"]

_ORDERS = ("contiguous", "zigzag")


def all_to_all_seq_to_heads(x: Tensor, group_name: str, order: str) -> Tensor:
    """``[B, H, S/N, D]`` sequence shard -> ``[B, H/N, S, D]`` head shard (H divisible by N)."""
    return torch.ops.tdx.all_to_all_seq_to_heads(x, group_name, order)


def all_to_all_heads_to_seq(x: Tensor, group_name: str, order: str) -> Tensor:
    """``[B, H/N, S, D]`` head shard -> ``[B, H, S/N, D]`` sequence shard (S divisible by N, by 2N for zigzag)."""
    return torch.ops.tdx.all_to_all_heads_to_seq(x, group_name, order)


def _check(op: str, x: Tensor, order: str) -> None:
    """The C++ op's checks shared by both directions, for the fake (meta) implementations."""
    torch._check(x.dim() == 4, lambda: f"{op}: x must be [batch, heads, seq, head_dim], got {tuple(x.shape)}")
    torch._check_value(order in _ORDERS, lambda: f"{op}: order must be 'contiguous' or 'zigzag', got {order!r}")


@torch.library.register_fake("tdx::all_to_all_seq_to_heads")
def _(x, group_name, order):
    op = "all_to_all_seq_to_heads"
    _check(op, x, order)
    n = _get_group_size_by_name(group_name)
    torch._check(x.shape[1] % n == 0, lambda: f"{op}: heads ({x.shape[1]}) must be divisible by the group size {n}")
    torch._check(
        order == "contiguous" or x.shape[2] % 2 == 0,
        lambda: f"{op}: the zigzag order needs an even local sequence (two chunks per rank), got {x.shape[2]}",
    )
    return x.new_empty(x.shape[0], x.shape[1] // n, x.shape[2] * n, x.shape[3])


@torch.library.register_fake("tdx::all_to_all_heads_to_seq")
def _(x, group_name, order):
    op = "all_to_all_heads_to_seq"
    _check(op, x, order)
    n = _get_group_size_by_name(group_name)
    parts = 2 * n if order == "zigzag" else n
    torch._check(
        x.shape[2] % parts == 0, lambda: f"{op}: seq ({x.shape[2]}) must be divisible by {parts} (group size {n})"
    )
    return x.new_empty(x.shape[0], x.shape[1] * n, x.shape[2] // n, x.shape[3])


def _setup_context(ctx, inputs, output):
    ctx.group_name, ctx.order = inputs[1], inputs[2]


def _seq_to_heads_backward(ctx, grad):
    return all_to_all_heads_to_seq(grad.contiguous(), ctx.group_name, ctx.order), None, None


def _heads_to_seq_backward(ctx, grad):
    return all_to_all_seq_to_heads(grad.contiguous(), ctx.group_name, ctx.order), None, None


torch.library.register_autograd(
    "tdx::all_to_all_seq_to_heads", _seq_to_heads_backward, setup_context=_setup_context
)
torch.library.register_autograd(
    "tdx::all_to_all_heads_to_seq", _heads_to_seq_backward, setup_context=_setup_context
)
