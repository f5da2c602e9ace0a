"""tdx::all_to_all_seq_to_heads / heads_to_seq: values in both orders, gradients, opcheck, compile, bad input."""

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


def sequence_shard(x, order):
    """Rank r's shard of the sequence (dim 2) of x in `order`."""
    n, r = dist.get_world_size(), dist.get_rank()
    if order == "contiguous":
        return x.chunk(n, dim=2)[r].contiguous()
    chunks = x.chunk(2 * n, dim=2)
    return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim=2)


def check_values_and_round_trip(order):
    n, r = dist.get_world_size(), dist.get_rank()
    name = mesh().get_group().group_name
    x = full(heads=2 * n, seq=6 * n)
    seq_shard = sequence_shard(x, order)
    heads_shard = all_to_all_seq_to_heads(seq_shard, name, order)
    assert torch.equal(heads_shard, x.chunk(n, dim=1)[r])  # rank r: head block r, whole sequence in order
    assert torch.equal(all_to_all_heads_to_seq(heads_shard, name, order), seq_shard)
    return True


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_values_and_round_trip(world, order, request):
    assert all(request.getfixturevalue(world).run(check_values_and_round_trip, order))


def replicated_seq_to_heads(x, order):
    m = mesh()
    heads = all_to_all_seq_to_heads(shard_replicated(x, mesh=m, dim=2), m.get_group().group_name, order)
    return gather_replicated(heads, mesh=m, dim=1)


def replicated_heads_to_seq(x, order):
    m = mesh()
    sequence = all_to_all_heads_to_seq(shard_replicated(x, mesh=m, dim=1), m.get_group().group_name, order)
    return gather_replicated(sequence, mesh=m, dim=2)


def run_gradcheck_and_opcheck():
    x = full(seq=4 * dist.get_world_size(), dtype=torch.float64, grad=True)
    name = mesh().get_group().group_name
    torch.manual_seed(0)  # fast mode's random projections: the same on every rank, as the replicated input is
    for order in ("contiguous", "zigzag"):
        # Fast mode (random projections of the Jacobian): every evaluation is an exchange between the ranks.
        assert torch.autograd.gradcheck(replicated_seq_to_heads, (x, order), fast_mode=True)
        assert torch.autograd.gradcheck(replicated_heads_to_seq, (x, order), fast_mode=True)
        for grad in (False, True):
            local = full(seq=4, grad=grad)
            torch.library.opcheck(torch.ops.tdx.all_to_all_seq_to_heads, (local, name, order))
            torch.library.opcheck(torch.ops.tdx.all_to_all_heads_to_seq, (full(heads=2, seq=8, grad=grad), name, order))
    return True


def test_gradcheck_and_opcheck(world2):
    assert all(world2.run(run_gradcheck_and_opcheck))


def run_compiled():
    name = mesh().get_group().group_name

    def fn(x):
        return all_to_all_heads_to_seq(all_to_all_seq_to_heads(x, name, "zigzag").sin(), name, "zigzag")

    x = full(seq=4, grad=True)
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
    all_to_all_seq_to_heads(full(heads=3, seq=4), mesh().get_group().group_name, "contiguous")


def sequence_not_divisible():
    all_to_all_heads_to_seq(full(heads=2, seq=3), mesh().get_group().group_name, "contiguous")


def zigzag_sequence_not_divisible():
    all_to_all_heads_to_seq(full(heads=2, seq=6), mesh().get_group().group_name, "zigzag")


def odd_zigzag_shard():
    all_to_all_seq_to_heads(full(heads=2, seq=3), mesh().get_group().group_name, "zigzag")


def not_4d():
    all_to_all_seq_to_heads(torch.zeros(4, 3, 5), mesh().get_group().group_name, "contiguous")


def bad_order():
    all_to_all_seq_to_heads(full(heads=2, seq=4), mesh().get_group().group_name, "striped")


@pytest.mark.parametrize(
    "fn, error, message",
    [
        (heads_not_divisible, RuntimeError, r"heads \(3\) must be divisible by the group size 2"),
        (sequence_not_divisible, RuntimeError, r"seq \(3\) must be divisible by 2 \(the group size 2\)"),
        (zigzag_sequence_not_divisible, RuntimeError, r"seq \(6\) must be divisible by 4 \(the group size 2, times 2"),
        (odd_zigzag_shard, RuntimeError, "the zigzag order needs an even local sequence"),
        (not_4d, RuntimeError, r"x must be \[batch, heads, seq, head_dim\]"),
        (bad_order, ValueError, "order must be 'contiguous' or 'zigzag', got 'striped'"),
    ],
)
def test_bad_input(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
