"""Balanced sequence plans (``balanced_sequence_plan``) in ring, Ulysses and hybrid attention.

The plan against counting: a permutation, ``seq / cp`` ascending positions per rank, costs equal to the
(query, key) pairs of the single-process mask, the issue's 5 % spread on long-tailed mixes. The attention on a
plan's shards against float64 single-process SDPA with the block-diagonal causal mask, forward and every
gradient, on 2, 4 and 8 ranks with GQA; padding exactly 0.
"""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from tests.parallel.test_context_documents import ATTENTIONS, HEAD_DIM, KV_HEADS, cp_mesh_of
from tests.parallel.test_context_documents import assert_compiled_matches_eager_without_recompiles
from tests.parallel.test_context_documents import document_mixes, ids_from_lengths, reference
from torchdist_ext.parallel import balanced_sequence_plan, ring_attention, ulysses_attention
from torchdist_ext.testing import cached_mesh

Q_HEADS = 8  # Ulysses over 8 ranks needs 8 q heads (the 2 kv heads are replicated to 8)


def long_tailed_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] documents of log-normal lengths (median ~400 tokens, scaled by seq / 16384)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq:
            length = int(torch.empty(1).log_normal_(6.0, 1.2, generator=gen) * seq / 16384) + 1
            lengths.append(min(length, seq - total))
            total += lengths[-1]
        rows.append(ids_from_lengths(lengths))
    return torch.stack(rows)


def visible_pairs(ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq]: each query's visible keys, counted on the single-process causal document mask."""
    seq = ids.shape[1]
    mask = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0) & torch.ones(seq, seq).tril().bool()
    return mask.sum(-1)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_plan_is_a_balanced_permutation_with_the_counted_costs(cp):
    ids = torch.cat([long_tailed_ids(2, 96 * cp, seed=cp), document_mixes(96 * cp)["padded"]])
    plan = balanced_sequence_plan(ids, cp)
    assert plan.indices.shape == (4, cp, 96) and plan.indices.dtype == torch.int64
    assert (plan.indices.flatten(1).sort(dim=1).values == torch.arange(96 * cp)).all()
    assert (plan.indices.diff(dim=2) > 0).all()  # ascending within each rank
    pairs = visible_pairs(ids)
    expected = torch.stack([pairs[b, plan.indices[b]].sum(-1) for b in range(4)]).sum(0)
    assert plan.costs.tolist() == expected.double().tolist()


@pytest.mark.parametrize("cp", [4, 8])
def test_plan_spread_on_long_tailed_mixes(cp):
    """The issue's goal (spread <= 5 % of the costs) on the benchmark's mix, against zigzag's on the same rows."""
    ids = long_tailed_ids(8, 16384, seed=11)
    for row in ids:
        plan = balanced_sequence_plan(row[None], cp)
        assert plan.spread <= 0.05
        zigzag = torchdist_ext.ops.context_attention_work(row[None], cp, "zigzag", True).sum(1).double()
        assert plan.spread < float(zigzag.max() / zigzag.mean() - 1)


def test_ulysses_and_hybrid_plans():
    ids = long_tailed_ids(2, 1024)
    total = float(visible_pairs(ids).sum())
    ulysses = balanced_sequence_plan(ids, 4, method="ulysses")
    assert (ulysses.indices.flatten(1) == torch.arange(1024)).all()  # no reordering: every rank attends it all
    assert ulysses.costs.tolist() == [total / 4] * 4 and ulysses.spread == 0.0
    hybrid = balanced_sequence_plan(ids, (2, 4), method="hybrid")
    ring = balanced_sequence_plan(ids, 2)
    assert torch.equal(hybrid.indices, ring.indices) and hybrid.costs.shape == (8,)
    assert hybrid.costs.tolist() == [c / 4 for c in ring.costs.tolist() for _ in range(4)]


def check_plan_attention(method, causal):
    n = dist.get_world_size()
    cp_mesh = cp_mesh_of(method)
    cp_size = (2, n // 2) if method == "hybrid" else n
    seq = 16 * n
    gen = torch.Generator().manual_seed(5)
    q, k, v, upstream = (torch.randn(2, heads, seq, HEAD_DIM, generator=gen)
                         for heads in (Q_HEADS, KV_HEADS, KV_HEADS, Q_HEADS))
    mixes = {**document_mixes(seq), "long_tailed": long_tailed_ids(2, seq, seed=n)}
    for mix, ids in mixes.items():
        plan = balanced_sequence_plan(ids, cp_size, method=method)
        expected, expected_grads = reference(q, k, v, upstream, ids, causal)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        local = [plan.shard(t, dim=2, cp_mesh=cp_mesh) for t in inputs]
        out_local = ATTENTIONS[method](*local, cp_mesh=cp_mesh, causal=causal,
                                       document_ids=plan.shard(ids, dim=1, cp_mesh=cp_mesh),
                                       positions=plan.positions(cp_mesh=cp_mesh))
        actual = plan.unshard(out_local, dim=2, cp_mesh=cp_mesh)
        actual.backward(upstream)
        assert_close_to_scale(actual, expected, torch.float32, f"{mix}: out")
        pad = ids < 0
        assert (actual.transpose(1, 2)[pad] == 0).all(), f"{mix}: padding output"
        for name, got, want in zip(("dq", "dk", "dv"), inputs, expected_grads):
            assert_close_to_scale(got.grad, want, torch.float32, f"{mix}: {name}")
            assert (got.grad.transpose(1, 2)[pad] == 0).all(), f"{mix}: {name} of padding"
    return True


@pytest.mark.parametrize("method", ["ring", "ulysses", "hybrid"])
@pytest.mark.parametrize("world", ["world2", "world4", "world8"])
def test_plan_shards_match_masked_sdpa(world, method, request):
    assert all(request.getfixturevalue(world).run(check_plan_attention, method, True))


def test_plan_shards_without_causal_mask(world4):
    assert all(world4.run(check_plan_attention, "ring", False))


def check_ring_plan_of_ulysses_mesh():
    """A ring plan's shards (not contiguous) in Ulysses attention: the gathered positions order the rows."""
    cp_mesh = cp_mesh_of("ulysses")
    seq = 16 * dist.get_world_size()
    ids = long_tailed_ids(1, seq, seed=3)
    plan = balanced_sequence_plan(ids, dist.get_world_size())
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, generator=gen) for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
    expected, _ = reference(q, k, v, torch.zeros_like(q), ids, True)
    local = [plan.shard(t, dim=2, cp_mesh=cp_mesh) for t in (q, k, v)]
    out = ATTENTIONS["ulysses"](*local, cp_mesh=cp_mesh, causal=True, positions=plan.positions(cp_mesh=cp_mesh),
                                document_ids=plan.shard(ids, dim=1, cp_mesh=cp_mesh))
    assert_close_to_scale(plan.unshard(out, dim=2, cp_mesh=cp_mesh), expected, torch.float32, "out")
    return True


def test_ring_plan_in_ulysses_attention(world4):
    assert all(world4.run(check_ring_plan_of_ulysses_mesh))


def run_compiled_with_moving_plans(method):
    """Compiled fullgraph equals eager, and new documents (a new plan, same shapes) do not recompile."""
    torch._dynamo.reset()
    n = dist.get_world_size()
    cp_mesh = cp_mesh_of(method)
    cp_size = (2, n // 2) if method == "hybrid" else n
    seq = 16 * n
    attention = ATTENTIONS[method]

    def attend(q, k, v, ids, positions):
        return attention(q, k, v, cp_mesh=cp_mesh, causal=True, document_ids=ids, positions=positions)

    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(2, heads, seq, HEAD_DIM, generator=gen) for heads in (Q_HEADS, KV_HEADS, KV_HEADS)]

    def steps():
        for ids in (long_tailed_ids(2, seq, seed=s) for s in range(3)):
            plan = balanced_sequence_plan(ids, cp_size, method=method)
            yield ([plan.shard(t, dim=2, cp_mesh=cp_mesh) for t in full],
                   (plan.shard(ids, dim=1, cp_mesh=cp_mesh), plan.positions(cp_mesh=cp_mesh)))

    assert_compiled_matches_eager_without_recompiles(attend, steps())
    return True


@pytest.mark.parametrize("method", ["ring", "ulysses", "hybrid"])
def test_compile_with_moving_plans(world4, method):
    assert all(world4.run(run_compiled_with_moving_plans, method))


def run_opcheck():
    name = cached_mesh((dist.get_world_size(),), ("cp",)).get_group().group_name
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, heads, 6, HEAD_DIM, generator=gen).requires_grad_(True)
               for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
    ids = torch.tensor([[0, 0, 1, 1, 1, -1], [-1, 2, 2, 3, 3, 3]])
    # Two ranks' shards of 12 positions: row 0 zigzag-like, row 1 contiguous; one rank's 6 in any order.
    positions = (torch.tensor([[0, 1, 2, 9, 10, 11], [0, 1, 2, 3, 4, 5]]) if dist.get_rank() == 0 else
                 torch.tensor([[3, 4, 5, 6, 7, 8], [6, 7, 8, 9, 10, 11]]))
    local_positions = torch.tensor([[0, 1, 2, 5, 4, 3], [3, 4, 5, 0, 1, 2]])
    for causal in (True, False):
        args = (q, k, v, name, causal, 0.3, "contiguous", ids, positions)
        torch.library.opcheck(torch.ops.tdx.ring_attention_fwd, args)
        torch.library.opcheck(torch.ops.tdx.document_attention_fwd, (q, k, v, ids, causal, 0.3, local_positions))
    out, lse = torchdist_ext.ops.ring_attention_fwd(q.detach(), k.detach(), v.detach(), name, True, 0.3,
                                                    "contiguous", ids, positions)
    grad_args = (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(torch.ops.tdx.ring_attention_bwd, (*grad_args, name, True, 0.3, "contiguous", ids,
                                                             positions))
    out, lse = torchdist_ext.ops.document_attention_fwd(q.detach(), k.detach(), v.detach(), ids, True, 0.3,
                                                        local_positions)
    grad_args = (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(torch.ops.tdx.document_attention_bwd, (*grad_args, ids, True, 0.3, local_positions))
    return True


def test_opcheck(world2):
    assert all(world2.run(run_opcheck))


def test_plan_op_opcheck():
    # The plan reads ids on the host: schema and dispatch checks (its fake refuses tracing, by design).
    torch.library.opcheck(torch.ops.tdx.balanced_sequence_plan, (long_tailed_ids(2, 64), 4),
                          test_utils=("test_schema", "test_autograd_registration"))


BAD_PLANS = [
    (dict(document_ids=torch.zeros(2, 30, dtype=torch.long), cp_size=4), ValueError,
     r"the sequence \(30\) must split into 4 equal shards"),
    (dict(document_ids=torch.zeros(30, dtype=torch.long), cp_size=2), ValueError,
     r"document_ids has shape \(30,\); it must be \[batch, seq\]"),
    (dict(document_ids=torch.zeros(1, 32), cp_size=2), TypeError, "document_ids must be an integer tensor"),
    (dict(document_ids=torch.zeros(1, 32, dtype=torch.long), cp_size=0), ValueError,
     "cp_size must be a positive int for method='ring', got 0"),
    (dict(document_ids=torch.zeros(1, 32, dtype=torch.long), cp_size=4, method="hybrid"), ValueError,
     r"cp_size must be \(ring, ulysses\), two positive ints, for method='hybrid'; got 4"),
    (dict(document_ids=torch.zeros(1, 32, dtype=torch.long), cp_size=4, method="striped"), ValueError,
     r"method must be one of \('ring', 'ulysses', 'hybrid'\), got 'striped'"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_PLANS)
def test_bad_plans(kwargs, error, message):
    with pytest.raises(error, match=message):
        balanced_sequence_plan(**kwargs)


def plan_for_another_mesh():
    plan = balanced_sequence_plan(torch.zeros(1, 32, dtype=torch.long), 4)
    plan.shard(torch.zeros(1, 32), dim=1, cp_mesh=cached_mesh((dist.get_world_size(),), ("cp",)))


def plan_shards_batch_dim():
    plan = balanced_sequence_plan(torch.zeros(1, 32, dtype=torch.long), dist.get_world_size())
    plan.shard(torch.zeros(1, 32), dim=0, cp_mesh=cached_mesh((dist.get_world_size(),), ("cp",)))


def plan_shards_wrong_length():
    plan = balanced_sequence_plan(torch.zeros(1, 32, dtype=torch.long), dist.get_world_size())
    plan.shard(torch.zeros(1, 16), dim=1, cp_mesh=cached_mesh((dist.get_world_size(),), ("cp",)))


def order_with_positions():
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    q = torch.randn(1, 2, 4, 4)
    ring_attention(q, q, q, cp_mesh=mesh, order="zigzag", positions=torch.zeros(1, 4, dtype=torch.long))


def positions_float():
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    q = torch.randn(1, 2, 4, 4)
    ring_attention(q, q, q, cp_mesh=mesh, positions=torch.zeros(1, 4))


def plans_from_different_ids(method):
    """Each rank plans its own document ids: the shards' positions no longer cover the sequence once."""
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    ids = torch.tensor([[0] * 12 + [1] * 4]) if dist.get_rank() == 0 else torch.tensor([[0] * 2 + [1] * 14])
    plan = balanced_sequence_plan(ids, dist.get_world_size())
    q = plan.shard(torch.randn(1, 2, 16, 8), dim=2, cp_mesh=mesh)
    attention = ring_attention if method == "ring" else ulysses_attention
    attention(q, q, q, cp_mesh=mesh, causal=True, document_ids=plan.shard(ids, dim=1, cp_mesh=mesh),
              positions=plan.positions(cp_mesh=mesh))


def duplicate_positions():
    mesh = cached_mesh((dist.get_world_size(),), ("cp",))
    q = torch.randn(1, 2, 4, 8)
    ring_attention(q, q, q, cp_mesh=mesh, causal=True, positions=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_plans_of_different_ids_are_refused_on_every_rank(world2, method):
    errors = world2.run(refused, plans_from_different_ids, method)
    assert all("must hold each position 0..15 exactly once over the" in error for error in errors), errors


def refused(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as error:
        return str(error)
    raise AssertionError("nothing was raised")


BAD_CALLS = [
    (plan_for_another_mesh, ValueError, r"cp_mesh has shape \(2,\); this ring plan is for a mesh of shape \(4,\)"),
    (plan_shards_batch_dim, ValueError, "dim=0 is the batch dim"),
    (plan_shards_wrong_length, ValueError, r"x has shape \(1, 16\); the plan needs 1 rows at dim 0 and 32 tokens"),
    (order_with_positions, ValueError, "order='zigzag' and positions are exclusive"),
    (positions_float, TypeError, "positions must be an integer tensor, got torch.float32"),
    (duplicate_positions, ValueError, r"positions of batch row 0 must hold each position 0..7 exactly once over the "
                                      r"2 rank\(s\), but 0 \(rank 0, row 1\) is held twice"),
]


@pytest.mark.parametrize("fn, error, message", BAD_CALLS, ids=[case[0].__name__ for case in BAD_CALLS])
def test_bad_calls(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
