"""Ring attention over a sequence-sharded group (``tdx::ring_attention_fwd`` family), document attention on one
rank's whole sequence, and the log-sum-exp merge of partial attention results (``tdx::lse_merge_``, our fused
kernel).

    out, lse = ring_attention_fwd(q, k, v, cp_mesh.get_group().group_name, True, q.shape[-1] ** -0.5, "zigzag")
"""

import torch
from torch import Tensor

__all__ = [
    "balanced_sequence_plan", "context_attention_work", "document_attention_fwd", "lse_merge_", "ring_attention_fwd",
]

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_ORDERS = ("contiguous", "zigzag")


def ring_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, scale: float, order: str,
    document_ids: Tensor | None = None, positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: attention of this rank's queries over the whole sequence.

    ``q``, ``k``, ``v`` are in the SDPA layout ``[batch, heads, seq_local, head_dim]``: this rank's shard of
    the sequence in ``order`` ("contiguous": rank r holds chunk r of N; "zigzag": chunks r and 2N-1-r of 2N).
    ``k``/``v`` may have fewer heads than ``q`` (a divisor); they travel the ring at kv heads while the current
    block is computed, and partial results merge by log-sum-exp (``lse_merge_``). ``document_ids``
    ``[batch, seq_local]`` (any integer dtype), sharded like the tokens, are the tokens' documents: a token
    attends only to tokens of its own document; a negative id is padding, whose output and gradients are
    exactly 0; blocks that no document spans are skipped. ``positions`` ``[batch, seq_local]`` (any integer
    dtype; ``order`` then "contiguous") are the tokens' global positions, a balanced sequence plan's shard: a
    query sees the keys of its document at positions at or before its own.

    ``out`` is laid out like ``q``; ``lse`` is ``[batch, q_heads, seq_local]`` (fp32,
    fp64 for fp64 inputs; -inf on padding rows) and carries no gradient.
    """
    return torch.ops.tdx.ring_attention_fwd(q, k, v, group_name, causal, scale, order, document_ids, positions)


def document_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor, causal: bool, scale: float,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: attention over the whole local sequence ``[batch, heads, seq, head_dim]``, each token
    over its own document (``document_ids`` ``[batch, seq]``; a negative id is padding, whose output and
    gradients are exactly 0), causal or not, by row order or by ``positions`` ``[batch, seq]``: the same masked
    attention as ``ring_attention_fwd`` on one rank (Ulysses' local attention)."""
    return torch.ops.tdx.document_attention_fwd(q, k, v, document_ids, causal, scale, positions)


def context_attention_work(document_ids: Tensor, ranks: int, order: str, causal: bool) -> Tensor:
    """``[ranks, ranks]`` int64 (CPU): the attention scores (query, key pairs over the batch, per head) that
    ring rank r computes for the key block of rank s, for ``document_ids`` ``[batch, seq]`` of the whole
    sequence in order. Row sums are the per-rank work; zeros are skipped blocks."""
    if isinstance(ranks, bool) or not isinstance(ranks, int):
        raise TypeError(f"ranks must be an int, got {type(ranks).__name__}")
    return torch.ops.tdx.context_attention_work(document_ids, ranks, order, causal)


def balanced_sequence_plan(document_ids: Tensor, ranks: int) -> tuple[Tensor, Tensor]:
    """``(indices [batch, ranks, seq / ranks], costs [batch, ranks])``, int64 on the CPU: per row of
    ``document_ids`` ``[batch, seq]``, the global positions each rank holds (ascending) and its causal attention
    work, every rank holding ``seq / ranks`` tokens and about the same work (the algorithm and its bound:
    csrc/ops/sequence_plan.h). ``torchdist_ext.parallel.balanced_sequence_plan`` is the user's face."""
    if isinstance(ranks, bool) or not isinstance(ranks, int):
        raise TypeError(f"ranks must be an int, got {type(ranks).__name__}")
    return torch.ops.tdx.balanced_sequence_plan(document_ids, ranks)


def lse_merge_(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merges a partial attention result into ``(out, lse)`` in place, weighting both by log-sum-exp.

    ``out`` ``[..., rows, D]`` and ``lse`` ``[..., rows]`` in fp32 (fp64 for fp64 blocks);
    ``block_out`` the same shape in any float dtype, ``block_lse`` like ``lse``. Rows
    with ``lse = -inf`` hold nothing yet and take the block as is.
    """
    torch.ops.tdx.lse_merge_(out, lse, block_out, block_lse)


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor, order: str) -> None:
    """The C++ op's checks, for the fake (meta) implementations."""
    torch._check_value(order in _ORDERS, lambda: f"{op}: order must be 'contiguous' or 'zigzag', got {order!r}")
    torch._check(
        q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
        lambda: f"{op}: q, k, v must be [batch, heads, seq, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
        f"{tuple(v.shape)}",
    )
    torch._check(k.shape == v.shape, lambda: f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    torch._check(
        q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.shape[3] == k.shape[3],
        lambda: f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local sequence and head_dim",
    )
    torch._check(
        k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
        lambda: f"{op}: q heads ({q.shape[1]}) must be a positive multiple of kv heads ({k.shape[1]})",
    )
    torch._check(q.shape[3] > 0, lambda: f"{op}: head_dim must be positive, got {q.shape[3]}")
    torch._check_type(
        q.dtype == k.dtype == v.dtype, lambda: f"{op}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    )
    torch._check(q.device == k.device == v.device, lambda: f"{op}: q, k, v must be on one device")
    torch._check_type(
        q.dtype in _FLOAT_DTYPES, lambda: f"{op}: expected float32, float64, bfloat16 or float16, got {q.dtype}"
    )
    torch._check(
        order == "contiguous" or q.shape[2] % 2 == 0,
        lambda: f"{op}: the zigzag order needs an even local sequence (two chunks per rank), got {q.shape[2]}",
    )
    torch._check_type(
        q.device.type != "cuda" or q.dtype != torch.float64,
        lambda: "ring_attention / document_attention on CUDA: float64 is not supported by the block kernels; use "
        "float32, bfloat16 or float16",
    )


def _check_token_rows(op: str, name: str, rows: Tensor | None, q: Tensor) -> None:
    """document_ids and positions: [batch, seq_local] integers on q's device."""
    if rows is None:
        return
    torch._check_type(
        not rows.dtype.is_floating_point and not rows.dtype.is_complex and rows.dtype != torch.bool,
        lambda: f"{op}: {name} must be an integer tensor, got {rows.dtype}",
    )
    torch._check(
        rows.dim() == 2 and rows.shape[0] == q.shape[0] and rows.shape[1] == q.shape[2],
        lambda: f"{op}: {name} {list(rows.shape)} must be [batch, seq_local] = [{q.shape[0]}, {q.shape[2]}]",
    )
    torch._check(rows.device == q.device, lambda: f"{op}: {name} must be on q's device ({q.device}), got {rows.device}")


def _check_document_ids(op: str, ids: Tensor | None, q: Tensor) -> None:
    _check_token_rows(op, "document_ids", ids, q)


def _check_positions(op: str, positions: Tensor | None, q: Tensor, order: str) -> None:
    _check_token_rows(op, "positions", positions, q)
    torch._check_value(
        positions is None or order == "contiguous",
        lambda: f"{op}: with positions the order must be 'contiguous' (the positions replace it), got {order!r}",
    )


def _forward_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        q.shape[:3], dtype=_accumulation_dtype(q)
    )


@torch.library.register_fake("tdx::ring_attention_fwd")
def _(q, k, v, group_name, causal, scale, order, document_ids=None, positions=None):
    _check_qkv("ring_attention_fwd", q, k, v, order)
    _check_document_ids("ring_attention_fwd", document_ids, q)
    _check_positions("ring_attention_fwd", positions, q, order)
    return _forward_outputs(q)


@torch.library.register_fake("tdx::document_attention_fwd")
def _(q, k, v, document_ids, causal, scale, positions=None):
    _check_qkv("document_attention_fwd", q, k, v, "contiguous")
    _check_document_ids("document_attention_fwd", document_ids, q)
    _check_positions("document_attention_fwd", positions, q, "contiguous")
    return _forward_outputs(q)


def _check_backward(op, grad_out, q, k, v, out, lse, order, document_ids, positions):
    _check_qkv(op, q, k, v, order)
    _check_document_ids(op, document_ids, q)
    _check_positions(op, positions, q, order)
    torch._check(
        grad_out.shape == q.shape and out.shape == q.shape,
        lambda: f"{op}: grad_out {tuple(grad_out.shape)} and out {tuple(out.shape)} must have q's shape "
        f"{tuple(q.shape)}",
    )
    torch._check(
        lse.shape == q.shape[:3], lambda: f"{op}: lse {tuple(lse.shape)} must be [batch, q heads, seq] = {tuple(q.shape[:3])}"
    )
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


@torch.library.register_fake("tdx::ring_attention_bwd")
def _(grad_out, q, k, v, out, lse, group_name, causal, scale, order, document_ids=None, positions=None):
    return _check_backward("ring_attention_bwd", grad_out, q, k, v, out, lse, order, document_ids, positions)


@torch.library.register_fake("tdx::document_attention_bwd")
def _(grad_out, q, k, v, out, lse, document_ids, causal, scale, positions=None):
    return _check_backward("document_attention_bwd", grad_out, q, k, v, out, lse, "contiguous", document_ids,
                           positions)


@torch.library.register_fake("tdx::context_attention_work")
def _(document_ids, ranks, order, causal):
    raise ValueError("context_attention_work reads the ids' values on the host: it cannot run on meta or fake "
                     "tensors (call it outside torch.compile)")


@torch.library.register_fake("tdx::balanced_sequence_plan")
def _(document_ids, ranks):
    raise ValueError("balanced_sequence_plan reads the ids' values on the host: it cannot run on meta or fake "
                     "tensors (plan outside torch.compile, in the data path)")


@torch.library.register_fake("tdx::lse_merge_")
def _(out, lse, block_out, block_lse):
    op = "lse_merge_"
    torch._check(out.dim() >= 2, lambda: f"{op}: out must be [..., rows, dim], got {tuple(out.shape)}")
    torch._check(
        lse.shape == out.shape[:-1],
        lambda: f"{op}: lse {tuple(lse.shape)} must be out's shape without its last dim, {tuple(out.shape)}",
    )
    torch._check(
        block_out.shape == out.shape and block_lse.shape == lse.shape,
        lambda: f"{op}: block_out {tuple(block_out.shape)} and block_lse {tuple(block_lse.shape)} must match out "
        f"{tuple(out.shape)} and lse {tuple(lse.shape)}",
    )
    torch._check_type(
        block_out.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: expected float32, float64, bfloat16 or float16, got {block_out.dtype}",
    )
    acc = _accumulation_dtype(block_out)
    torch._check_type(
        out.dtype == acc and lse.dtype == acc and block_lse.dtype == acc,
        lambda: f"{op}: out, lse and block_lse must be {acc} for a {block_out.dtype} block, got {out.dtype}, "
        f"{lse.dtype}, {block_lse.dtype}",
    )
    torch._check(
        out.device == lse.device == block_out.device == block_lse.device,
        lambda: f"{op}: out, lse, block_out and block_lse must be on one device",
    )
    torch._check(
        block_out.is_contiguous() and block_lse.is_contiguous(),
        lambda: f"{op}: block_out and block_lse must be contiguous",
    )
    torch._check(
        out.stride(-1) == 1 and (out.shape[-2] <= 1 or out.stride(-2) == out.shape[-1]) and lse.stride(-1) == 1,
        lambda: f"{op}: out rows must be dense (stride(-1) == 1, stride(-2) == dim) and lse rows contiguous",
    )
    for d in range(out.dim() - 3):
        torch._check(
            out.stride(d) == out.stride(d + 1) * out.shape[d + 1] and lse.stride(d) == lse.stride(d + 1) * lse.shape[d + 1],
            lambda: f"{op}: the leading dims of out and lse must be collapsible (a slice of rows of a contiguous tensor)",
        )
    return None


def _ring_setup_context(ctx, inputs, output):
    q, k, v, group_name, causal, scale, order, document_ids, positions = (*inputs, None, None)[:9]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, document_ids, positions)
    ctx.args = (group_name, causal, scale, order)
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, document_ids, positions = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.tdx.ring_attention_bwd(
        grad_out.contiguous(), q, k, v, out, lse, *ctx.args, document_ids, positions
    )
    return grad_q, grad_k, grad_v, None, None, None, None, None, None


def _document_setup_context(ctx, inputs, output):
    q, k, v, document_ids, causal, scale, positions = (*inputs, None)[:7]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, document_ids, positions)
    ctx.args = (causal, scale)
    ctx.mark_non_differentiable(lse)


def _document_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, document_ids, positions = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.tdx.document_attention_bwd(
        grad_out.contiguous(), q, k, v, out, lse, document_ids, *ctx.args, positions
    )
    return grad_q, grad_k, grad_v, None, None, None, None


torch.library.register_autograd("tdx::ring_attention_fwd", _ring_backward, setup_context=_ring_setup_context)
torch.library.register_autograd(
    "tdx::document_attention_fwd", _document_backward, setup_context=_document_setup_context
)
