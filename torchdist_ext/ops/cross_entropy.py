"""Vocab-parallel softmax cross-entropy (``tdx::vocab_parallel_cross_entropy_fwd`` family).

Each rank holds the logits of one vocab shard; a fused kernel computes the
shard's per-row max, sum of exponentials and target logit in one read of the
logits, one all-gather of those three numbers per row combines them, and the
backward is a purely local kernel. No rank ever holds full-vocab logits.
"""

import torch
from torch import Tensor

__all__ = ["vocab_parallel_cross_entropy_fwd"]

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def vocab_parallel_cross_entropy_fwd(
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
            Another value raises a ``ValueError`` while index checks are on
            (``torchdist_ext.set_index_checks``; on a GPU the check costs one sync),
            else gives its row a NaN loss and gradient.
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
    return torch.ops.tdx.vocab_parallel_cross_entropy_fwd(
        logits, target, vocab_start, vocab_size, ignore_index, group_name, inplace_backward
    )


def _stats_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_logits_and_target(op: str, logits: Tensor, target: Tensor) -> None:
    """The C++ op's checks, for the fake (meta) implementations."""
    torch._check(logits.dim() >= 1, lambda: f"{op}: logits must have a vocab dim, got a 0-d tensor")
    torch._check_type(
        logits.dtype in _FLOAT_DTYPES, lambda: f"{op}: expected float32, float64, bfloat16 or float16, got {logits.dtype}"
    )
    torch._check_type(target.dtype == torch.int64, lambda: f"{op}: target must be int64, got {target.dtype}")
    torch._check(
        target.shape == logits.shape[:-1],
        lambda: f"{op}: target shape {tuple(target.shape)} must equal logits shape without its last dim, "
        f"{tuple(logits.shape)}",
    )
    torch._check(
        target.device == logits.device,
        lambda: f"{op}: target and logits must be on the same device, got {target.device} and {logits.device}",
    )


def _check_backward_args(op: str, grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor) -> None:
    _check_logits_and_target(op, logits, target)
    torch._check(
        grad_loss.shape == target.shape and lse.shape == target.shape,
        lambda: f"{op}: grad_loss {tuple(grad_loss.shape)} and lse {tuple(lse.shape)} must have the target's "
        f"shape {tuple(target.shape)}",
    )
    torch._check_type(
        grad_loss.dtype == logits.dtype,
        lambda: f"{op}: grad_loss dtype {grad_loss.dtype} must equal the logits dtype {logits.dtype}",
    )
    torch._check_type(
        lse.dtype == _stats_dtype(logits),
        lambda: f"{op}: lse must be {_stats_dtype(logits)} for {logits.dtype} logits, got {lse.dtype}",
    )


@torch.library.register_fake("tdx::vocab_parallel_cross_entropy_fwd")
def _(logits, target, vocab_start, vocab_size, ignore_index, group_name, inplace_backward=False):
    op = "vocab_parallel_cross_entropy_fwd"
    _check_logits_and_target(op, logits, target)
    vocab_local = logits.shape[-1]
    torch._check(
        vocab_start >= 0 and vocab_start + vocab_local <= vocab_size,
        lambda: f"{op}: the shard [vocab_start={vocab_start}, vocab_start + {vocab_local}) must lie inside "
        f"[0, vocab_size={vocab_size})",
    )
    return logits.new_empty(target.shape), logits.new_empty(target.shape, dtype=_stats_dtype(logits))


@torch.library.register_fake("tdx::vocab_parallel_cross_entropy_bwd")
def _(grad_loss, logits, target, lse, vocab_start, ignore_index):
    _check_backward_args("vocab_parallel_cross_entropy_bwd", grad_loss, logits, target, lse)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("tdx::vocab_parallel_cross_entropy_bwd_")
def _(grad_loss, logits, target, lse, vocab_start, ignore_index):
    op = "vocab_parallel_cross_entropy_bwd_"
    _check_backward_args(op, grad_loss, logits, target, lse)
    torch._check(logits.is_contiguous(), lambda: f"{op}: logits must be contiguous to take the gradient in place")
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
        torch.ops.tdx.vocab_parallel_cross_entropy_bwd_(*args)
        # The dispatcher does not version C++ ops' mutations: without this, a later
        # backward that saved the logits would read the gradient silently.
        torch.autograd.graph.increment_version(logits)
        grad_logits = logits
    else:
        grad_logits = torch.ops.tdx.vocab_parallel_cross_entropy_bwd(*args)
    return grad_logits, None, None, None, None, None, None


torch.library.register_autograd("tdx::vocab_parallel_cross_entropy_fwd", _backward, setup_context=_setup_context)
