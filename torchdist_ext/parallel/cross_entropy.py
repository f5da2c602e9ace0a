"""Cross-entropy over logits sharded by vocabulary (the output of a column-parallel LM head)."""

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import ops
from torchdist_ext.parallel.mesh_group import MeshGroup

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, *, tp_mesh: DeviceMesh, ignore_index: int = -100,
                                 reduction: str = "mean", inplace_backward: bool = False) -> Tensor:
    """``F.cross_entropy(full_logits, target)`` from this rank's vocab shard of the logits.

    Args:
        logits: ``[..., V/tp]``, columns ``[r * V/tp, (r+1) * V/tp)`` on tensor-parallel rank r
            (a ``ColumnParallelLinear`` LM head without gather_output).
        target: ``[...]`` int64 ids in ``[0, V)`` or ``ignore_index``, the same on every rank.
        reduction: ``"mean"`` over non-ignored targets, ``"sum"``, or ``"none"``.
        inplace_backward: write the logits' gradient over ``logits`` in the backward
            (one logits-sized buffer less at the step's peak); only when nothing else
            needs ``logits`` afterwards (see ``torchdist_ext.ops.vocab_parallel_cross_entropy_fwd``).
    Returns:
        The loss, identical on every rank of ``tp_mesh``; the gradient flows to
        each rank's logits shard. Full-vocab logits are never built.
    """
    tp = MeshGroup.of(tp_mesh)
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if not isinstance(target, Tensor) or target.dtype != torch.int64:
        raise TypeError(f"target must be an int64 tensor, got {getattr(target, 'dtype', type(target))}")
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target has shape {tuple(target.shape)}; it must be logits' shape without the vocab dim, "
            f"{tuple(logits.shape[:-1])}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    vocab_local = logits.shape[-1]
    loss, _ = ops.vocab_parallel_cross_entropy_fwd(
        logits, target, tp.rank * vocab_local, vocab_local * tp.size, ignore_index, tp.name, inplace_backward
    )
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
