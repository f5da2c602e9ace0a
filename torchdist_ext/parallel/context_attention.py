"""Context-parallel attention: ring, Ulysses (all-to-all) and their 2-D hybrid.

Attention tensors are ``[batch, heads, seq_local, head_dim]`` (the SDPA layout),
this rank's shard of the sequence (see ``shard_sequence``); ``k``/``v`` may
have fewer heads than ``q`` (GQA / MQA, ``q_heads % kv_heads == 0``). The
output is laid out like ``q``. For every layout, unsharding the output of the
sharded computation equals ``F.scaled_dot_product_attention`` on the full
sequence, forward and gradients.

    ring_attention     K/V blocks circulate the ring (at kv heads), overlapped with the
                       block attention; any head count; "contiguous" or "zigzag" shards.
    ulysses_attention  one all-to-all makes each rank hold H/N heads of the whole
                       sequence, local attention, one all-to-all back; "contiguous" shards;
                       q heads divisible by N.
    hybrid_attention   Ulysses over ``ulysses_mesh`` inside, ring over ``ring_mesh`` outside;
                       shard with ``shard_sequence(x, cp_mesh=(ulysses_mesh, ring_mesh), ...)``.
"""

import math

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import ops
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.sequence_sharding import check_layout

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention"]


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be [batch, heads, seq_local, head_dim]")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
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


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, cp_mesh: DeviceMesh, causal: bool = False,
                   scale: float | None = None, layout: str = "zigzag") -> Tensor:
    """Attention of this rank's sequence shard over the whole sequence, K/V passed around ``cp_mesh``."""
    _check_qkv(q, k, v)
    check_layout(layout)
    group = MeshGroup.of(cp_mesh, "cp_mesh")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(
            f"the zigzag layout gives every rank two equal chunks, so the local sequence must be even, "
            f"got q.shape[2]={q.shape[2]}"
        )
    out, _ = ops.ring_attention(q, k, v, group.name, bool(causal), _scale(q, scale), layout)
    return out


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


def _ulysses(q: Tensor, k: Tensor, v: Tensor, group: MeshGroup, arg: str, attend) -> Tensor:
    k, v = _kv_for_ulysses(k, v, q.shape[1], group, arg)
    to_heads = [ops.all_to_all_seq_to_heads(t, group.name) for t in (q, k, v)]
    return ops.all_to_all_heads_to_seq(attend(*to_heads), group.name)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, sp_mesh: DeviceMesh, causal: bool = False,
                      scale: float | None = None) -> Tensor:
    """Attention via one all-to-all to head shards over ``sp_mesh`` and one back (contiguous layout)."""
    _check_qkv(q, k, v)
    group = MeshGroup.of(sp_mesh, "sp_mesh")

    def local_attention(q_h, k_h, v_h):
        # A branch, not an expression: compiled with dynamic shapes, the head counts are symbolic and SDPA
        # takes only a plain bool.
        grouped = True if k_h.shape[1] != q_h.shape[1] else False
        return F.scaled_dot_product_attention(
            q_h, k_h, v_h, is_causal=bool(causal), scale=_scale(q, scale), enable_gqa=grouped
        )

    return _ulysses(q, k, v, group, "sp_mesh", local_attention)


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, ulysses_mesh: DeviceMesh, ring_mesh: DeviceMesh,
                     causal: bool = False, scale: float | None = None, layout: str = "zigzag") -> Tensor:
    """Ulysses over ``ulysses_mesh`` around ring attention over ``ring_mesh`` (a 2-D context-parallel mesh).

    Shard inputs with ``shard_sequence(x, cp_mesh=(ulysses_mesh, ring_mesh), dim=2, layout=layout)``.
    """
    _check_qkv(q, k, v)
    check_layout(layout)
    group = MeshGroup.of(ulysses_mesh, "ulysses_mesh")
    MeshGroup.of(ring_mesh, "ring_mesh")

    def ring(q_h, k_h, v_h):
        return ring_attention(q_h, k_h, v_h, cp_mesh=ring_mesh, causal=causal, scale=_scale(q, scale), layout=layout)

    return _ulysses(q, k, v, group, "ulysses_mesh", ring)
