"""FP8 scaled casts (``tdx::fp8_cast_amax``), the building block of the fp8 linears.

    fp8_cast_amax             x (fp32 / bf16 / fp16) and a scale -> (cast(x * scale) in e4m3 or e5m2, max |x|)
    fp8_cast_transpose_amax   the same cast of a matrix in both orientations (the GEMMs' column-major operands)
    fp8_cast_blockwise        a matrix cast with one scale per block (rowwise, 1 x 128 tiles, 128 x 128 blocks)

One read of x: the cast and the amax that delayed scaling records come out of the
same pass (the unfused torch expression reads x twice and writes the scaled copy).
Every finite element saturates to the format's largest value (448 for e4m3, 57344
for e5m2), also where ``x * scale`` overflows fp32; inf and NaN become NaN so that
a non-finite input always reaches the loss; rounding is to nearest even (the bytes
equal ``torch.where(x.isfinite(), (x.float() * scale).clamp(-max, max), nan).to(fp8_dtype)``). The amax ignores nothing: NaN if x holds a NaN, inf if it
holds an inf. Not differentiable (the fp8 linears define the gradients).
"""

import torch
from torch import Tensor

__all__ = ["FP8_DTYPES", "fp8_cast_amax", "fp8_cast_blockwise", "fp8_cast_transpose_amax"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_cast_amax(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(x_fp8, amax)``: ``x_fp8`` contiguous, x's shape, in ``fp8_dtype``; ``amax`` a 0-d fp32 tensor.
    ``scale``: fp32, one element, on x's device."""
    return torch.ops.tdx.fp8_cast_amax(x, scale, fp8_dtype)


def fp8_cast_transpose_amax(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype,
                            row_multiple: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """``(x_fp8, x_fp8_t, amax)`` of a matrix ``x [rows, cols]`` from one read: ``x_fp8`` as
    ``fp8_cast_amax`` gives it, ``x_fp8_t [cols, ceil(rows / row_multiple) * row_multiple]`` its transpose
    with zero bytes in the padding columns (``x_fp8_t.t()`` is ``x_fp8``, rows padded, column-major: the
    operand form ``torch._scaled_mm`` takes as its second operand)."""
    return torch.ops.tdx.fp8_cast_transpose_amax(x, scale, fp8_dtype, row_multiple)


def fp8_cast_blockwise(x: Tensor, block_rows: int, block_cols: int, fp8_dtype: torch.dtype, *,
                       power_of_2: bool = False, eps: float = 1e-12) -> tuple[Tensor, Tensor]:
    """``(x_fp8, inverse_scale)`` of a matrix ``x [rows, cols]``, one scale per block of ``block_rows x
    block_cols`` elements (the edge blocks may be smaller), in one kernel: each block's scale is
    ``fp8_max / max(amax, eps)`` (its own amax; 1 where that is inf or NaN), rounded down to a power of two
    with ``power_of_2``; ``x_fp8`` is x's shape in ``fp8_dtype``, ``inverse_scale`` fp32
    ``[ceil(rows / block_rows), ceil(cols / block_cols)]`` (1 / scale: the dequantisation factors). Finite
    elements: ``(x_block.float() * scale).clamp(-max, max).to(fp8_dtype)`` block by block; inf and NaN become
    NaN, as in ``fp8_cast_amax``, so that a non-finite input reaches the loss."""
    return torch.ops.tdx.fp8_cast_blockwise(x, block_rows, block_cols, fp8_dtype, power_of_2, eps)


def _check_cast_arguments(op, x, scale, fp8_dtype):
    torch._check_value(fp8_dtype in FP8_DTYPES,
                       lambda: f"{op}: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    torch._check_type(x.dtype in _INPUT_DTYPES, lambda: f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    torch._check_type(scale.dtype == torch.float32, lambda: f"{op}: scale must be float32, got {scale.dtype}")
    torch._check_value(scale.numel() == 1, lambda: f"{op}: scale must hold one value, got shape {tuple(scale.shape)}")
    torch._check_value(scale.device == x.device,
                       lambda: f"{op}: scale must be on x's device {x.device}, got {scale.device}")


@torch.library.register_fake("tdx::fp8_cast_amax")
def _(x, scale, fp8_dtype):
    _check_cast_arguments("fp8_cast_amax", x, scale, fp8_dtype)
    return torch.empty(x.shape, dtype=fp8_dtype, device=x.device), x.new_empty((), dtype=torch.float32)


@torch.library.register_fake("tdx::fp8_cast_transpose_amax")
def _(x, scale, fp8_dtype, row_multiple=1):
    op = "fp8_cast_transpose_amax"
    _check_cast_arguments(op, x, scale, fp8_dtype)
    torch._check_value(x.dim() == 2, lambda: f"{op}: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    torch._check_value(row_multiple >= 1, lambda: f"{op}: row_multiple must be >= 1, got {row_multiple}")
    padded_rows = (x.shape[0] + row_multiple - 1) // row_multiple * row_multiple
    return (torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
            torch.empty((x.shape[1], padded_rows), dtype=fp8_dtype, device=x.device),
            x.new_empty((), dtype=torch.float32))


@torch.library.register_fake("tdx::fp8_cast_blockwise")
def _(x, block_rows, block_cols, fp8_dtype, power_of_2=False, eps=1e-12):
    op = "fp8_cast_blockwise"
    torch._check_value(fp8_dtype in FP8_DTYPES,
                       lambda: f"{op}: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    torch._check_type(x.dtype in _INPUT_DTYPES, lambda: f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    torch._check_value(x.dim() == 2, lambda: f"{op}: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    torch._check_value(block_rows >= 1 and block_cols >= 1,
                       lambda: f"{op}: block_rows and block_cols must be >= 1, got {block_rows} and {block_cols}")
    torch._check_value(0 < eps < 1e38, lambda: f"{op}: eps must be a positive finite fp32 number, got {eps}")
    grid = ((x.shape[0] + block_rows - 1) // block_rows, (x.shape[1] + block_cols - 1) // block_cols)
    return torch.empty(x.shape, dtype=fp8_dtype, device=x.device), x.new_empty(grid, dtype=torch.float32)
