"""Ring attention over a sequence-sharded group (``tdx::ring_attention_fwd`` family).

Tensors are in the SDPA layout ``[batch, heads, seq_local, head_dim]``: this
rank's shard of the sequence in ``layout`` ("contiguous": rank r holds chunk r
of N; "zigzag": chunks r and 2N-1-r of 2N). ``k``/``v`` may have fewer heads
than ``q`` (a divisor). Key/value blocks travel the ring at kv heads while the
current block is computed; partial results merge by log-sum-exp
(``tdx::lse_merge_``, our fused kernel). The backward reuses the saved global
log-sum-exp and sends dK/dV around the ring with the key/value blocks.
"""

import torch
from torch import Tensor

__all__ = ["ring_attention", "lse_merge_"]


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, scale: float, layout: str
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: attention of this rank's queries over the whole sequence.

    ``out`` is laid out like ``q``; ``lse`` is ``[batch, q_heads, seq_local]`` (fp32,
    fp64 for fp64 inputs) and carries no gradient.
    """
    return torch.ops.tdx.ring_attention_fwd(q, k, v, group_name, causal, scale, layout)


def lse_merge_(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merges a partial attention result into ``(out, lse)`` in place, weighting both by log-sum-exp.

    ``out`` ``[..., rows, D]`` and ``lse`` ``[..., rows]`` in fp32 (fp64 for fp64 blocks);
    ``block_out`` the same shape in any float dtype, ``block_lse`` like ``lse``. Rows
    with ``lse = -inf`` hold nothing yet and take the block as is.
    """
    torch.ops.tdx.lse_merge_(out, lse, block_out, block_lse)


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@torch.library.register_fake("tdx::ring_attention_fwd")
def _(q, k, v, group_name, causal, scale, layout):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        q.shape[:3], dtype=_accumulation_dtype(q)
    )


@torch.library.register_fake("tdx::ring_attention_bwd")
def _(grad_out, q, k, v, out, lse, group_name, causal, scale, layout):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


@torch.library.register_fake("tdx::lse_merge_")
def _(out, lse, block_out, block_lse):
    return None


def _setup_context(ctx, inputs, output):
    q, k, v, group_name, causal, scale, layout = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (group_name, causal, scale, layout)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.tdx.ring_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, *ctx.args)
    return grad_q, grad_k, grad_v, None, None, None, None


torch.library.register_autograd("tdx::ring_attention_fwd", _backward, setup_context=_setup_context)
