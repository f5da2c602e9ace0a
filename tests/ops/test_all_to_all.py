"""tdx::all_to_all_seq_to_heads / heads_to_seq: values, gradients, opcheck, compile, bad input."""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401
from torchdist_ext.ops import all_to_all_heads_to_seq, all_to_all_seq_to_heads
from torchdist_ext.testing import cached_mesh, gather_replicated, shard_replicated


def mesh():
    return cached_mesh((dist.get_world_size(),), ("sp",))


def full(seed=0, heads=4, seq=None, dtype=torch.float32, grad=False):
    seq = seq or 3 * dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, heads, seq, 5, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(grad)


def check_values_and_round_trip():
    n, r = dist.get_world_size(), dist.get_rank()
    name = mesh().get_group().group_name
    x = full(heads=2 * n)
    seq_shard = x.chunk(n, dim=2)[r].contiguous()
    heads_shard = all_to_all_seq_to_heads(seq_shard, name)
    assert torch.equal(heads_shard, x.chunk(n, dim=1)[r])  # rank r: head block r, whole sequence
    assert torch.equal(all_to_all_heads_to_seq(heads_shard, name), seq_shard)
    return True


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_values_and_round_trip(world, request):
    assert all(request.getfixturevalue(world).run(check_values_and_round_trip))


def replicated_seq_to_heads(x):
    m = mesh()
    return gather_replicated(all_to_all_seq_to_heads(shard_replicated(x, m, 2), m.get_group().group_name), m, 1)


def replicated_heads_to_seq(x):
    m = mesh()
    return gather_replicated(all_to_all_heads_to_seq(shard_replicated(x, m, 1), m.get_group().group_name), m, 2)


def run_gradcheck_and_opcheck():
    x = full(dtype=torch.float64, grad=True)
    assert torch.autograd.gradcheck(replicated_seq_to_heads, (x,))
    assert torch.autograd.gradcheck(replicated_heads_to_seq, (x,))
    name = mesh().get_group().group_name
    for grad in (False, True):
        local = full(seq=3, grad=grad)
        torch.library.opcheck(torch.ops.tdx.all_to_all_seq_to_heads, (local, name))
        torch.library.opcheck(torch.ops.tdx.all_to_all_heads_to_seq, (full(heads=2, seq=6, grad=grad), name))
    return True


def test_gradcheck_and_opcheck(world2):
    assert all(world2.run(run_gradcheck_and_opcheck))


def run_compiled():
    name = mesh().get_group().group_name

    def fn(x):
        return all_to_all_heads_to_seq(all_to_all_seq_to_heads(x, name).sin(), name)

    x = full(seq=3, grad=True)
    eager = fn(x)
    (eager_grad,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(fn, fullgraph=True)(x)
    (compiled_grad,) = torch.autograd.grad(compiled.sum(), x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_grad, eager_grad)
    return True


def test_compile_fullgraph(world2):
    assert all(world2.run(run_compiled))


def heads_not_divisible():
    all_to_all_seq_to_heads(full(heads=3, seq=3), mesh().get_group().group_name)


def sequence_not_divisible():
    all_to_all_heads_to_seq(full(heads=2, seq=3), mesh().get_group().group_name)


def not_4d():
    all_to_all_seq_to_heads(torch.zeros(4, 3, 5), mesh().get_group().group_name)


@pytest.mark.parametrize(
    "fn, message",
    [
        (heads_not_divisible, r"heads \(3\) must be divisible by the group size 2"),
        (sequence_not_divisible, r"seq \(3\) must be divisible by the group size 2"),
        (not_4d, r"x must be \[batch, heads, seq, head_dim\]"),
    ],
)
def test_bad_input(world2, fn, message):
    with pytest.raises(RuntimeError, match=message):
        world2.run(fn)
