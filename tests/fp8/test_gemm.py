"""fp8.gemm.scaled_mm on the CPU (the exact emulation) against float64 and against ATen's torch._scaled_mm:
both accumulate exact fp8 products in fp32, so each lies within fp32 summation's bound of the exact result."""

import pytest
import torch

from torchdist_ext.fp8.gemm import scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def operands(a_dtype, column_major: bool):
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(32, 64, generator=gen) * 4).to(a_dtype)
    b = (torch.randn(48, 64, generator=gen) * 4).to(E4M3)
    b = b.t() if column_major else b.t().contiguous()  # [k, n]
    return a, b, torch.tensor([0.375]), torch.tensor([1.25])


def summation_bound(a, b, scale, out_dtype):
    """|fp32 GEMM of exact products - exact| <= k u sum|a b| (u = 2^-24), plus rounding into ``out_dtype``."""
    k = a.shape[1]
    magnitude = (a.double().abs() @ b.double().abs()) * scale
    exact = (a.double() @ b.double()) * scale
    rounding = 2.0 ** -24 if out_dtype == torch.float32 else 2.0 ** -8
    return exact, 1.01 * k * 2.0 ** -24 * magnitude + rounding * exact.abs() + 1e-30


@pytest.mark.parametrize("a_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("column_major", [True, False], ids=["column-major", "row-major"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_within_fp32_summation_of_the_exact_product_and_of_aten(a_dtype, column_major, out_dtype):
    a, b, scale_a, scale_b = operands(a_dtype, column_major)
    ours = scaled_mm(a, b, scale_a, scale_b, out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (32, 48)
    exact, bound = summation_bound(a, b, (scale_a * scale_b).item(), out_dtype)
    assert ((ours.double() - exact).abs() <= bound).all()
    aten = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    assert ((ours.double() - aten.double()).abs() <= 2 * bound).all()


def test_compiles_without_a_graph_break():
    a, b, scale_a, scale_b = operands(E4M3, True)
    compiled = torch.compile(scaled_mm, fullgraph=True)
    torch.testing.assert_close(compiled(a, b, scale_a, scale_b, torch.float32),
                               scaled_mm(a, b, scale_a, scale_b, torch.float32), rtol=0, atol=0)
