"""Activation recompute of a module's forward (``torch.utils.checkpoint``, non-reentrant), in place.

    recompute(block, "full")        saves the block's inputs only; its backward reruns the whole forward
    recompute(block, "selective")   saves the outputs of the communicating ops and of the GEMMs and attention
                                    kernels; its backward reruns only the rest (norms, activations, RoPE,
                                    residual adds: cheap element-wise work)

Selective recompute never repeats a collective: the outputs of every op that talks to other ranks (our ring
GEMMs, ring attention, all-to-alls, MoE dispatch / combine, vocab-parallel cross-entropy, torch's functional
collectives) are kept from the forward and handed back to the rerun. It composes with the pipeline schedules
and their weight-gradient split (the rerun happens inside B; W uses what the rerun saved), with FSDP2 (the
module's own hooks are outside the checkpoint; a module holding FSDP2 units of its own is refused: recompute the
parts around them) and with ``torch.compile``.
"""

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["RECOMPUTE_MODES", "SAVED_BY_SELECTIVE_RECOMPUTE", "recompute"]

RECOMPUTE_MODES = ("none", "selective", "full")

_tdx, _c10d, _aten = torch.ops.tdx, torch.ops._c10d_functional, torch.ops.aten
_COMMUNICATING = [
    _tdx.all_gather_matmul, _tdx.matmul_reduce_scatter, _tdx.all_gather_weight_grad, _tdx.all_gather_scaled_mm,
    _tdx.scaled_mm_reduce_scatter, _tdx.all_to_all_seq_to_heads,
    _tdx.all_to_all_heads_to_seq, _tdx.ring_attention_fwd, _tdx.moe_dispatch, _tdx.moe_combine,
    _tdx.vocab_parallel_cross_entropy_fwd, _c10d.all_reduce, _c10d.all_gather_into_tensor,
    _c10d.reduce_scatter_tensor, _c10d.all_to_all_single, _c10d.wait_tensor,
]
_COMPUTE_BOUND = [
    _aten.mm, _aten.addmm, _aten.bmm, _aten._scaled_mm, _tdx.moe_grouped_mm, _tdx.document_attention_fwd,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
]
# The op overloads whose outputs selective recompute keeps.
SAVED_BY_SELECTIVE_RECOMPUTE = frozenset(op.default if hasattr(op, "default") else op
                                         for op in _COMMUNICATING + _COMPUTE_BOUND)


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_BY_SELECTIVE_RECOMPUTE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def recompute(module: nn.Module, mode: str) -> nn.Module:
    """Wraps ``module.forward`` (in place: names, parameters and hooks unchanged) in activation recompute of
    ``mode`` (one of ``RECOMPUTE_MODES``; "none" leaves it as it is). Returns ``module``."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if mode == "none":
        return module
    nested = [name for name, child in module.named_modules() if name and isinstance(child, FSDPModule)]
    if nested:
        raise ValueError(f"module holds FSDP2 units of its own ({', '.join(nested)}): their hooks would run inside "
                         f"the checkpoint and again in its rerun, in whatever state FSDP2 is in by then. Recompute "
                         f"the parts around them instead")
    forward = module.forward
    context_fn = _selective_contexts if mode == "selective" else None

    @functools.wraps(forward)
    def recomputed(*args, **kwargs):
        extra = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = recomputed
    return module
