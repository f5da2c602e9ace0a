"""The fp8 linear under ``RowwiseScaling`` and ``BlockScaling``: every GEMM operand cast with one scale per block
(``tdx::fp8_cast_blockwise``), blocks laid along the GEMM's non-contracted dim (rowwise) or in tiles along the
contracted one (1 x b activations, b x b weights), and each GEMM on the dequantised operands.

    y = blockwise_fp8_linear(x, weight, bias, BlockScaling())

Which blocks each operand gets: ``operand_blocks``. The GEMM: on the CPU the exact emulation (each operand
dequantised by its blocks' inverse scales, one fp32 GEMM); on CUDA refused for now (it is to run on
``torch._scaled_mm``'s rowwise and blockwise scales, not yet measured on a GPU).
"""

import torch
from torch import Tensor

from torchdist_ext.fp8.recipe import BlockScaling, RowwiseScaling
from torchdist_ext.ops import fp8_cast_blockwise

__all__ = ["blockwise_fp8_linear", "dequantize", "operand_blocks"]

_WHOLE = -1  # a block that spans the whole dim


def operand_blocks(recipe: RowwiseScaling | BlockScaling) -> dict[str, tuple[int, int]]:
    """The block of each operand, (rows, cols) with -1 for a whole dim, for ``y = x W^T`` (x ``[T, in]``,
    W ``[out, in]``), ``dx = g W`` and ``dW = g^T x`` (g ``[T, out]``): ``x``, ``w`` (the forward's),
    ``g`` and ``w_t`` (the input gradient's), ``g_t`` and ``x_t`` (the weight gradient's, contracted over
    the tokens)."""
    if isinstance(recipe, RowwiseScaling):
        row, column = (1, _WHOLE), (_WHOLE, 1)
        return {"x": row, "w": row, "g": row, "w_t": column, "g_t": column, "x_t": column}
    b = recipe.block
    return {"x": (1, b), "w": (b, b), "g": (1, b), "w_t": (b, b), "g_t": (b, 1), "x_t": (b, 1)}


def _resolved(block: tuple[int, int], t: Tensor) -> tuple[int, int]:
    return (max(t.shape[0], 1) if block[0] == _WHOLE else block[0], max(t.shape[1], 1) if block[1] == _WHOLE
            else block[1])


def _cast(t: Tensor, block: tuple[int, int], fp8_dtype: torch.dtype, recipe) -> tuple[Tensor, Tensor, tuple]:
    """(t_fp8, inverse scales, the block as cast) of ``t [rows, cols]``."""
    block = _resolved(block, t)
    t_fp8, inverse = fp8_cast_blockwise(t, *block, fp8_dtype, power_of_2=recipe.power_of_2_scales, eps=recipe.eps)
    return t_fp8, inverse, block


def dequantize(t_fp8: Tensor, inverse_scale: Tensor, block: tuple[int, int]) -> Tensor:
    """``t_fp8 [rows, cols]`` in fp32, each element times its block's inverse scale (``inverse_scale`` the
    grid ``[ceil(rows / block[0]), ceil(cols / block[1])]``)."""
    rows, cols = t_fp8.shape
    scale = inverse_scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return t_fp8.float() * scale


def _mm(a, b, out_dtype: torch.dtype) -> Tensor:
    """``dequantize(*a) @ dequantize(*b)`` in ``out_dtype``: ``a`` = (a_fp8 [m, k], inverse, block), ``b``
    likewise [k, n]."""
    if not a[0].is_cpu:
        raise ValueError("RowwiseScaling and BlockScaling GEMMs run on the CPU for now: their CUDA path (torch."
                         "_scaled_mm with rowwise or blockwise scales) is not wired yet; use DelayedScaling or "
                         "CurrentScaling on a GPU")
    return torch.mm(dequantize(*a), dequantize(*b)).to(out_dtype)


def _transposed(operand):
    t_fp8, inverse, block = operand
    return t_fp8.t(), inverse.t(), block[::-1]


class _BlockwiseFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        blocks, e4m3 = operand_blocks(recipe), torch.float8_e4m3fn
        x2 = x.reshape(-1, x.shape[-1])
        w = _cast(weight, blocks["w"], e4m3, recipe)
        out = _mm(_cast(x2, blocks["x"], e4m3, recipe), _transposed(w), x.dtype)
        if bias is not None:
            out = out + bias.to(x.dtype)
        # The backward's operands: x in token blocks (the weight gradient contracts over the tokens), the
        # weight in column blocks (rowwise) or its square blocks again.
        x_t = _cast(x2, blocks["x_t"], e4m3, recipe)
        if blocks["w_t"] != blocks["w"]:
            w = _cast(weight, blocks["w_t"], e4m3, recipe)
        ctx.save_for_backward(x_t[0], x_t[1], w[0], w[1])
        ctx.blocks = (x_t[2], w[2])
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = recipe, x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_t_fp8, x_t_inverse, w_fp8, w_inverse = ctx.saved_tensors
        x_t, w = (x_t_fp8, x_t_inverse, ctx.blocks[0]), (w_fp8, w_inverse, ctx.blocks[1])
        recipe, blocks = ctx.recipe, operand_blocks(ctx.recipe)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm(_cast(g, blocks["g"], recipe.grad_dtype, recipe), w, ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = _mm(_transposed(_cast(g, blocks["g_t"], recipe.grad_dtype, recipe)), x_t, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        return grad_x, grad_w, grad_bias, None


def blockwise_fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                         recipe: RowwiseScaling | BlockScaling) -> Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs on operands cast under ``recipe`` (``x [..., in]``,
    ``weight [out, in]``; out ``[..., out]`` in x's dtype, the gradients in their tensors' dtypes)."""
    for name, t in (("input", x), ("weight", weight)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{type(recipe).__name__} casts float32, bfloat16 or float16 to fp8: the linear's "
                            f"{name} is {t.dtype}")
    return _BlockwiseFp8Linear.apply(x, weight, bias, recipe)
