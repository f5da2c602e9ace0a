"""tdx::all_gather_scaled_mm and scaled_mm_reduce_scatter (the fp8 rings) on 2 and 4 CPU ranks.

Each rank j has its own fp8 operands and scales (seeded by j); the reference for rank r is
torch._scaled_mm, in one process, on every rank's operands: out = _scaled_mm(gather(x), B_r) and
out = block_r(sum_j _scaled_mm(x_j, B_j)). The fp8 values are exact, so the ring and the reference
differ only in the GEMM's and the sum's rounding into the output dtype.
"""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401
from torchdist_ext.ops import all_gather_scaled_mm, scaled_mm_reduce_scatter

WORLDS = ["world2", "world4"]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(seed, *shape, dtype=E4M3):
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(*shape, generator=gen)).to(dtype)


def scale(seed):
    return torch.tensor([0.25 + 0.125 * (seed % 5)])


def group_name():
    return dist.group.WORLD.group_name


def scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """The reference GEMM over the last dim of any-rank ``a``."""
    out = torch._scaled_mm(a.reshape(-1, a.shape[-1]), b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out.view(*a.shape[:-1], b.shape[1])


def close(actual, expected, out_dtype):
    assert actual.dtype == out_dtype
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[out_dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol * expected.abs().max().item(), rtol=tol)


def check_all_gather_scaled_mm(dim, out_dtype, x_dtype):
    n, r = dist.get_world_size(), dist.get_rank()
    b, s, k, m = 2 * n, 3 * n, 16, 32
    x_full = fp8(0, b, s, k, dtype=x_dtype)
    mat2 = fp8(100 + r, m, k).t()  # column-major [k, m], as a weight's transpose
    x = x_full.chunk(n, dim=dim)[r]
    out, gathered = all_gather_scaled_mm(x, mat2, scale(0), scale(1 + r), out_dtype, group_name(), dim)
    assert torch.equal(gathered.view(torch.uint8), x_full.view(torch.uint8))
    close(out, scaled_mm(x_full, mat2, scale(0), scale(1 + r), out_dtype), out_dtype)
    return True


def check_scaled_mm_reduce_scatter(dim, out_dtype, x_dtype):
    n, r = dist.get_world_size(), dist.get_rank()
    b, s, k, m = 2 * n, 2 * n, 16, 32
    xs = [fp8(10 + j, b, s, k, dtype=x_dtype) for j in range(n)]
    mats = [fp8(100 + j, m, k).t() for j in range(n)]
    out = scaled_mm_reduce_scatter(xs[r], mats[r], scale(r), scale(1 + r), out_dtype, group_name(), dim)
    total = sum(scaled_mm(xs[j], mats[j], scale(j), scale(1 + j), torch.float32).double() for j in range(n))
    close(out, total.chunk(n, dim=dim)[r], out_dtype)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", [check_all_gather_scaled_mm, check_scaled_mm_reduce_scatter],
                         ids=lambda f: f.__name__[6:])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_scaled_mm_on_the_gathered_operands(world, check, dim, out_dtype, request):
    assert all(request.getfixturevalue(world).run(check, dim, out_dtype, E4M3))


@pytest.mark.parametrize("check", [check_all_gather_scaled_mm, check_scaled_mm_reduce_scatter],
                         ids=lambda f: f.__name__[6:])
def test_e5m2_operands(world2, check):
    """The backward's GEMMs take the e5m2 output gradient ("hybrid") against an e4m3 weight."""
    assert all(world2.run(check, 1, torch.float32, E5M2))


# opcheck's test_schema compares inputs before and after with torch.allclose, which has no fp8 kernel on
# CPU; run_opcheck checks that part of the schema (no input mutated, no output aliasing one) itself.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def check_schema_promises(op, args):
    before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.dtype in (E4M3, E5M2)
              else a.clone() if isinstance(a, torch.Tensor) else None for a in args]
    outputs = op(*args)
    for arg, saved in zip(args, before):
        if isinstance(arg, torch.Tensor):
            assert torch.equal(arg.view(torch.uint8) if arg.dtype in (E4M3, E5M2) else arg, saved), "input mutated"
            for out in outputs if isinstance(outputs, tuple) else (outputs,):
                assert out.untyped_storage().data_ptr() != arg.untyped_storage().data_ptr(), "output aliases input"


def check_four_dims_and_a_strided_input():
    """[b, s, heads, k] sharded on dim 1 (rows = s/n * heads per block, blocks interleaved in memory), from a
    non-contiguous x."""
    n, r = dist.get_world_size(), dist.get_rank()
    mat2 = fp8(100 + r, 32, 16).t()
    strided = fp8(1, 2, 2 * n, 3, 32)[..., ::2]  # every other feature: not contiguous
    out, gathered = all_gather_scaled_mm(strided.chunk(n, dim=1)[r], mat2, scale(0), scale(1), torch.float32,
                                         group_name(), 1)
    assert torch.equal(gathered.view(torch.uint8), strided.contiguous().view(torch.uint8))
    close(out, scaled_mm(strided.contiguous(), mat2, scale(0), scale(1), torch.float32), torch.float32)
    xs = [fp8(10 + j, 2, 2 * n, 3, 16) for j in range(n)]
    out = scaled_mm_reduce_scatter(xs[r], mat2, scale(0), scale(1), torch.float32, group_name(), 1)
    mats = [fp8(100 + j, 32, 16).t() for j in range(n)]
    total = sum(scaled_mm(xs[j], mats[j], scale(0), scale(1), torch.float32).double() for j in range(n))
    close(out, total.chunk(n, dim=1)[r], torch.float32)
    return True


def test_four_dims_and_a_strided_input(world2):
    assert all(world2.run(check_four_dims_and_a_strided_input))


def run_opcheck():
    n, name = dist.get_world_size(), group_name()
    mat2 = fp8(1, 32, 16).t()
    for out_dtype in (torch.float32, torch.bfloat16):
        for op, args in ((torch.ops.tdx.all_gather_scaled_mm,
                          (fp8(2, 2, 3, 16), mat2, scale(0), scale(1), out_dtype, name, 1)),
                         (torch.ops.tdx.scaled_mm_reduce_scatter,
                          (fp8(3, 2 * n, 3, 16), mat2, scale(0), scale(1), out_dtype, name, 0))):
            torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
            check_schema_promises(op, args)
    return True


def test_opcheck(world2):
    assert all(world2.run(run_opcheck))


def run_compiled_matches_eager():
    name = group_name()

    def block_fn(x, up, down, s):
        hidden, gathered = all_gather_scaled_mm(x, up, s, s, torch.float32, name, 1)
        hidden_fp8 = torch.relu(hidden).to(E4M3)
        return scaled_mm_reduce_scatter(hidden_fp8, down, s, s, torch.bfloat16, name, 1), gathered

    args = (fp8(1, 2, 3, 16), fp8(2, 32, 16).t(), fp8(3, 16, 32).t(), scale(2))
    eager = block_fn(*args)
    compiled = torch.compile(block_fn, fullgraph=True)(*args)
    assert torch.equal(compiled[0], eager[0])
    assert torch.equal(compiled[1].view(torch.uint8), eager[1].view(torch.uint8))
    assert eager[0].shape == (2, 3, 16) and eager[1].shape == (2, 3 * dist.get_world_size(), 16)
    return True


def test_compile_fullgraph(world2):
    assert all(world2.run(run_compiled_matches_eager))


def bad_x_dtype():
    all_gather_scaled_mm(torch.zeros(2, 3, 16), fp8(1, 32, 16).t(), scale(0), scale(0), torch.float32, group_name(), 1)


def bad_inner_dim():
    all_gather_scaled_mm(fp8(0, 2, 3, 16), fp8(1, 32, 8).t(), scale(0), scale(0), torch.float32, group_name(), 1)


def bad_mat2_rank():
    scaled_mm_reduce_scatter(fp8(0, 2, 4, 16), fp8(1, 16), scale(0), scale(0), torch.float32, group_name(), 1)


def bad_scale():
    scaled_mm_reduce_scatter(fp8(0, 2, 4, 16), fp8(1, 32, 16).t(), torch.ones(2), scale(0), torch.float32,
                             group_name(), 1)


def bad_out_dtype():
    all_gather_scaled_mm(fp8(0, 2, 3, 16), fp8(1, 32, 16).t(), scale(0), scale(0), torch.float64, group_name(), 1)


def bad_sharded_dim():
    all_gather_scaled_mm(fp8(0, 2, 3, 16), fp8(1, 32, 16).t(), scale(0), scale(0), torch.float32, group_name(), -1)


def bad_divisibility():
    scaled_mm_reduce_scatter(fp8(0, 2, 3, 16), fp8(1, 32, 16).t(), scale(0), scale(0), torch.float32,
                             group_name(), 1)


@pytest.mark.parametrize(
    "fn, message",
    [
        (bad_x_dtype, "x and mat2 must be float8_e4m3fn or float8_e5m2, got Float and Float8_e4m3fn"),
        (bad_inner_dim, "x.size\\(-1\\)=16 must equal mat2.size\\(0\\)=8"),
        (bad_mat2_rank, "mat2 must be 2-D \\[k, n\\]"),
        (bad_scale, "scale_x and scale_mat2 must be 1-element float32 tensors, got Float with 2 elements"),
        (bad_out_dtype, "out_dtype must be float32, bfloat16 or float16, got Double"),
        (bad_sharded_dim, "must not be the feature \\(last\\) dim"),
        (bad_divisibility, "x.size\\(1\\)=3 must be divisible by the group size 2"),
    ],
)
def test_bad_input_is_rejected_on_every_rank(world2, fn, message):
    with pytest.raises(RuntimeError, match=message):
        world2.run(fn)
    assert world2.alive
