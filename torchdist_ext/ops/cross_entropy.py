"""Vocab-parallel softmax cross-entropy (``tdx::vocab_parallel_cross_entropy`` family).

Each rank holds the logits of one vocab shard; a fused kernel computes the
shard's per-row max, sum of exponentials and target logit in one read of the
logits, one all-gather of those three numbers per row combines them, and the
backward is a purely local kernel. No rank ever holds full-vocab logits.
"""

import torch
from torch import Tensor

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int,
    group_name: str,
    inplace_backward: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy of vocab-sharded logits.

    Args:
        logits: ``[..., V_local]``, columns ``[vocab_start, vocab_start + V_local)`` of a
            ``vocab_size`` vocabulary (float32/64, bfloat16, float16).
        target: ``[...]`` int64 class indices in ``[0, vocab_size)`` or ``ignore_index``.
        inplace_backward: the backward writes the logits' gradient over ``logits``
            (when contiguous) instead of a new tensor, saving one logits-sized buffer
            at the peak of the step, as Megatron does. ``logits`` then holds its
            gradient after backward; a second autograd use of it fails loudly
            ("modified by an inplace operation"). Under torch.compile the
            gradient is out of place (the compiler plans the buffers).
    Returns:
        ``(loss, lse)``, both ``[...]``: ``loss`` in the logits' dtype (0 where the
        target is ``ignore_index``); ``lse`` the full-vocab log-sum-exp in fp32
        (fp64 for fp64 logits). The loss is the same on every rank of the group.
    """
    return torch.ops.tdx.vocab_parallel_cross_entropy(
        logits, target, vocab_start, vocab_size, ignore_index, group_name, inplace_backward
    )


def _stats_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.library.register_fake("tdx::vocab_parallel_cross_entropy")
def _(logits, target, vocab_start, vocab_size, ignore_index, group_name, inplace_backward=False):
    return logits.new_empty(target.shape), logits.new_empty(target.shape, dtype=_stats_dtype(logits))


@torch.library.register_fake("tdx::vocab_parallel_cross_entropy_backward")
def _(grad_loss, logits, target, lse, vocab_start, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("tdx::vocab_parallel_cross_entropy_backward_")
def _(grad_loss, logits, target, lse, vocab_start, ignore_index):
    return None


def _setup_context(ctx, inputs, output):
    logits, target, vocab_start, _, ignore_index, _, *inplace = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.vocab_start = vocab_start
    ctx.ignore_index = ignore_index
    ctx.inplace_backward = bool(inplace and inplace[0])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_loss, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    args = (grad_loss.contiguous(), logits, target, lse, ctx.vocab_start, ctx.ignore_index)
    if ctx.inplace_backward and logits.is_contiguous() and not torch.compiler.is_compiling():
        torch.ops.tdx.vocab_parallel_cross_entropy_backward_(*args)
        # The dispatcher does not version C++ ops' mutations: without this, a later
        # backward that saved the logits would read the gradient silently.
        torch.autograd.graph.increment_version(logits)
        grad_logits = logits
    else:
        grad_logits = torch.ops.tdx.vocab_parallel_cross_entropy_backward(*args)
    return grad_logits, None, None, None, None, None, None


torch.library.register_autograd(
    "tdx::vocab_parallel_cross_entropy", _backward, setup_context=_setup_context
)
