"""Sequence-parallel GEMMs as overlapped rings (``tdx::all_gather_matmul`` family): each block's GEMM runs while
the next block (or the running sum) travels. Along the sharded dim every rank holds one equal contiguous block,
rank ``r`` the ``r``-th (``torch.chunk`` order); ``group_name`` is ``mesh.get_group().group_name``.

    out, _ = all_gather_matmul(x_block, w_up, group_name, gather_dim=1)   # AG(x) @ w_up.T
    y_block = matmul_reduce_scatter(h, w_down, group_name, scatter_dim=1)  # RS(h @ w_down.T)
"""

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _get_group_size_by_name

from torchdist_ext._collectives import reduce_scatter

__all__ = [
    "all_gather_matmul",
    "all_gather_scaled_mm",
    "all_gather_weight_grad",
    "matmul_reduce_scatter",
    "scaled_mm_reduce_scatter",
]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def all_gather_matmul(
    x: Tensor, weight: Tensor, group_name: str, gather_dim: int, return_gathered: bool = False
) -> tuple[Tensor, Tensor]:
    """``all_gather(x, gather_dim) @ weight.T``, overlapping each block's GEMM with the next block's transfer.

    Args:
        x: this rank's block ``[..., S/n, ..., in]`` along ``gather_dim`` (not the last dim).
        weight: ``[out, in]``.
    Returns:
        ``(out, gathered)``: ``out`` is ``[..., S, ..., out]``; ``gathered`` is the
        all-gathered ``x`` if ``return_gathered`` else an empty tensor.

    Gradients (``Y = AG(x) @ W.T``): ``dx = matmul_reduce_scatter(dY, W.T)``, ``dW = all_gather_weight_grad(dY, x)``.
    """
    return torch.ops.tdx.all_gather_matmul(x, weight, group_name, gather_dim, return_gathered)


def matmul_reduce_scatter(x: Tensor, weight: Tensor, group_name: str, scatter_dim: int) -> Tensor:
    """This rank's block of ``sum_over_ranks(x @ weight.T)`` along ``scatter_dim``, as a ring.

    Args:
        x: ``[..., S, ..., in]`` with ``S`` divisible by the group size.
        weight: ``[out, in]``.
    Returns:
        ``[..., S/n, ..., out]``.

    Gradients (``Y = RS(x @ W.T)``): ``dx, AG(dY) = all_gather_matmul(dY, W.T, return_gathered=True)``,
    ``dW = AG(dY).T @ x``.
    """
    return torch.ops.tdx.matmul_reduce_scatter(x, weight, group_name, scatter_dim)


def all_gather_weight_grad(dense: Tensor, shard: Tensor, group_name: str, gather_dim: int) -> Tensor:
    """``dense.flatten(0, -2).T @ all_gather(shard, gather_dim).flatten(0, -2)`` without materialising the gather.

    Args:
        dense: ``[..., S, ..., a]``, full along ``gather_dim``.
        shard: ``[..., S/n, ..., b]``, this rank's block.
    Returns:
        ``[a, b]`` (accumulated in fp32 for 16-bit inputs).

    Gradients (``G = D.T @ AG(s)``): ``dD = all_gather_matmul(s, dG)``, ``ds = matmul_reduce_scatter(D, dG.T)``.
    """
    return torch.ops.tdx.all_gather_weight_grad(dense, shard, group_name, gather_dim)


def all_gather_scaled_mm(x: Tensor, mat2: Tensor, scale_x: Tensor, scale_mat2: Tensor, out_dtype: torch.dtype,
                         group_name: str, gather_dim: int) -> tuple[Tensor, Tensor]:
    """``torch._scaled_mm(all_gather(x, gather_dim), mat2, scale_x, scale_mat2)`` as a ring: each fp8 block's
    GEMM overlaps the next block's transfer (the bytes of a quarter of fp32's traffic).

    Args:
        x: this rank's fp8 block ``[..., S/n, ..., k]`` along ``gather_dim`` (not the last dim).
        mat2: fp8 ``[k, n]``; column-major on a GPU (``w_fp8.t()`` of a row-major ``[n, k]`` weight).
        scale_x, scale_mat2: 1-element fp32 dequantisation factors (the inverse cast scales; equal on every
            rank for the gathered blocks to mean the same values).
    Returns:
        ``(out, gathered)``: ``out [..., S, ..., n]`` in ``out_dtype``; ``gathered``, the all-gathered fp8 ``x``
        (for the weight gradient).

    No autograd of its own: the fp8 linears' backward calls it (``torchdist_ext.fp8.linear``).
    """
    return torch.ops.tdx.all_gather_scaled_mm(x, mat2, scale_x, scale_mat2, out_dtype, group_name, gather_dim)


def scaled_mm_reduce_scatter(x: Tensor, mat2: Tensor, scale_x: Tensor, scale_mat2: Tensor, out_dtype: torch.dtype,
                             group_name: str, scatter_dim: int) -> Tensor:
    """This rank's block of ``sum_over_ranks(torch._scaled_mm(x, mat2, scale_x, scale_mat2))`` along
    ``scatter_dim``, as a ring: each block's GEMM overlaps the transfer of the previous block's running sum.

    Args:
        x: fp8 ``[..., S, ..., k]`` with ``S`` divisible by the group size.
        mat2, scale_x, scale_mat2: as ``all_gather_scaled_mm``.
    Returns:
        ``[..., S/n, ..., n]`` in ``out_dtype`` (the partial sums are added in it).

    No autograd of its own: the fp8 linears' backward calls it (``torchdist_ext.fp8.linear``).
    """
    return torch.ops.tdx.scaled_mm_reduce_scatter(x, mat2, scale_x, scale_mat2, out_dtype, group_name, scatter_dim)


def _sharded_dim(op: str, t: Tensor, dim: int) -> int:
    """The C++ op's checks of the sharded dim, for the fake (meta) implementations; returns it wrapped."""
    torch._check(t.dim() >= 2, lambda: f"{op}: the activation must have at least 2 dims, got shape {tuple(t.shape)}")
    torch._check_index(
        -t.dim() <= dim < t.dim(), lambda: f"{op}: dim={dim} is out of range for shape {tuple(t.shape)}"
    )
    wrapped = dim % t.dim()
    torch._check(
        wrapped < t.dim() - 1,
        lambda: f"{op}: the sharded dim must not be the feature (last) dim, got dim={dim} for shape {tuple(t.shape)}",
    )
    return wrapped


def _check_same_kind(op: str, a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    torch._check(
        a.dtype == b.dtype, lambda: f"{op}: {a_name} and {b_name} must have the same dtype, got {a.dtype} and {b.dtype}"
    )
    torch._check(
        a.device == b.device,
        lambda: f"{op}: {a_name} and {b_name} must be on the same device, got {a.device} and {b.device}",
    )


def _check_matmul_operands(op: str, x: Tensor, weight: Tensor) -> None:
    torch._check(weight.dim() == 2, lambda: f"{op}: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    torch._check(
        x.shape[-1] == weight.shape[1],
        lambda: f"{op}: x.size(-1)={x.shape[-1]} must equal weight.size(1)={weight.shape[1]}",
    )
    _check_same_kind(op, x, "x", weight, "weight")


def _check_scaled_mm_operands(op: str, x: Tensor, mat2: Tensor, scale_x: Tensor, scale_mat2: Tensor,
                              out_dtype: torch.dtype) -> None:
    torch._check(
        x.dtype in _FP8_DTYPES and mat2.dtype in _FP8_DTYPES,
        lambda: f"{op}: x and mat2 must be float8_e4m3fn or float8_e5m2, got {x.dtype} and {mat2.dtype}",
    )
    torch._check(mat2.dim() == 2, lambda: f"{op}: mat2 must be 2-D [k, n], got shape {tuple(mat2.shape)}")
    torch._check(
        x.shape[-1] == mat2.shape[0], lambda: f"{op}: x.size(-1)={x.shape[-1]} must equal mat2.size(0)={mat2.shape[0]}"
    )
    for scale in (scale_x, scale_mat2):
        torch._check(
            scale.dtype == torch.float32 and scale.numel() == 1,
            lambda: f"{op}: scale_x and scale_mat2 must be 1-element float32 tensors, got {scale.dtype} with "
            f"{scale.numel()} elements",
        )
    for t in (mat2, scale_x, scale_mat2):
        torch._check(
            t.device == x.device, lambda: f"{op}: every tensor must be on x's device {x.device}, got {t.device}"
        )
    torch._check(
        out_dtype in (torch.float32, torch.bfloat16, torch.float16),
        lambda: f"{op}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}",
    )
    if x.device.type == "cuda":  # torch._scaled_mm's rules on a GPU
        torch._check(
            mat2.stride(0) == 1 and mat2.shape[0] % 16 == 0 and mat2.shape[1] % 16 == 0,
            lambda: f"{op}: on CUDA mat2 must be column-major with both dims multiples of 16, got shape "
            f"{tuple(mat2.shape)} and strides {mat2.stride()}",
        )


def _gathered_shape(x: Tensor, dim: int, group_name: str) -> list[int]:
    """The shape of ``x`` all-gathered along ``dim`` over the group."""
    shape = list(x.shape)
    shape[dim] *= _get_group_size_by_name(group_name)
    return shape


def _scattered_shape(op: str, x: Tensor, dim: int, group_name: str, features: int) -> list[int]:
    """The shape of this rank's block along ``dim`` of ``x``'s GEMM with ``features`` outputs, checking that the
    group divides ``x.size(dim)`` (the C++ op's check)."""
    n = _get_group_size_by_name(group_name)
    torch._check(
        x.shape[dim] % n == 0, lambda: f"{op}: x.size({dim})={x.shape[dim]} must be divisible by the group size {n}"
    )
    shape = list(x.shape)
    shape[dim] //= n
    shape[-1] = features
    return shape


@torch.library.register_fake("tdx::all_gather_scaled_mm")
def _(x, mat2, scale_x, scale_mat2, out_dtype, group_name, gather_dim):
    op = "all_gather_scaled_mm"
    dim = _sharded_dim(op, x, gather_dim)
    _check_scaled_mm_operands(op, x, mat2, scale_x, scale_mat2, out_dtype)
    gathered_shape = _gathered_shape(x, dim, group_name)
    return x.new_empty([*gathered_shape[:-1], mat2.shape[1]], dtype=out_dtype), x.new_empty(gathered_shape)


@torch.library.register_fake("tdx::scaled_mm_reduce_scatter")
def _(x, mat2, scale_x, scale_mat2, out_dtype, group_name, scatter_dim):
    op = "scaled_mm_reduce_scatter"
    dim = _sharded_dim(op, x, scatter_dim)
    _check_scaled_mm_operands(op, x, mat2, scale_x, scale_mat2, out_dtype)
    return x.new_empty(_scattered_shape(op, x, dim, group_name, mat2.shape[1]), dtype=out_dtype)


@torch.library.register_fake("tdx::all_gather_matmul")
def _(x, weight, group_name, gather_dim, return_gathered=False):
    dim = _sharded_dim("all_gather_matmul", x, gather_dim)
    _check_matmul_operands("all_gather_matmul", x, weight)
    gathered_shape = _gathered_shape(x, dim, group_name)
    out = x.new_empty([*gathered_shape[:-1], weight.shape[0]])
    gathered = x.new_empty(gathered_shape if return_gathered else [0])
    return out, gathered


@torch.library.register_fake("tdx::matmul_reduce_scatter")
def _(x, weight, group_name, scatter_dim):
    op = "matmul_reduce_scatter"
    dim = _sharded_dim(op, x, scatter_dim)
    _check_matmul_operands(op, x, weight)
    return x.new_empty(_scattered_shape(op, x, dim, group_name, weight.shape[0]))


@torch.library.register_fake("tdx::all_gather_weight_grad")
def _(dense, shard, group_name, gather_dim):
    op = "all_gather_weight_grad"
    dim = _sharded_dim(op, shard, gather_dim)
    _check_same_kind(op, dense, "dense", shard, "shard")
    torch._check(
        dense.dim() == shard.dim(),
        lambda: f"{op}: dense and shard must have the same number of dims, got shapes {tuple(dense.shape)} and "
        f"{tuple(shard.shape)}",
    )
    n = _get_group_size_by_name(group_name)
    for d in range(shard.dim() - 1):
        expected = shard.shape[d] * n if d == dim else shard.shape[d]
        torch._check(
            dense.shape[d] == expected,
            lambda: f"{op}: dense.size({d})={dense.shape[d]} must be {expected} for shard shape "
            f"{tuple(shard.shape)} gathered over {n} ranks on dim {dim}",
        )
    return dense.new_empty([dense.shape[-1], shard.shape[-1]])


def _save(ctx, tensors, group_name, dim):
    ctx.save_for_backward(*tensors)
    ctx.group_name = group_name
    ctx.dim = dim


def _all_gather_matmul_setup(ctx, inputs, output):
    x, weight, group_name, gather_dim, return_gathered = inputs
    _save(ctx, (x, weight), group_name, gather_dim)
    ctx.return_gathered = return_gathered
    ctx.set_materialize_grads(False)


def _all_gather_matmul_backward(ctx, grad_out, grad_gathered):
    x, weight = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        if grad_out is not None:
            grad_x = matmul_reduce_scatter(grad_out, weight.t(), ctx.group_name, ctx.dim)
        if ctx.return_gathered and grad_gathered is not None:
            group_size = _get_group_size_by_name(ctx.group_name)
            from_gathered = reduce_scatter(grad_gathered, ctx.group_name, group_size, ctx.dim)
            grad_x = from_gathered if grad_x is None else grad_x + from_gathered
    if ctx.needs_input_grad[1] and grad_out is not None:
        grad_weight = all_gather_weight_grad(grad_out, x, ctx.group_name, ctx.dim)
    return grad_x, grad_weight, None, None, None


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    x, weight, group_name, scatter_dim = inputs
    _save(ctx, (x, weight), group_name, scatter_dim)


def _matmul_reduce_scatter_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    need_weight = ctx.needs_input_grad[1]
    grad_x, grad_out_full = all_gather_matmul(grad_out, weight.t(), ctx.group_name, ctx.dim, need_weight)
    grad_weight = None
    if need_weight:
        grad_weight = grad_out_full.flatten(0, -2).t() @ x.flatten(0, -2)
    return (grad_x if ctx.needs_input_grad[0] else None), grad_weight, None, None


def _all_gather_weight_grad_setup(ctx, inputs, output):
    dense, shard, group_name, gather_dim = inputs
    _save(ctx, (dense, shard), group_name, gather_dim)


def _all_gather_weight_grad_backward(ctx, grad):
    dense, shard = ctx.saved_tensors
    grad_dense = grad_shard = None
    if ctx.needs_input_grad[0]:
        grad_dense, _ = all_gather_matmul(shard, grad.to(shard.dtype), ctx.group_name, ctx.dim)
    if ctx.needs_input_grad[1]:
        grad_shard = matmul_reduce_scatter(dense, grad.t().to(dense.dtype), ctx.group_name, ctx.dim)
    return grad_dense, grad_shard, None, None


torch.library.register_autograd(
    "tdx::all_gather_matmul", _all_gather_matmul_backward, setup_context=_all_gather_matmul_setup
)
torch.library.register_autograd(
    "tdx::matmul_reduce_scatter", _matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup
)
torch.library.register_autograd(
    "tdx::all_gather_weight_grad",
    _all_gather_weight_grad_backward,
    setup_context=_all_gather_weight_grad_setup,
)
