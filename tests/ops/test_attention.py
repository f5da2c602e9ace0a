"""tdx::ring_attention_fwd / _bwd and tdx::lse_merge_: opcheck, float64 gradcheck, compile, bad input.

(Forward and gradients against SDPA for every order and head count: tests/parallel/test_context_parallel.py.)
"""

import math

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401
from torchdist_ext.cpu_isa import use_cpu_isa
from torchdist_ext.ops import lse_merge_, ring_attention_fwd
from torchdist_ext.parallel import hybrid_attention, shard_sequence, ulysses_attention, unshard_sequence
from torchdist_ext.parallel import ring_attention as parallel_ring_attention
from torchdist_ext.testing import cached_mesh


def cp_mesh():
    return cached_mesh((dist.get_world_size(),), ("cp",))


def draw(seed, *shape, dtype=torch.float32, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    return t.requires_grad_(grad)


def test_lse_merge_matches_the_merge_in_float64(cpu_isa):
    """Against the merge computed in float64 from the same inputs, within the kernel's error bound
    (tests/cpp/error_bounds.h, one merge): u [24 (|A| + |B|) + (15 + |lse|) |A - B| / 4], u = 2^-24,
    for the weights' exps, the products and sum, and the weights' sensitivity to the lse's rounding."""
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(2, 3, 5, 8, generator=gen)
    lse = torch.randn(2, 3, 5, generator=gen)
    lse[0, 0, 0] = -math.inf  # an empty accumulator row takes the block
    block_out = torch.randn(2, 3, 5, 8, generator=gen).bfloat16()
    block_lse = torch.randn(2, 3, 5, generator=gen)
    block_lse[1, 2, 4] = -math.inf  # a block row that saw no key leaves the row alone
    a, b, la, lb = out.double(), block_out.double(), lse.double(), block_lse.double()
    new_lse = torch.logaddexp(la, lb)
    expected = a * (la - new_lse).exp()[..., None] + b * (lb - new_lse).exp()[..., None]
    expected[1, 2, 4], new_lse[1, 2, 4] = a[1, 2, 4], la[1, 2, 4]
    u = 2.0**-24
    bound = u * (24 * (a.abs() + b.abs()) + (15 + new_lse.abs())[..., None] * (a - b).abs() / 4)
    with use_cpu_isa(cpu_isa):
        lse_merge_(out, lse, block_out, block_lse)
    assert ((out.double() - expected).abs() <= bound).all()
    assert ((lse.double() - new_lse).abs() <= u * (15 + new_lse.abs())).all()
    assert torch.equal(out[0, 0, 0], block_out[0, 0, 0].float()) and lse[0, 0, 0] == block_lse[0, 0, 0]


def test_lse_merge_into_a_slice_of_rows():
    """The ring merges partial blocks into row slices of its accumulator."""
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=gen)
    lse = torch.randn(2, 3, 6, dtype=torch.float64, generator=gen)
    block_out = torch.randn(2, 3, 3, 4, dtype=torch.float64, generator=gen)
    block_lse = torch.randn(2, 3, 3, dtype=torch.float64, generator=gen)
    expected_out, expected_lse = out.clone(), lse.clone()
    rows = slice(3, 6)
    merged_lse = torch.logaddexp(lse[..., rows], block_lse)
    expected_out[..., rows, :] = (out[..., rows, :] * (lse[..., rows] - merged_lse).exp()[..., None]
                                  + block_out * (block_lse - merged_lse).exp()[..., None])
    expected_lse[..., rows] = merged_lse
    lse_merge_(out.narrow(2, 3, 3), lse.narrow(2, 3, 3), block_out, block_lse)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


def test_lse_merge_opcheck_and_bad_input():
    out, lse = torch.zeros(2, 4, 8), torch.full((2, 4), -math.inf)
    torch.library.opcheck(torch.ops.tdx.lse_merge_, (out, lse, torch.randn(2, 4, 8), torch.randn(2, 4)))
    with pytest.raises(TypeError, match="out, lse and block_lse must be Float for a Float block"):
        lse_merge_(out.double(), lse, torch.randn(2, 4, 8), torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"must match out \[2, 4, 8\] and lse"):
        lse_merge_(out, lse, torch.randn(2, 4, 7), torch.randn(2, 4))


def context_mesh(method):
    """The context-parallel mesh of `method`: 1-D, or 2-D [ring, ulysses] for hybrid."""
    if method == "hybrid":
        return cached_mesh((2, dist.get_world_size() // 2), ("ring", "ulysses"))
    return cp_mesh()


def local_attention(method, cp, order, causal):
    """Attention of this rank's shards of q, k, v over `cp` = context_mesh(method) (what a model calls)."""

    def run(q, k, v):
        if method == "ring":
            return parallel_ring_attention(q, k, v, cp_mesh=cp, causal=causal, order=order)
        if method == "ulysses":
            return ulysses_attention(q, k, v, cp_mesh=cp, causal=causal, order=order)
        return hybrid_attention(q, k, v, cp_mesh=cp, causal=causal, order=order)

    return run


def sharded_attention(method, order, causal):
    """A replicated function of replicated q, k, v (for gradcheck and compile); meshes are built outside it."""
    cp = context_mesh(method)
    attention = local_attention(method, cp, order, causal)

    def run(q, k, v):
        local = [shard_sequence(t, cp_mesh=cp, dim=2, order=order) for t in (q, k, v)]
        return unshard_sequence(attention(*local), cp_mesh=cp, dim=2, order=order)

    return run


def run_gradcheck(method, order, q_heads, kv_heads, fast_mode=False):
    """gradcheck of the sharded attention in fp64; ``fast_mode``: against random projections of the Jacobian
    (torch's fast gradcheck), for the 4-rank hybrid whose every evaluation is a round of collectives."""
    seq = 2 * dist.get_world_size()
    q = draw(1, 1, q_heads, seq, 4, dtype=torch.float64, grad=True)
    k = draw(2, 1, kv_heads, seq, 4, dtype=torch.float64, grad=True)
    v = draw(3, 1, kv_heads, seq, 4, dtype=torch.float64, grad=True)
    torch.manual_seed(0)  # fast mode's random projections: the same on every rank, as the replicated inputs are
    for causal in (False, True):
        assert torch.autograd.gradcheck(sharded_attention(method, order, causal), (q, k, v), fast_mode=fast_mode)
    return True


@pytest.mark.parametrize(
    "method, order", [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "contiguous"), ("ulysses", "zigzag")]
)
def test_gradcheck_fp64(world2, method, order):
    assert all(world2.run(run_gradcheck, method, order, 4, 2))


def test_gradcheck_fp64_hybrid(world4):
    assert all(world4.run(run_gradcheck, "hybrid", "zigzag", 2, 1, fast_mode=True))


def run_opcheck():
    name = cp_mesh().get_group().group_name
    for requires_grad in (False, True):
        q = draw(1, 2, 4, 6, 8, grad=requires_grad)
        k = draw(2, 2, 2, 6, 8, grad=requires_grad)
        v = draw(3, 2, 2, 6, 8, grad=requires_grad)
        for causal, order in ((True, "zigzag"), (False, "contiguous")):
            torch.library.opcheck(torch.ops.tdx.ring_attention_fwd, (q, k, v, name, causal, 0.3, order))
    out, lse = ring_attention_fwd(q.detach(), k.detach(), v.detach(), name, True, 0.3, "zigzag")
    torch.library.opcheck(
        torch.ops.tdx.ring_attention_bwd,
        (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse, name, True, 0.3, "zigzag"),
    )
    return True


def test_opcheck(world2):
    assert all(world2.run(run_opcheck))


def run_compiled(method, dynamic):
    """Compiled equals eager, forward and gradients. Static: the whole replicated function, sharding
    and unsharding included. Dynamic: the attention of local shards, as a model compiles it, at two
    sequence lengths on one graph (no recompile)."""
    torch._dynamo.reset()
    order = "contiguous" if method == "ulysses" else "zigzag"
    cp = context_mesh(method)
    fn = local_attention(method, cp, order, True) if dynamic else sharded_attention(method, order, True)

    def shard(t):
        return (shard_sequence(t, cp_mesh=cp, dim=2, order=order) if dynamic else t).requires_grad_(True)

    compiled_fn = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    # Local lengths never equal a head count or head_dim, which would share their symbol.
    for seq in (24, 48) if dynamic else (16,):
        q, k, v = (shard(draw(seed, 2, heads, seq, 8)) for seed, heads in ((1, 4), (2, 2), (3, 2)))
        eager = fn(q, k, v)
        eager_grads = torch.autograd.grad(eager.square().sum(), (q, k, v))
        with torch.compiler.set_stance("fail_on_recompile" if seq > 24 else "default"):
            compiled = compiled_fn(q, k, v)
        compiled_grads = torch.autograd.grad(compiled.square().sum(), (q, k, v))
        torch.testing.assert_close(compiled, eager)
        for c, e in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(c, e)
    return True


DYNAMIC = [pytest.param(False, id="static"), pytest.param(True, id="dynamic")]


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_compile_fullgraph(world2, method, dynamic):
    assert all(world2.run(run_compiled, method, dynamic))


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_compile_fullgraph_hybrid(world4, dynamic):
    assert all(world4.run(run_compiled, "hybrid", dynamic))


def odd_zigzag_sequence():
    parallel_ring_attention(draw(0, 1, 2, 5, 4), draw(1, 1, 2, 5, 4), draw(2, 1, 2, 5, 4), cp_mesh=cp_mesh())


def heads_do_not_divide():
    parallel_ring_attention(draw(0, 1, 3, 4, 4), draw(1, 1, 2, 4, 4), draw(2, 1, 2, 4, 4), cp_mesh=cp_mesh())


def qkv_shape_mismatch():
    parallel_ring_attention(draw(0, 1, 2, 4, 4), draw(1, 1, 2, 6, 4), draw(2, 1, 2, 6, 4), cp_mesh=cp_mesh())


def qkv_dtype_mismatch():
    parallel_ring_attention(draw(0, 1, 2, 4, 4), draw(1, 1, 2, 4, 4, dtype=torch.float64),
                            draw(2, 1, 2, 4, 4), cp_mesh=cp_mesh())


def not_4d():
    parallel_ring_attention(draw(0, 2, 4, 4), draw(1, 2, 4, 4), draw(2, 2, 4, 4), cp_mesh=cp_mesh())


def ulysses_heads_not_divisible():
    ulysses_attention(draw(0, 1, 3, 4, 4), draw(1, 1, 3, 4, 4), draw(2, 1, 3, 4, 4), cp_mesh=cp_mesh())


def wrong_mesh():
    mesh = cached_mesh((1, dist.get_world_size()), ("dp", "cp"))
    parallel_ring_attention(draw(0, 1, 2, 4, 4), draw(1, 1, 2, 4, 4), draw(2, 1, 2, 4, 4), cp_mesh=mesh)


def bad_order():
    parallel_ring_attention(draw(0, 1, 2, 4, 4), draw(1, 1, 2, 4, 4), draw(2, 1, 2, 4, 4), cp_mesh=cp_mesh(),
                            order="striped")


def sequence_not_divisible():
    shard_sequence(draw(0, 1, 2, 6, 4), cp_mesh=cp_mesh(), dim=2, order="zigzag")


CASES = [
    (odd_zigzag_sequence, ValueError, "local sequence must be even, got q.shape\\[2\\]=5"),
    (heads_do_not_divide, ValueError, r"q heads \(3\) must be a multiple of kv heads \(2\)"),
    (qkv_shape_mismatch, ValueError, "must agree in batch, local sequence and head_dim"),
    (qkv_dtype_mismatch, TypeError, "q, k, v must share a dtype"),
    (not_4d, ValueError, r"q has shape \(2, 4, 4\); it must be \[batch, heads, seq_local, head_dim\]"),
    (ulysses_heads_not_divisible, ValueError, r"q heads \(3\) must be divisible by the size of cp_mesh \(2\)"),
    (wrong_mesh, ValueError, r"ring_attention takes a 1-D cp_mesh; a 2-D \[ring, ulysses\] mesh is for hybrid_attention"),
    (bad_order, ValueError, "order must be one of .* got 'striped'"),
    (sequence_not_divisible, ValueError, r"x.size\(2\)=6 must be divisible by 4 to shard it with the zigzag"),
]


@pytest.mark.parametrize("fn, error, message", CASES, ids=[case[0].__name__ for case in CASES])
def test_bad_input(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
    assert world2.alive
