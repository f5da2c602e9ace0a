"""tdx::all_gather_matmul, matmul_reduce_scatter, all_gather_weight_grad on 2 and 4 CPU ranks.

Each rank j has its own operands and upstream gradient (seeded by j), so the
reference for rank r is a single-process torch computation over every rank's
operands: out = x_full @ W_r.T, dx_r = block_r(sum_j g_j @ W_j), and so on.
"""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401
from torchdist_ext.ops import all_gather_matmul, all_gather_weight_grad, matmul_reduce_scatter
from torchdist_ext.testing import cached_mesh, gather_replicated, shard_replicated

WORLDS = ["world2", "world4"]


def operand(seed, *shape, dtype=torch.float32, grad=False):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(grad)


def group_name():
    return dist.group.WORLD.group_name


def block(t, dim, n, r):
    return t.chunk(n, dim=dim)[r]


def close(actual, expected, dtype):
    tol = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2}[dtype]
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * scale.item(), rtol=tol)


def check_all_gather_matmul(gather_dim, dtype):
    n, r = dist.get_world_size(), dist.get_rank()
    b, s, h, o = 2 * n, 3 * n, 5, 4
    x_full = operand(0, b, s, h, dtype=dtype)
    weights = [operand(100 + j, o, h, dtype=dtype) for j in range(n)]
    grads = [operand(200 + j, b, s, o, dtype=dtype) for j in range(n)]

    x = block(x_full, gather_dim, n, r).clone().requires_grad_(True)
    weight = weights[r].clone().requires_grad_(True)
    out, gathered = all_gather_matmul(x, weight, group_name(), gather_dim, True)
    out.backward(grads[r])

    ref = x_full.double()
    close(out, ref @ weights[r].double().t(), dtype)
    assert torch.equal(gathered, x_full)
    dx_full = sum(g.double() @ w.double() for g, w in zip(grads, weights))
    close(x.grad, block(dx_full, gather_dim, n, r), dtype)
    close(weight.grad, grads[r].double().flatten(0, -2).t() @ ref.flatten(0, -2), dtype)


def check_matmul_reduce_scatter(scatter_dim, dtype):
    n, r = dist.get_world_size(), dist.get_rank()
    b, s, h, o = 2 * n, 2 * n, 5, 4
    xs = [operand(j, b, s, h, dtype=dtype) for j in range(n)]
    weights = [operand(100 + j, o, h, dtype=dtype) for j in range(n)]
    out_shape = [b, s, o]
    out_shape[scatter_dim] //= n
    grads = [operand(200 + j, *out_shape, dtype=dtype) for j in range(n)]

    x = xs[r].clone().requires_grad_(True)
    weight = weights[r].clone().requires_grad_(True)
    out = matmul_reduce_scatter(x, weight, group_name(), scatter_dim)
    out.backward(grads[r])

    total = sum(xj.double() @ wj.double().t() for xj, wj in zip(xs, weights))
    close(out, block(total, scatter_dim, n, r), dtype)
    g_full = torch.cat([g.double() for g in grads], dim=scatter_dim)
    close(x.grad, g_full @ weights[r].double(), dtype)
    close(weight.grad, g_full.flatten(0, -2).t() @ xs[r].double().flatten(0, -2), dtype)


def check_all_gather_weight_grad(gather_dim, dtype):
    n, r = dist.get_world_size(), dist.get_rank()
    b, s, a, c = 2 * n, 2 * n, 3, 4
    denses = [operand(j, b, s, a, dtype=dtype) for j in range(n)]
    shard_full = operand(50, b, s, c, dtype=dtype)
    grads = [operand(200 + j, a, c, dtype=dtype) for j in range(n)]

    dense = denses[r].clone().requires_grad_(True)
    shard = block(shard_full, gather_dim, n, r).clone().requires_grad_(True)
    out = all_gather_weight_grad(dense, shard, group_name(), gather_dim)
    out.backward(grads[r])

    full = shard_full.double()
    close(out, denses[r].double().flatten(0, -2).t() @ full.flatten(0, -2), dtype)
    close(dense.grad, full @ grads[r].double().t(), dtype)
    d_shard_full = sum(d.double() @ g.double() for d, g in zip(denses, grads))
    close(shard.grad, block(d_shard_full, gather_dim, n, r), dtype)


CHECKS = [check_all_gather_matmul, check_matmul_reduce_scatter, check_all_gather_weight_grad]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__[6:])
@pytest.mark.parametrize("dim", [0, 1])
def test_forward_and_gradients_fp32(world, check, dim, request):
    request.getfixturevalue(world).run(check, dim, torch.float32)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__[6:])
def test_forward_and_gradients_bf16(world2, check):
    world2.run(check, 1, torch.bfloat16)


def world_mesh():
    return cached_mesh((dist.get_world_size(),), ("tp",))


def column_parallel(x_full, weight_full, gather_dim):
    """A replicated function of replicated inputs built from all_gather_matmul."""
    mesh = world_mesh()
    x = shard_replicated(x_full, mesh=mesh, dim=gather_dim)
    weight = shard_replicated(weight_full, mesh=mesh, dim=0)
    out, _ = all_gather_matmul(x, weight, mesh.get_group().group_name, gather_dim)
    return gather_replicated(out, mesh=mesh, dim=-1)


def row_parallel(x_full, weight_full, scatter_dim):
    mesh = world_mesh()
    x = shard_replicated(x_full, mesh=mesh, dim=-1)
    weight = shard_replicated(weight_full, mesh=mesh, dim=1)
    out = matmul_reduce_scatter(x, weight, mesh.get_group().group_name, scatter_dim)
    return gather_replicated(out, mesh=mesh, dim=scatter_dim)


def weight_grad_parallel(dense_full, shard_full, gather_dim):
    mesh = world_mesh()
    dense = shard_replicated(dense_full, mesh=mesh, dim=-1)
    shard = shard_replicated(shard_full, mesh=mesh, dim=gather_dim)
    out = all_gather_weight_grad(dense, shard, mesh.get_group().group_name, gather_dim)
    return gather_replicated(out, mesh=mesh, dim=0)


def run_gradcheck():
    n = dist.get_world_size()
    f64 = dict(dtype=torch.float64, grad=True)
    column_args = (operand(1, 2, 2 * n, 3, **f64), operand(2, 2 * n, 3, **f64), 1)
    row_args = (operand(3, 2, 2 * n, 2 * n, **f64), operand(4, 3, 2 * n, **f64), 1)
    weight_grad_args = (operand(5, 2, 2 * n, 2 * n, **f64), operand(6, 2, 2 * n, 3, **f64), 1)
    assert torch.autograd.gradcheck(column_parallel, column_args)
    assert torch.autograd.gradcheck(row_parallel, row_args)
    assert torch.autograd.gradcheck(weight_grad_parallel, weight_grad_args)
    # Second derivatives run every op's backward through the others' autograd.
    assert torch.autograd.gradgradcheck(column_parallel, column_args)
    assert torch.autograd.gradgradcheck(row_parallel, row_args)
    return True


def test_gradcheck_fp64(world2):
    assert world2.run(run_gradcheck) == [True, True]


def run_opcheck():
    n = dist.get_world_size()
    name = group_name()
    for grad in (False, True):
        x = operand(1, 2, 3, 4, grad=grad)
        w = operand(2, 5, 4, grad=grad)
        torch.library.opcheck(torch.ops.tdx.all_gather_matmul, (x, w, name, 1, False))
        torch.library.opcheck(torch.ops.tdx.all_gather_matmul, (x, w, name, 0, True))
        x_full = operand(3, 2, 2 * n, 4, grad=grad)
        torch.library.opcheck(torch.ops.tdx.matmul_reduce_scatter, (x_full, w, name, 1))
        dense = operand(4, 2, 3 * n, 6, grad=grad)
        shard = operand(5, 2, 3, 4, grad=grad)
        torch.library.opcheck(torch.ops.tdx.all_gather_weight_grad, (dense, shard, name, 1))
    return True


def test_opcheck(world2):
    assert world2.run(run_opcheck) == [True, True]


def run_compiled_matches_eager():
    name = group_name()

    def block_fn(x, w_up, w_down):
        hidden, _ = all_gather_matmul(x, w_up, name, 1)
        return matmul_reduce_scatter(torch.nn.functional.gelu(hidden), w_down, name, 1)

    x = operand(1, 2, 3, 4, grad=True)
    w_up = operand(2, 6, 4, grad=True)
    w_down = operand(3, 4, 6, grad=True)
    eager = block_fn(x, w_up, w_down)
    eager_grads = torch.autograd.grad(eager.square().sum(), (x, w_up, w_down))
    compiled_fn = torch.compile(block_fn, fullgraph=True)
    compiled = compiled_fn(x, w_up, w_down)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), (x, w_up, w_down))
    torch.testing.assert_close(compiled, eager)
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e)
    assert eager.shape == (2, 3, 4)
    return True


def test_compile_fullgraph(world2):
    assert world2.run(run_compiled_matches_eager) == [True, True]


def bad_gather_dim():
    all_gather_matmul(operand(0, 2, 3, 4), operand(1, 5, 4), group_name(), 2)


def bad_inner_dim():
    all_gather_matmul(operand(0, 2, 3, 4), operand(1, 5, 3), group_name(), 1)


def bad_dtype():
    matmul_reduce_scatter(operand(0, 2, 4, 4), operand(1, 5, 4, dtype=torch.float64), group_name(), 1)


def bad_divisibility():
    matmul_reduce_scatter(operand(0, 2, 3, 4), operand(1, 5, 4), group_name(), 1)


def bad_group():
    all_gather_matmul(operand(0, 2, 3, 4), operand(1, 5, 4), "no-such-group", 1)


@pytest.mark.parametrize(
    "fn, message",
    [
        (bad_gather_dim, "must not be the feature \\(last\\) dim"),
        (bad_inner_dim, "x.size\\(-1\\)=4 must equal weight.size\\(1\\)=3"),
        (bad_dtype, "same dtype"),
        (bad_divisibility, "x.size\\(1\\)=3 must be divisible by the group size 2"),
        (bad_group, "group_name 'no-such-group' names no registered process group"),
    ],
)
def test_bad_input_is_rejected_on_every_rank(world2, fn, message):
    with pytest.raises(RuntimeError, match=message):
        world2.run(fn)
    assert world2.alive
