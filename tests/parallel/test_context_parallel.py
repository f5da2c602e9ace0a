"""Ring, Ulysses and hybrid attention against single-process SDPA on the full sequence.

Every rank builds the same full q, k, v and upstream gradient; the parallel
side shards them with shard_sequence, attends, and unshards the output; the
output and dq, dk, dv must match F.scaled_dot_product_attention (float64
reference on the same values).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from torchdist_ext.parallel import (
    hybrid_attention,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from torchdist_ext.testing import cached_mesh

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
BATCH, HEAD_DIM = 2, 16


def full_inputs(q_heads, kv_heads, seq, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q = draw(BATCH, q_heads, seq, HEAD_DIM)
    k = draw(BATCH, kv_heads, seq, HEAD_DIM)
    v = draw(BATCH, kv_heads, seq, HEAD_DIM)
    return q, k, v, draw(BATCH, q_heads, seq, HEAD_DIM)


def parallel_setup(method):
    """(cp_mesh for shard_sequence, attention callable taking q, k, v, causal, order)."""
    n = dist.get_world_size()
    if method == "hybrid":
        mesh = cached_mesh((2, n // 2), ("ring", "ulysses"))
        attention = hybrid_attention
    else:
        mesh = cached_mesh((n,), ("cp",))
        attention = ring_attention if method == "ring" else ulysses_attention
    return mesh, lambda q, k, v, causal, order: attention(q, k, v, cp_mesh=mesh, causal=causal, order=order)


def check_against_sdpa(method, causal, order, heads, dtype):
    q_heads, kv_heads = HEADS[heads]
    seq = 8 * dist.get_world_size()
    q, k, v, upstream = full_inputs(q_heads, kv_heads, seq, dtype)

    reference = [t.double().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*reference, is_causal=causal, enable_gqa=q_heads != kv_heads)
    expected.backward(upstream.double())

    cp_mesh, attend = parallel_setup(method)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    local = [shard_sequence(t, cp_mesh=cp_mesh, dim=2, order=order) for t in inputs]
    out_local = attend(*local, causal, order)
    assert out_local.shape == local[0].shape and out_local.dtype == dtype
    actual = unshard_sequence(out_local, cp_mesh=cp_mesh, dim=2, order=order)
    actual.backward(upstream)

    assert_close_to_scale(actual, expected, dtype, "out")
    for name, got, want in zip(("dq", "dk", "dv"), inputs, reference):
        assert_close_to_scale(got.grad, want.grad, dtype, name)
    return True


CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_ring_attention_fp32(world, causal, order, heads, request):
    assert all(request.getfixturevalue(world).run(check_against_sdpa, "ring", causal, order, heads, torch.float32))


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_ulysses_attention_fp32(world, causal, order, heads, request):
    assert all(
        request.getfixturevalue(world).run(check_against_sdpa, "ulysses", causal, order, heads, torch.float32)
    )


def check_default_orders_agree():
    """shard_sequence and every attention with their default orders (zigzag) match SDPA."""
    q, k, v, _ = full_inputs(4, 2, 8 * dist.get_world_size(), torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for method in ("ring", "ulysses", "hybrid"):
        cp_mesh, _ = parallel_setup(method)
        attention = {"ring": ring_attention, "ulysses": ulysses_attention, "hybrid": hybrid_attention}[method]
        local = [shard_sequence(t, cp_mesh=cp_mesh, dim=2) for t in (q, k, v)]
        actual = unshard_sequence(attention(*local, cp_mesh=cp_mesh, causal=True), cp_mesh=cp_mesh, dim=2)
        assert_close_to_scale(actual, expected, torch.float32, method)
    return True


def test_default_orders_agree(world4):
    assert all(world4.run(check_default_orders_agree))


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_hybrid_attention_2x2_fp32(world4, causal, order, heads):
    assert all(world4.run(check_against_sdpa, "hybrid", causal, order, heads, torch.float32))


@pytest.mark.parametrize("method", ["ring", "ulysses", "hybrid"])
def test_bf16(world4, method):
    assert all(world4.run(check_against_sdpa, method, True, "zigzag", "gqa", torch.bfloat16))


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class AttentionBlock(torch.nn.Module):
    """x + Wo attention(Wq x, Wk x, Wv x) with grouped-query heads; `attend` supplies the attention."""

    def __init__(self, hidden=16, q_heads=4, kv_heads=2, attend=None):
        super().__init__()
        self.head_dim = hidden // q_heads
        self.wq = torch.nn.Linear(hidden, q_heads * self.head_dim)
        self.wk = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.wv = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.wo = torch.nn.Linear(q_heads * self.head_dim, hidden)
        self.attend = attend or causal_sdpa

    def forward(self, x):
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        return x + self.wo(self.attend(q, k, v).transpose(1, 2).flatten(-2))


def check_fsdp_dp2_cp2(method, mixed_precision):
    """dp=2 x cp=2: FSDP2 shards over the flattened dp x cp mesh, because the cp ranks hold the same
    parameters and their gradients (from different tokens) must be summed too. With mixed precision,
    attention runs in bf16 and gradients are reduced in fp32 (bf16 tolerance against fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = cached_mesh((2, 2), ("dp", "cp"))
    cp = mesh["cp"]
    order = "zigzag"
    torch.manual_seed(0)
    reference = torch.nn.Sequential(AttentionBlock(), AttentionBlock())
    attention = ring_attention if method == "ring" else ulysses_attention
    attend = lambda q, k, v: attention(q, k, v, cp_mesh=cp, causal=True, order=order)  # noqa: E731
    torch.manual_seed(0)
    parallel = torch.nn.Sequential(AttentionBlock(attend=attend), AttentionBlock(attend=attend))
    parallel.load_state_dict(reference.state_dict())
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    policy, dtype = MixedPrecisionPolicy(), torch.float32
    if mixed_precision:
        policy, dtype = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), torch.bfloat16
    for block in parallel:
        fully_shard(block, mesh=dp_cp, mp_policy=policy)
    fully_shard(parallel, mesh=dp_cp, mp_policy=policy)

    x = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(1))
    expected = reference(x)
    expected_loss = (expected.sin() * expected).mean()
    expected_loss.backward()
    x_local = shard_sequence(x.chunk(2)[mesh["dp"].get_local_rank()], cp_mesh=cp, dim=1, order=order)
    y = parallel(x_local)
    loss = (y.sin() * y).mean()
    loss.backward()
    assert loss.dtype == dtype
    global_loss = loss.detach().float()
    dist.all_reduce(global_loss)
    assert_close_to_scale(global_loss / 4, expected_loss, dtype, "loss")
    for (name, p), ref in zip(parallel.named_parameters(), reference.parameters()):
        assert_close_to_scale(p.grad.full_tensor(), ref.grad, dtype, f"{name} grad")
    return True


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16-params-fp32-reduce"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_fsdp_dp2_x_cp2_gradients_match_one_process(world4, method, mixed_precision):
    assert all(world4.run(check_fsdp_dp2_cp2, method, mixed_precision))
