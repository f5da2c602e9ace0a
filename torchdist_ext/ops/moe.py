"""Mixture-of-experts token exchange and permutation over an expert-parallel group of n ranks holding
``num_experts / n`` experts each (``tdx::moe_dispatch`` family): tokens to the ranks of their experts and back,
rows sorted expert-major for the experts' GEMMs and back.

    rows, ids, row_weights, counts = moe_dispatch(x, expert_ids, weights, E, -1, group_name)   # -1: dropless
    sorted_rows, positions, offsets = moe_permute(rows, ids, counts[1, :, 1:].sum(0), E // n, -1)
    y = moe_unpermute(experts(sorted_rows, offsets), positions, row_weights)
    out, _ = moe_combine(y, None, expert_ids, counts, E, -1, group_name)                      # x's tokens
"""

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _get_group_size_by_name

__all__ = ["moe_combine", "moe_dispatch", "moe_grouped_mm", "moe_permute", "moe_unpermute"]

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def moe_dispatch(x: Tensor, expert_ids: Tensor, weights: Tensor, num_experts: int, rows_per_rank: int,
                 group_name: str, counts: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x [R, D], expert_ids [R, k] local, weights [R, k], counts [2, n, 1 + E/n] host)`` received here.

    Tokens ``x [T, D]`` with their slots go to the ranks of their experts, each token once per rank however many
    of its experts live there, its slots re-addressed to that rank's local experts (other ranks' slots blanked:
    -1, weight 0). ``expert_ids`` int64 ``[T, k]`` are global experts (-1: dropped); ``weights`` are fp32 (fp64
    for fp64 ``x``). ``rows_per_rank=-1`` is dropless: one small all-to-all of counts and one copy of them to
    the host size everything (under torch.compile: unbacked sizes, no graph break). ``rows_per_rank >= 0``
    exchanges exactly that many rows per rank pair, zero-padded: static shapes, no copy to the host. ``counts``
    (rows sent and received per rank, then slots per local expert) goes on to ``moe_combine``; with ``counts``
    from an earlier dispatch of the same routing, no counts are exchanged. Its gradient is ``moe_combine``.
    """
    return torch.ops.tdx.moe_dispatch(x, expert_ids, weights, num_experts, rows_per_rank, group_name, counts)


def moe_combine(y: Tensor, weights: Tensor | None, expert_ids: Tensor, counts: Tensor, num_experts: int,
                rows_per_rank: int, group_name: str) -> tuple[Tensor, Tensor]:
    """``(out [T, D], out_weights [T, k])``: rows ``y [R, D]`` and slot weights back to this rank's tokens
    (``weights`` None: ``out_weights`` is empty), the adjoint of ``moe_dispatch`` (and its gradient): a token's
    rows are summed over the ranks in rank order in fp32 (fp64 for fp64). ``expert_ids`` (the global ones given
    to ``moe_dispatch``) may keep the tokens' leading dims ``[..., k]``; ``out`` is then ``[..., D]``."""
    return torch.ops.tdx.moe_combine(y, weights, expert_ids, counts, num_experts, rows_per_rank, group_name)


def moe_permute(x: Tensor, expert_ids: Tensor, tokens_per_expert: Tensor, num_experts: int,
                capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(x_sorted [A, D], positions [R, k], offsets [E] int32)``: one row per slot, expert-major (the order
    ``torch._grouped_mm`` takes); ``moe_unpermute`` undoes it.

    Dropless (``capacity=-1``): ``tokens_per_expert`` is a host int64 ``[E]`` (A is its sum). With a
    capacity, expert e owns rows ``[e * capacity, (e + 1) * capacity)``, zero-padded.
    """
    return torch.ops.tdx.moe_permute(x, expert_ids, tokens_per_expert, num_experts, capacity)


def moe_unpermute(sorted_rows: Tensor, positions: Tensor, weights: Tensor | None) -> Tensor:
    """``y [R, D]``: ``y[r] = sum_j weights[r, j] * sorted_rows[positions[r, j]]`` (weights None: 1), accumulated
    in slot order in fp32; ``sorted_rows`` ``[A, D]`` or ``[experts, capacity, D]`` (its rows flattened)."""
    return torch.ops.tdx.moe_unpermute(sorted_rows, positions, weights)


def moe_grouped_mm(x: Tensor, weight: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """``out [A, N]``: expert e's rows of ``x [A, K]`` (expert-major, ``tokens_per_expert`` host int64 ``[E]``)
    times ``weight[e].T`` (``weight [E, N, K]``), by the host counts: the experts' GEMMs where
    ``torch._grouped_mm`` does not run (CPU, older GPUs)."""
    return torch.ops.tdx.moe_grouped_mm(x, weight, tokens_per_expert)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_rows(op: str, x: Tensor, name: str) -> None:
    """The C++ ops' shared checks, for the fake (meta) implementations."""
    torch._check(x.dim() == 2, lambda: f"{op}: {name} must be [rows, dim], got {tuple(x.shape)}")
    torch._check_type(
        x.dtype in _FLOAT_DTYPES, lambda: f"{op}: expected float32, float64, bfloat16 or float16, got {x.dtype}"
    )


def _check_group(op: str, num_experts: int, rows_per_rank: int, n: int) -> None:
    torch._check_value(
        num_experts > 0 and num_experts % n == 0,
        lambda: f"{op}: num_experts={num_experts} must be a positive multiple of the group size {n}",
    )
    torch._check_value(
        rows_per_rank >= -1, lambda: f"{op}: rows_per_rank must be -1 (dropless) or >= 0, got {rows_per_rank}"
    )


@torch.library.register_fake("tdx::moe_dispatch")
def _(x, expert_ids, weights, num_experts, rows_per_rank, group_name, counts=None):
    op = "moe_dispatch"
    _check_rows(op, x, "x")
    torch._check(
        expert_ids.dim() == 2 and expert_ids.shape[0] == x.shape[0],
        lambda: f"{op}: expert_ids must be [tokens={x.shape[0]}, top_k], got {tuple(expert_ids.shape)}",
    )
    torch._check_type(expert_ids.dtype == torch.int64, lambda: f"{op}: expert_ids must be int64, got {expert_ids.dtype}")
    torch._check(
        weights.shape == expert_ids.shape,
        lambda: f"{op}: weights {tuple(weights.shape)} must have expert_ids' shape {tuple(expert_ids.shape)}",
    )
    torch._check_type(
        weights.dtype == _acc(x.dtype),
        lambda: f"{op}: weights must be {_acc(x.dtype)} for {x.dtype} tokens, got {weights.dtype}",
    )
    n = _get_group_size_by_name(group_name)
    _check_group(op, num_experts, rows_per_rank, n)
    rows = n * rows_per_rank if rows_per_rank >= 0 else torch.library.get_ctx().new_dynamic_size()
    k = expert_ids.shape[1]
    return (x.new_empty(rows, x.shape[1]), expert_ids.new_empty(rows, k), weights.new_empty(rows, k),
            torch.empty(2, n, 1 + num_experts // n, dtype=torch.int64, device="cpu"))


@torch.library.register_fake("tdx::moe_combine")
def _(y, weights, expert_ids, counts, num_experts, rows_per_rank, group_name):
    op = "moe_combine"
    _check_rows(op, y, "y")
    torch._check(expert_ids.dim() >= 2, lambda: f"{op}: expert_ids must be [..., top_k], got {tuple(expert_ids.shape)}")
    if weights is not None:
        torch._check(
            weights.dim() == 2 and weights.shape[0] == y.shape[0] and weights.shape[1] == expert_ids.shape[1],
            lambda: f"{op}: weights {tuple(weights.shape)} must be [rows of y = {y.shape[0]}, top_k = "
            f"{expert_ids.shape[1]}]",
        )
        torch._check_type(
            weights.dtype == _acc(y.dtype),
            lambda: f"{op}: weights must be {_acc(y.dtype)} for {y.dtype} rows, got {weights.dtype}",
        )
    _check_group(op, num_experts, rows_per_rank, _get_group_size_by_name(group_name))
    out_weights = y.new_empty(expert_ids.shape if weights is not None else (0, expert_ids.shape[-1]),
                              dtype=_acc(y.dtype))
    return y.new_empty(*expert_ids.shape[:-1], y.shape[1]), out_weights


@torch.library.register_fake("tdx::moe_permute")
def _(x, expert_ids, tokens_per_expert, num_experts, capacity):
    op = "moe_permute"
    _check_rows(op, x, "x")
    torch._check(
        expert_ids.dim() == 2 and expert_ids.shape[0] == x.shape[0],
        lambda: f"{op}: expert_ids must be [tokens={x.shape[0]}, top_k], got {tuple(expert_ids.shape)}",
    )
    torch._check_value(num_experts > 0, lambda: f"{op}: num_experts must be positive, got {num_experts}")
    torch._check_value(capacity >= -1, lambda: f"{op}: capacity must be -1 (dropless) or >= 0, got {capacity}")
    rows = num_experts * capacity if capacity >= 0 else torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty(rows, x.shape[1]), torch.empty_like(expert_ids),
            torch.empty(num_experts, dtype=torch.int32, device=x.device))


def _check_slots(op: str, positions: Tensor, weights, dtype: torch.dtype) -> None:
    torch._check(positions.dim() == 2, lambda: f"{op}: positions must be [rows, top_k], got {tuple(positions.shape)}")
    torch._check_type(positions.dtype == torch.int64, lambda: f"{op}: positions must be int64, got {positions.dtype}")
    if weights is not None:
        torch._check(
            weights.shape == positions.shape,
            lambda: f"{op}: weights {tuple(weights.shape)} must have the shape of positions {tuple(positions.shape)}",
        )
        torch._check_type(
            weights.dtype == _acc(dtype), lambda: f"{op}: weights must be {_acc(dtype)} for {dtype} rows, got {weights.dtype}"
        )


@torch.library.register_fake("tdx::moe_unpermute")
def _(sorted_rows, positions, weights):
    op = "moe_unpermute"
    torch._check(
        sorted_rows.dim() >= 2,
        lambda: f"{op}: sorted must be [sorted rows, dim] (or [experts, capacity, dim]), got {tuple(sorted_rows.shape)}",
    )
    torch._check_type(
        sorted_rows.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: expected float32, float64, bfloat16 or float16, got {sorted_rows.dtype}",
    )
    _check_slots(op, positions, weights, sorted_rows.dtype)
    return sorted_rows.new_empty(positions.shape[0], sorted_rows.shape[-1])


@torch.library.register_fake("tdx::moe_unpermute_bwd")
def _(grad, sorted_rows, positions, weights):
    _check_slots("moe_unpermute_bwd", positions, weights, grad.dtype)
    grad_weights = grad.new_empty(positions.shape if weights is not None else (0,), dtype=_acc(grad.dtype))
    return torch.empty_like(sorted_rows), grad_weights


@torch.library.register_fake("tdx::moe_grouped_mm")
def _(x, weight, tokens_per_expert):
    op = "moe_grouped_mm"
    torch._check(
        x.dim() == 2 and weight.dim() == 3 and weight.shape[2] == x.shape[1],
        lambda: f"{op}: x {tuple(x.shape)} must be [rows, K] and weight {tuple(weight.shape)} [experts, N, K]",
    )
    torch._check_type(x.dtype == weight.dtype, lambda: f"{op}: x and weight must have one dtype, got {x.dtype} and "
                      f"{weight.dtype}")
    _check_tokens_per_expert(op, tokens_per_expert, weight.shape[0])
    return x.new_empty(x.shape[0], weight.shape[1])


def _check_tokens_per_expert(op: str, tokens_per_expert: Tensor, experts) -> None:
    torch._check(
        tokens_per_expert.dim() == 1 and tokens_per_expert.shape[0] == experts
        and tokens_per_expert.dtype == torch.int64 and tokens_per_expert.device.type == "cpu",
        lambda: f"{op}: tokens_per_expert must be a host int64 [experts={experts}], got "
                f"{tuple(tokens_per_expert.shape)} {tokens_per_expert.dtype} on {tokens_per_expert.device}",
    )


@torch.library.register_fake("tdx::moe_grouped_mm_wgrad")
def _(grad, x, tokens_per_expert):
    op = "moe_grouped_mm_wgrad"
    torch._check(
        grad.dim() == 2 and x.dim() == 2 and grad.shape[0] == x.shape[0],
        lambda: f"{op}: grad {tuple(grad.shape)} and x {tuple(x.shape)} must be [rows, N] and [rows, K]",
    )
    _check_tokens_per_expert(op, tokens_per_expert, tokens_per_expert.shape[0] if tokens_per_expert.dim() == 1 else 0)
    return x.new_empty(tokens_per_expert.shape[0], grad.shape[1], x.shape[1])


def _dispatch_setup(ctx, inputs, output):
    x, expert_ids, weights, num_experts, rows_per_rank, group_name, _ = inputs
    ctx.save_for_backward(expert_ids, output[3])
    ctx.args = (num_experts, rows_per_rank, group_name)
    ctx.rows_shape, ctx.slots_shape, ctx.dtype = output[0].shape, output[2].shape, output[0].dtype
    ctx.mark_non_differentiable(output[1], output[3])


def _dispatch_backward(ctx, grad_x, _grad_ids, grad_weights, _grad_counts):
    expert_ids, counts = ctx.saved_tensors
    if grad_x is None:
        grad_x = torch.zeros(ctx.rows_shape, dtype=ctx.dtype, device=expert_ids.device)
    if grad_weights is None:
        grad_weights = torch.zeros(ctx.slots_shape, dtype=_acc(ctx.dtype), device=expert_ids.device)
    gx, gw = torch.ops.tdx.moe_combine(grad_x.contiguous(), grad_weights.contiguous(), expert_ids, counts, *ctx.args)
    return gx, None, gw, None, None, None, None


def _combine_setup(ctx, inputs, output):
    y, weights, expert_ids, counts, num_experts, rows_per_rank, group_name = inputs
    ctx.save_for_backward(expert_ids, counts)
    ctx.args = (num_experts, rows_per_rank, group_name)
    ctx.out_shape, ctx.dtype, ctx.has_weights = output[0].shape, output[0].dtype, weights is not None


def _combine_backward(ctx, grad_out, grad_weights):
    expert_ids, counts = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros(ctx.out_shape, dtype=ctx.dtype, device=expert_ids.device)
    if grad_weights is None or not ctx.has_weights:
        grad_weights = torch.zeros(expert_ids.shape, dtype=_acc(ctx.dtype), device=expert_ids.device)
    k = expert_ids.shape[-1]
    gy, _, gw, _ = torch.ops.tdx.moe_dispatch(grad_out.reshape(-1, grad_out.shape[-1]).contiguous(),
                                              expert_ids.reshape(-1, k), grad_weights.reshape(-1, k).contiguous(),
                                              *ctx.args, counts)
    return gy, gw if ctx.has_weights else None, None, None, None, None, None


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1], output[2])


def _permute_backward(ctx, grad_sorted, _grad_positions, _grad_offsets):
    (positions,) = ctx.saved_tensors
    return torch.ops.tdx.moe_unpermute(grad_sorted.contiguous(), positions, None), None, None, None, None


def _unpermute_setup(ctx, inputs, output):
    sorted_rows, positions, weights = inputs
    ctx.save_for_backward(sorted_rows, positions, weights)
    ctx.has_weights = weights is not None


def _unpermute_backward(ctx, grad):
    sorted_rows, positions, weights = ctx.saved_tensors
    grad_sorted, grad_weights = torch.ops.tdx.moe_unpermute_bwd(grad.contiguous(), sorted_rows, positions,
                                                                weights if ctx.has_weights else None)
    return grad_sorted, None, grad_weights if ctx.has_weights else None


def _grouped_mm_setup(ctx, inputs, output):
    x, weight, tokens_per_expert = inputs
    ctx.save_for_backward(x, weight, tokens_per_expert)


def _grouped_mm_backward(ctx, grad):
    x, weight, tokens_per_expert = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.tdx.moe_grouped_mm(grad, weight.transpose(1, 2), tokens_per_expert)
    if ctx.needs_input_grad[1]:
        grad_weight = torch.ops.tdx.moe_grouped_mm_wgrad(grad, x, tokens_per_expert)
    return grad_x, grad_weight, None


torch.library.register_autograd("tdx::moe_grouped_mm", _grouped_mm_backward, setup_context=_grouped_mm_setup)
torch.library.register_autograd("tdx::moe_dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("tdx::moe_combine", _combine_backward, setup_context=_combine_setup)
torch.library.register_autograd("tdx::moe_permute", _permute_backward, setup_context=_permute_setup)
torch.library.register_autograd("tdx::moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup)
