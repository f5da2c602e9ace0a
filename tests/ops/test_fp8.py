"""tdx::fp8_cast_amax: the bytes of the torch expression it fuses, the amax, every CPU ISA, opcheck,
compile, bad input."""

import pytest
import torch

import torchdist_ext  # noqa: F401
from torchdist_ext.cpu_isa import use_cpu_isa
from torchdist_ext.ops import fp8_cast_amax, fp8_cast_transpose_amax

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def reference_cast(x, scale, fp8_dtype):
    """The unfused torch expression: scale in fp32, saturate every finite element (an overflowing product
    too), inf and NaN to NaN, round."""
    limit = FP8_MAX[fp8_dtype]
    return torch.where(x.isfinite(), (x.float() * scale).clamp(-limit, limit), float("nan")).to(fp8_dtype)


def inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 513, generator=gen) * torch.logspace(-12, 6, 513)  # across both formats' ranges
    x[0, :4] = torch.tensor([0.0, -0.0, 1e30, -1e30])
    return x.to(dtype)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bytes_equal_the_torch_expression_and_amax_is_the_largest_magnitude(cpu_isa, dtype, fp8_dtype):
    x = inputs(dtype)
    with use_cpu_isa(cpu_isa):
        for scale in (1.0, 0.37, 2.0**10, 3e38):  # 3e38 overflows fp32 for |x| > 1: saturates
            x_fp8, amax = fp8_cast_amax(x, torch.tensor(scale), fp8_dtype)
            expected = reference_cast(x, scale, fp8_dtype)
            assert x_fp8.dtype == fp8_dtype and x_fp8.shape == x.shape
            assert torch.equal(x_fp8.view(torch.uint8), expected.view(torch.uint8))
            assert amax.dtype == torch.float32 and amax.dim() == 0
            assert amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_element_makes_the_amax_non_finite_and_its_byte_nan(special):
    x = torch.randn(3, 20000)  # several chunks: the special value sits in the last
    x[2, 19999] = special
    x_fp8, amax = fp8_cast_amax(x, torch.tensor(1.0), torch.float8_e4m3fn)
    assert not amax.isfinite() and (amax.isnan() if special != special else amax == float("inf"))
    assert x_fp8[2, 19999].float().isnan() and x_fp8[:2].float().isfinite().all()


def test_empty_and_non_contiguous_inputs():
    x_fp8, amax = fp8_cast_amax(torch.empty(0, 8), torch.tensor(1.0), torch.float8_e5m2)
    assert x_fp8.shape == (0, 8) and amax.item() == 0.0
    x = torch.randn(64, 48).t()
    x_fp8, amax = fp8_cast_amax(x, torch.tensor(3.0), torch.float8_e4m3fn)
    assert x_fp8.is_contiguous() and torch.equal(x_fp8.view(torch.uint8),
                                                 reference_cast(x, 3.0, torch.float8_e4m3fn).view(torch.uint8))


def test_opcheck_and_compile():
    x = torch.randn(16, 32)
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        torch.library.opcheck(torch.ops.tdx.fp8_cast_amax, (x, torch.tensor(0.5), fp8_dtype))
    compiled = torch.compile(lambda a, s: fp8_cast_amax(a, s, torch.float8_e4m3fn), fullgraph=True)
    x_fp8, amax = compiled(x, torch.tensor(0.5))
    assert torch.equal(x_fp8.view(torch.uint8), reference_cast(x, 0.5, torch.float8_e4m3fn).view(torch.uint8))
    assert amax.item() == x.abs().max().item()


@pytest.mark.parametrize("args, error, message", [
    ((torch.randn(4), torch.tensor(1.0), torch.bfloat16), ValueError, "fp8_dtype must be float8_e4m3fn or float8_e5m2"),
    ((torch.randn(4).double(), torch.tensor(1.0), torch.float8_e4m3fn), TypeError,
     "x must be float32, bfloat16 or float16, got"),
    ((torch.randn(4), torch.tensor(1.0).double(), torch.float8_e4m3fn), TypeError, "scale must be float32"),
    ((torch.randn(4), torch.ones(2), torch.float8_e4m3fn), ValueError, "scale must hold one value"),
], ids=["fp8_dtype", "x_dtype", "scale_dtype", "scale_shape"])
def test_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        fp8_cast_amax(*args)
    with pytest.raises(error, match=message):
        torch.ops.tdx.fp8_cast_amax(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))


@pytest.mark.parametrize("shape, row_multiple", [((37, 70), 1), ((37, 70), 16), ((64, 32), 16), ((1, 1), 1),
                                                 ((0, 8), 16)], ids=["partial-tiles", "padded", "even", "one", "empty"])
def test_cast_transpose_gives_both_orientations_of_the_cast(cpu_isa, shape, row_multiple):
    x = torch.randn(shape) * 100
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x_fp8, x_fp8_t, amax = fp8_cast_transpose_amax(x, torch.tensor([0.5]), fp8_dtype, row_multiple)
        expected, expected_amax = fp8_cast_amax(x, torch.tensor([0.5]), fp8_dtype)
        padded_rows = -(-shape[0] // row_multiple) * row_multiple
        assert x_fp8_t.shape == (shape[1], padded_rows) and x_fp8_t.dtype == fp8_dtype
        assert torch.equal(x_fp8.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(x_fp8_t[:, :shape[0]].view(torch.uint8), expected.t().view(torch.uint8))
        assert not x_fp8_t[:, shape[0]:].view(torch.uint8).any(), "the padding columns are zero bytes"
        assert torch.equal(amax, expected_amax)


def test_cast_transpose_opcheck_compile_and_bad_input():
    x = torch.randn(20, 48)
    torch.library.opcheck(torch.ops.tdx.fp8_cast_transpose_amax, (x, torch.tensor([0.5]), torch.float8_e4m3fn, 16))
    compiled = torch.compile(lambda a, s: fp8_cast_transpose_amax(a, s, torch.float8_e5m2, 16), fullgraph=True)
    x_fp8, x_fp8_t, _ = compiled(x, torch.tensor([0.5]))
    assert torch.equal(x_fp8_t[:, :20].view(torch.uint8), x_fp8.t().view(torch.uint8))
    for args, error, message in [((torch.randn(4), torch.tensor(1.0), torch.float8_e4m3fn), ValueError, "must be 2-D"),
                                 ((x, torch.tensor(1.0), torch.float8_e4m3fn, 0), ValueError,
                                  "row_multiple must be >= 1")]:
        with pytest.raises(error, match=message):
            fp8_cast_transpose_amax(*args)
        with pytest.raises(error, match=message):
            torch.ops.tdx.fp8_cast_transpose_amax(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
