"""The fp8 GEMM: ``torch._scaled_mm`` on a GPU, its exact emulation on the CPU.

    out = scaled_mm(x_fp8, w_fp8.t(), x_inverse_scale, w_inverse_scale, torch.bfloat16)
"""

import torch
from torch import Tensor

__all__ = ["scaled_mm"]


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a @ b) * scale_a * scale_b`` in ``out_dtype``: ``a [m, k]`` and ``b [k, n]`` fp8 (on a GPU ``b``
    column-major, both multiples of 16, as ``torch._scaled_mm`` takes), ``scale_a`` / ``scale_b`` 1-element
    fp32 dequantisation factors.

    On the CPU: fp8 widens to fp32 without rounding, so one fp32 GEMM times the product of the scales is
    ``torch._scaled_mm``'s result up to the GEMM's summation order. ATen's CPU ``_scaled_mm`` is not used: on
    CPUs where oneDNN takes its fp8 path it runs several hundred times slower than the fp32 GEMM. The
    collective fp8 ops (``tdx::all_gather_scaled_mm``, ``tdx::scaled_mm_reduce_scatter``) compute each block
    the same way."""
    if a.is_cpu:
        return torch.mm(a.float(), b.float()).mul_(scale_a * scale_b).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
