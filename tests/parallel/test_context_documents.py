"""Packed sequences in ring, Ulysses and hybrid attention: ``document_ids`` against single-process SDPA.

Every rank builds the same full q, k, v, upstream gradient and per-token
document ids; the parallel side shards all of them with shard_sequence, attends
with ``document_ids`` and unshards the output. The reference is float64 SDPA on
the full sequence with the equivalent block-diagonal (causal) mask; padding
tokens (negative ids) must give exactly 0, output and every gradient.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from torchdist_ext import ops
from torchdist_ext.parallel import (
    hybrid_attention,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from torchdist_ext.testing import cached_mesh

Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
ATTENTIONS = {"ring": ring_attention, "ulysses": ulysses_attention, "hybrid": hybrid_attention}


def ids_from_lengths(lengths: list[int]) -> torch.Tensor:
    """Documents 0, 1, ... of the given lengths; a negative length is that much padding (id -1)."""
    parts, doc = [], 0
    for length in lengths:
        if length < 0:
            parts.append(torch.full((-length,), -1))
        else:
            parts.append(torch.full((length,), doc))
            doc += 1
    return torch.cat(parts)


def document_mixes(seq: int) -> dict[str, torch.Tensor]:
    """[2, seq] ids per mix; the two batch rows pack different documents."""
    half = seq // 2
    short = [1, 2, 3] * (seq // 6) + [1] * (seq % 6)
    mixes = {
        "short": (short, short[::-1]),  # documents of 1 to 3 tokens: shorter than any shard
        "long": ([3, seq - 7, 4], [seq - 2, 2]),  # a document longer than a shard
        "fold": ([half - 3, 6, half - 3], [2, half - 2, half]),  # across the middle, where zigzag folds
        "padded": ([-5, 7, seq - 12], [seq - 9, 2, -7]),  # left and right padding around documents
    }
    return {name: torch.stack([ids_from_lengths(a), ids_from_lengths(b)]) for name, (a, b) in mixes.items()}


def reference(q, k, v, upstream, ids, causal):
    """Float64 SDPA with the block-diagonal (causal) mask; padding rows attend to themselves only and
    their output is zeroed, so they pass no gradient anywhere."""
    pad = ids < 0
    mask = (ids[:, :, None] == ids[:, None, :]) & ~pad[:, :, None]
    if causal:
        mask &= torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    mask |= torch.diag_embed(pad)
    inputs = [t.double().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*inputs, attn_mask=mask[:, None], enable_gqa=True)
    out = out.masked_fill(pad[:, None, :, None], 0.0)
    out.backward(upstream.double())
    return out, [t.grad for t in inputs]


def cp_mesh_of(method):
    n = dist.get_world_size()
    if method == "hybrid":
        return cached_mesh((2, n // 2), ("ring", "ulysses"))
    return cached_mesh((n,), ("cp",))


def check_documents(method, causal, order):
    cp_mesh = cp_mesh_of(method)
    seq = 8 * dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    q, k, v, upstream = (torch.randn(2, heads, seq, HEAD_DIM, generator=gen)
                         for heads in (Q_HEADS, KV_HEADS, KV_HEADS, Q_HEADS))
    for mix, ids in document_mixes(seq).items():
        expected, expected_grads = reference(q, k, v, upstream, ids, causal)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        local = [shard_sequence(t, cp_mesh=cp_mesh, dim=2, order=order) for t in inputs]
        local_ids = shard_sequence(ids, cp_mesh=cp_mesh, dim=1, order=order)
        out_local = ATTENTIONS[method](*local, cp_mesh=cp_mesh, causal=causal, order=order,
                                       document_ids=local_ids)
        actual = unshard_sequence(out_local, cp_mesh=cp_mesh, dim=2, order=order)
        actual.backward(upstream)
        assert_close_to_scale(actual, expected, torch.float32, f"{mix}: out")
        pad = ids < 0
        assert (actual[:, :, :][pad[:, None].expand_as(actual[..., 0])] == 0).all(), f"{mix}: padding output"
        for name, got, want in zip(("dq", "dk", "dv"), inputs, expected_grads):
            assert_close_to_scale(got.grad, want, torch.float32, f"{mix}: {name}")
            assert (got.grad.transpose(1, 2)[pad] == 0).all(), f"{mix}: {name} of padding"
    return True


CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]
ORDERS = ["contiguous", "zigzag"]


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_documents_match_masked_sdpa(world, method, causal, order, request):
    assert all(request.getfixturevalue(world).run(check_documents, method, causal, order))


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("order", ORDERS)
def test_hybrid_documents_match_masked_sdpa(world4, causal, order):
    assert all(world4.run(check_documents, "hybrid", causal, order))


def check_one_document_is_plain_attention(method):
    """Every token in document 0 is exactly the attention without ids (the same tasks, batch row by row)."""
    cp_mesh = cp_mesh_of(method)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, heads, 4 * dist.get_world_size(), HEAD_DIM, generator=gen)
               for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
    local = [shard_sequence(t, cp_mesh=cp_mesh, dim=2) for t in (q, k, v)]
    ids = torch.zeros(2, local[0].shape[2], dtype=torch.int32)
    with_ids = ATTENTIONS[method](*local, cp_mesh=cp_mesh, causal=True, document_ids=ids)
    without = ATTENTIONS[method](*local, cp_mesh=cp_mesh, causal=True)
    torch.testing.assert_close(with_ids, without)
    return True


@pytest.mark.parametrize("method", ["ring", "ulysses", "hybrid"])
def test_one_document_is_plain_attention(world4, method):
    assert all(world4.run(check_one_document_is_plain_attention, method))


def run_compiled_with_moving_boundaries(method):
    """Compiled fullgraph equals eager, and new document boundaries (same shapes) do not recompile."""
    torch._dynamo.reset()
    cp_mesh = cp_mesh_of(method)
    seq = 8 * dist.get_world_size()
    attention = ATTENTIONS[method]

    def attend(q, k, v, ids):
        return attention(q, k, v, cp_mesh=cp_mesh, causal=True, document_ids=ids)

    gen = torch.Generator().manual_seed(2)
    full = [torch.randn(2, heads, seq, HEAD_DIM, generator=gen) for heads in (Q_HEADS, KV_HEADS, KV_HEADS)]
    steps = (([shard_sequence(t, cp_mesh=cp_mesh, dim=2) for t in full], (shard_sequence(mix, cp_mesh=cp_mesh, dim=1),))
             for mix in document_mixes(seq).values())
    assert_compiled_matches_eager_without_recompiles(attend, steps)
    return True


def assert_compiled_matches_eager_without_recompiles(attend, steps) -> None:
    """``attend(q, k, v, *rows)`` compiled fullgraph equals eager, output and gradients, at every step of
    ``steps`` ((q, k, v), rows) after the first without a recompile."""
    compiled = torch.compile(attend, fullgraph=True)
    for step, (qkv, rows) in enumerate(steps):
        inputs = [t.detach().requires_grad_(True) for t in qkv]
        eager = attend(*inputs, *rows)
        eager_grads = torch.autograd.grad(eager.square().sum(), inputs)
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            out = compiled(*inputs, *rows)
        grads = torch.autograd.grad(out.square().sum(), inputs)
        torch.testing.assert_close(out, eager)
        for got, want in zip(grads, eager_grads):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", ["ring", "ulysses", "hybrid"])
def test_compile_with_moving_document_boundaries(world4, method):
    assert all(world4.run(run_compiled_with_moving_boundaries, method))


def run_opcheck():
    name = cached_mesh((dist.get_world_size(),), ("cp",)).get_group().group_name
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, heads, 6, HEAD_DIM, generator=gen).requires_grad_(True)
               for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
    ids = torch.tensor([[0, 0, 1, 1, 1, -1], [-1, 2, 2, 3, 3, 3]])
    for causal, order in ((True, "zigzag"), (False, "contiguous")):
        torch.library.opcheck(torch.ops.tdx.ring_attention_fwd, (q, k, v, name, causal, 0.3, order, ids))
        torch.library.opcheck(torch.ops.tdx.document_attention_fwd, (q, k, v, ids, causal, 0.3))
    out, lse = ops.ring_attention_fwd(q.detach(), k.detach(), v.detach(), name, True, 0.3, "zigzag", ids)
    assert torch.isinf(lse[0, :, 5]).all() and (out[0, :, 5] == 0).all()  # a padding row
    grad_args = (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(torch.ops.tdx.ring_attention_bwd, (*grad_args, name, True, 0.3, "zigzag", ids))
    out, lse = ops.document_attention_fwd(q.detach(), k.detach(), v.detach(), ids, True, 0.3)
    grad_args = (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(torch.ops.tdx.document_attention_bwd, (*grad_args, ids, True, 0.3))
    return True


def test_opcheck(world2):
    assert all(world2.run(run_opcheck))


def run_gradcheck(method):
    cp_mesh = cp_mesh_of(method)
    seq = 4 * dist.get_world_size()
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, heads, seq, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
               for heads in (2, 1, 1))
    ids = ids_from_lengths([3, -2, seq - 8, 3])[None]

    def attend(q, k, v):
        local = [shard_sequence(t, cp_mesh=cp_mesh, dim=2) for t in (q, k, v)]
        out = ATTENTIONS[method](*local, cp_mesh=cp_mesh, causal=True,
                                 document_ids=shard_sequence(ids, cp_mesh=cp_mesh, dim=1))
        return unshard_sequence(out, cp_mesh=cp_mesh, dim=2)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    return True


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_gradcheck_fp64(world2, method):
    assert all(world2.run(run_gradcheck, method))


def test_work_report_counts_the_visible_pairs():
    """context_attention_work: per-(rank, block) scores; their sum is the mask's count of visible pairs,
    documents skip blocks, and zigzag evens out the causal work of one document."""
    ids = torch.stack([ids_from_lengths([5, 9, 2, -16]), ids_from_lengths([32])])
    work = ops.context_attention_work(ids, 4, "zigzag", True)
    assert work.shape == (4, 4) and work.dtype == torch.int64
    visible = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0) & torch.ones(32, 32).tril().bool()
    assert work.sum() == visible.sum()
    short_documents = ops.context_attention_work(ids[:1], 4, "zigzag", True)
    assert (short_documents == 0).sum() == 8  # 16 tokens of documents, then padding: 8 of 16 blocks skipped
    one_document = ops.context_attention_work(torch.zeros(1, 32, dtype=torch.long), 4, "zigzag", True)
    assert len(set(one_document.sum(1).tolist())) == 1
    contiguous = ops.context_attention_work(torch.zeros(1, 32, dtype=torch.long), 4, "contiguous", True)
    assert contiguous.sum(1).tolist() == [36, 100, 164, 228]


def document_ids_float():
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    q = torch.randn(1, 2, 4, 4)
    ring_attention(q, q, q, cp_mesh=mesh, document_ids=torch.zeros(1, 4))


def document_ids_wrong_shape():
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    q = torch.randn(1, 2, 4, 4)
    ulysses_attention(q, q, q, cp_mesh=mesh, document_ids=torch.zeros(1, 8, dtype=torch.long))


def document_ids_not_a_tensor():
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    q = torch.randn(1, 2, 4, 4)
    ring_attention(q, q, q, cp_mesh=mesh, document_ids=[[0, 0, 0, 0]])


BAD = [
    (document_ids_float, TypeError, "document_ids must be an integer tensor, got torch.float32"),
    (document_ids_wrong_shape, ValueError, r"document_ids has shape \(1, 8\); it must be \[batch, seq_local\] = \[1, 4\]"),
    (document_ids_not_a_tensor, TypeError, "document_ids must be a torch.Tensor or None, got list"),
]


@pytest.mark.parametrize("fn, error, message", BAD, ids=[case[0].__name__ for case in BAD])
def test_bad_document_ids(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
    assert world2.alive


def test_work_report_bad_input():
    with pytest.raises(ValueError, match=r"the sequence \(30\) must split into 8 equal chunks"):
        ops.context_attention_work(torch.zeros(1, 30, dtype=torch.long), 4, "zigzag", True)
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        ops.context_attention_work(torch.zeros(1, 32), 4, "zigzag", True)
    with pytest.raises(ValueError, match="cannot run on meta or fake tensors"):
        ops.context_attention_work(torch.zeros(1, 32, dtype=torch.long, device="meta"), 4, "zigzag", True)
    with pytest.raises(TypeError, match="ranks must be an int, got bool"):
        ops.context_attention_work(torch.zeros(1, 32, dtype=torch.long), True, "zigzag", True)
