"""Context-parallel attention: ring, Ulysses (all-to-all) and their 2-D hybrid, on this rank's shard of the
sequence. For every order, unsharding the output equals ``F.scaled_dot_product_attention`` on the full
sequence, forward and gradients.

    q, k, v = (shard_sequence(t, cp_mesh=mesh["cp"], dim=2) for t in (q_full, k_full, v_full))
    out = ring_attention(q, k, v, cp_mesh=mesh["cp"], causal=True)   # [batch, heads, seq_local, head_dim]

How each method communicates: docs/architecture.md, "Context parallelism".
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import ops
from torchdist_ext.agreement import check_agreement
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.regions import gather_from_region
from torchdist_ext.parallel.sequence_sharding import check_order, context_parallel_groups, unshard_sequence

__all__ = ["hybrid_attention", "ring_attention", "ulysses_attention"]


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be [batch, heads, seq_local, head_dim]")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.shape[1] < 1 or t.shape[3] < 1:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it needs at least one head and head_dim >= 1")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local sequence and head_dim"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")


def _check_token_rows(rows: Tensor | None, q: Tensor, name: str) -> None:
    """document_ids and positions: None, or this rank's [batch, seq_local] integers on q's device."""
    if rows is None:
        return
    if not isinstance(rows, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(rows).__name__}")
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {rows.dtype}")
    if tuple(rows.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"{name} has shape {tuple(rows.shape)}; it must be [batch, seq_local] = "
            f"[{q.shape[0]}, {q.shape[2]}], this rank's shard (shard_sequence or a SequencePlan's shard, dim=1)"
        )
    if rows.device != q.device:
        raise ValueError(f"{name} is on {rows.device}; it must be on q's device {q.device}")


def _check_document_ids(document_ids: Tensor | None, q: Tensor) -> None:
    _check_token_rows(document_ids, q, "document_ids")


def _resolve_order(order: str | None, positions: Tensor | None) -> str:
    """The order the sequence was cut in: ``order`` (default "zigzag"), or "contiguous" rows carrying their
    ``positions``."""
    if positions is None:
        return "zigzag" if order is None else order
    if order is not None:
        raise ValueError(f"order={order!r} and positions are exclusive: a plan's positions replace the order")
    return "contiguous"


def _check_zigzag(q: Tensor, order: str) -> None:
    if order == "zigzag" and q.shape[2] % 2:
        raise ValueError(
            f"the zigzag order gives every rank two equal chunks, so the local sequence must be even, "
            f"got q.shape[2]={q.shape[2]}"
        )


def _check_call(q, k, v, order, document_ids, positions, even_zigzag: bool = True) -> None:
    _check_qkv(q, k, v)
    if order is not None:
        check_order(order)
    _check_document_ids(document_ids, q)
    _check_token_rows(positions, q, "positions")
    order = _resolve_order(order, positions)
    if even_zigzag:
        _check_zigzag(q, order)


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _one_dim(cp_mesh: DeviceMesh, function: str) -> MeshGroup:
    ring, ulysses = context_parallel_groups(cp_mesh)
    if ulysses is not None:
        raise ValueError(f"{function} takes a 1-D cp_mesh; a 2-D [ring, ulysses] mesh is for hybrid_attention")
    return ring


def _agree(group: MeshGroup, function: str, q, k, v, causal, scale, order, document_ids, positions,
           validate) -> None:
    """Runs ``validate`` and the rank-agreement check over ``group`` on the call: the all-to-alls carry the
    tensors' shapes and dtypes but not ``causal``, ``scale``, the document ids or the positions, which must
    agree as well (and an all-gather of the ids on some ranks only would cross the all-to-alls)."""
    fields = {"q": q, "k": k, "v": v, "causal": causal, "scale": scale, "order": order,
              "document_ids": document_ids, "positions": positions}
    check_agreement(group.name, function, fields, validate)


def _ring(q: Tensor, k: Tensor, v: Tensor, group: MeshGroup, causal: bool, scale: float, order: str,
          document_ids: Tensor | None, positions: Tensor | None) -> Tensor:
    out, _ = ops.ring_attention_fwd(q, k, v, group.name, bool(causal), scale, order, document_ids, positions)
    return out


def _local_documents(document_ids: Tensor, causal: bool, scale: float, positions: Tensor | None = None):
    """Attention of a head shard of the whole sequence over the documents ``document_ids`` [batch, seq] (by
    ``positions`` [batch, seq] when given, else by row order)."""

    def attend(q_h: Tensor, k_h: Tensor, v_h: Tensor) -> Tensor:
        out, _ = ops.document_attention_fwd(q_h, k_h, v_h, document_ids, bool(causal), scale, positions)
        return out

    return attend


def _local_sdpa(causal: bool, scale: float):
    def attend(q_h: Tensor, k_h: Tensor, v_h: Tensor) -> Tensor:
        # A branch, not an expression: compiled with dynamic shapes, the head counts are symbolic and SDPA
        # takes only a plain bool.
        grouped = True if k_h.shape[1] != q_h.shape[1] else False
        return F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=bool(causal), scale=scale, enable_gqa=grouped)

    return attend


def _kv_for_ulysses(k: Tensor, v: Tensor, q_heads: int, group: MeshGroup, arg: str) -> tuple[Tensor, Tensor]:
    """K/V with a head count the all-to-all can split: replicate the fewest kv heads needed."""
    n, kv_heads = group.size, k.shape[1]
    if q_heads % n:
        raise ValueError(f"q heads ({q_heads}) must be divisible by the size of {arg} ({n})")
    if kv_heads % n == 0:
        return k, v
    if n % kv_heads:
        raise ValueError(
            f"kv heads ({kv_heads}) must divide or be divisible by the size of {arg} ({n}) "
            "so that every rank gets whole kv heads"
        )
    copies = n // kv_heads  # each rank gets one kv head: the one its q heads use
    return k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)


def _ulysses(q: Tensor, k: Tensor, v: Tensor, group: MeshGroup, arg: str, order: str, attend) -> Tensor:
    k, v = _kv_for_ulysses(k, v, q.shape[1], group, arg)
    to_heads = [ops.all_to_all_seq_to_heads(t, group.name, order) for t in (q, k, v)]
    return ops.all_to_all_heads_to_seq(attend(*to_heads), group.name, order)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, cp_mesh: DeviceMesh, causal: bool = False,
                   scale: float | None = None, order: str | None = None, document_ids: Tensor | None = None,
                   positions: Tensor | None = None) -> Tensor:
    """Attention of this rank's sequence shard over the whole sequence: K/V blocks circulate the ring of the 1-D
    ``cp_mesh`` (at kv heads), overlapped with the block attention; any head count.

    Args:
        q: ``[batch, q_heads, seq_local, head_dim]`` (the SDPA layout), floating point: this rank's shard of the
            sequence, made by ``shard_sequence`` with the same ``cp_mesh`` and ``order`` (``seq_local`` even for
            zigzag).
        k: ``[batch, kv_heads, seq_local, head_dim]``, q's dtype; ``kv_heads`` divides ``q_heads`` (GQA / MQA).
        v: shaped like ``k``.
        cp_mesh: 1-D DeviceMesh of the context-parallel ranks.
        causal: each token attends only to tokens at or before its position in the full sequence.
        scale: the softmax scale (None: ``1 / sqrt(head_dim)``).
        order: how ``shard_sequence`` cut the sequence over the ranks: "zigzag" (the default: rank r holds chunks
            r and 2N-1-r of 2N; balances one causal document) or "contiguous" (block r of N). Not with
            ``positions``.
        document_ids: None, or ``[batch, seq_local]`` integers: the documents of this rank's tokens, cut by
            ``shard_sequence`` exactly like the tokens (same ``cp_mesh`` and ``order``, ``dim=1``). A token
            attends only to tokens of its own document (and, with ``causal``, only to earlier ones); a negative
            id marks padding, whose output and gradients are exactly 0. The ring skips blocks that no document
            spans (``ops.context_attention_work`` reports the per-rank work of a document mix); the ids may
            change every step without a recompile.
        positions: None, or ``[batch, seq_local]`` integers: the global positions of this rank's tokens, from a
            ``SequencePlan`` (``plan.positions(cp_mesh=...)``, with q, k, v, ids cut by ``plan.shard``), which
            balances packed documents over the ranks. The causal mask compares positions; they may change every
            step without a recompile.

    Returns:
        ``[batch, q_heads, seq_local, head_dim]``, laid out like ``q``.
    """
    group = _one_dim(cp_mesh, "ring_attention")
    # This rank's checks run inside the agreement, so that a refusal stops every rank (the op's own agreement
    # comes after them).
    _agree(group, "ring_attention", q, k, v, causal, scale, order, document_ids, positions,
           lambda: _check_call(q, k, v, order, document_ids, positions))
    return _ring(q, k, v, group, causal, _scale(q, scale), _resolve_order(order, positions), document_ids, positions)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, cp_mesh: DeviceMesh, causal: bool = False,
                      scale: float | None = None, order: str | None = None,
                      document_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """Attention via one all-to-all to head shards over the 1-D ``cp_mesh`` and one back.

    The all-to-all makes each rank hold H/N of the heads for the whole sequence, in sequence order whatever
    ``order`` cut it, so causal attention is plain causal SDPA on every rank; with ``document_ids`` the ids
    are all-gathered (in order) and each rank attends document by document; with ``positions`` the rows stay in
    the ranks' order and the gathered positions mask them.

    Arguments and result as ``ring_attention``'s, with q heads divisible by the size N of ``cp_mesh`` and kv
    heads dividing N or divisible by it (too few kv heads are replicated as little as needed).
    """
    group = _one_dim(cp_mesh, "ulysses_attention")
    _agree(group, "ulysses_attention", q, k, v, causal, scale, order, document_ids, positions,
           lambda: _check_call(q, k, v, order, document_ids, positions))
    order = _resolve_order(order, positions)
    if positions is not None:
        ids = torch.zeros_like(positions) if document_ids is None else document_ids
        attend = _local_documents(gather_from_region(ids, group, 1), causal, _scale(q, scale),
                                  gather_from_region(positions, group, 1))
    elif document_ids is None:
        attend = _local_sdpa(causal, _scale(q, scale))
    else:
        attend = _local_documents(unshard_sequence(document_ids, cp_mesh=cp_mesh, dim=1, order=order), causal,
                                  _scale(q, scale))
    return _ulysses(q, k, v, group, "cp_mesh", order, attend)


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, cp_mesh: DeviceMesh, causal: bool = False,
                     scale: float | None = None, order: str | None = None,
                     document_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """Ulysses over dim 1 of the 2-D ``cp_mesh`` ``[ring, ulysses]`` around ring attention over dim 0.

    ``order`` cuts the sequence over the ring ranks; each ring shard is split contiguously over the
    Ulysses ranks (``shard_sequence`` with the same 2-D ``cp_mesh`` does both; so does a "hybrid"
    ``SequencePlan``'s ``shard``, whose ``positions`` replace the order).

    Arguments and result as ``ring_attention``'s, with ``cp_mesh`` 2-D ``[ring, ulysses]`` (e.g.
    ``world_mesh["ring", "ulysses"]``) and the head counts as ``ulysses_attention`` needs them over dim 1.
    """
    ring, ulysses = context_parallel_groups(cp_mesh)
    if ulysses is None:
        raise ValueError(
            f"hybrid_attention takes a 2-D cp_mesh [ring, ulysses] (e.g. world_mesh['ring', 'ulysses']), "
            f"got a 1-D mesh of size {ring.size}"
        )
    # Agreed within each Ulysses group, then the verdict over the ring: a refusal in one Ulysses group stops
    # the ranks of the others too, which would otherwise wait in the ring for it.
    refusal = None
    try:
        _agree(ulysses, "hybrid_attention", q, k, v, causal, scale, order, document_ids, positions,
               lambda: _check_call(q, k, v, order, document_ids, positions, even_zigzag=False))
    except (ValueError, TypeError, RuntimeError) as error:
        refusal = error

    def carry_refusal() -> None:
        if refusal is not None:
            raise refusal

    check_agreement(ring.name, "hybrid_attention", {}, carry_refusal)
    scale = _scale(q, scale)
    order = _resolve_order(order, positions)
    # The ids and positions of this ring rank's shard: the Ulysses ranks' contiguous pieces, in order.
    ring_ids = None if document_ids is None else gather_from_region(document_ids, ulysses, 1)
    ring_positions = None if positions is None else gather_from_region(positions, ulysses, 1)

    def ring_over_heads(q_h: Tensor, k_h: Tensor, v_h: Tensor) -> Tensor:
        _check_zigzag(q_h, order)
        return _ring(q_h, k_h, v_h, ring, causal, scale, order, ring_ids, ring_positions)

    return _ulysses(q, k, v, ulysses, "cp_mesh dim 1 (ulysses)", "contiguous", ring_over_heads)
