"""tdx::moe_dispatch / moe_combine / moe_permute / moe_unpermute: values, adjointness, float64 gradcheck,
opcheck, compile, bad input."""

import math

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401
from torchdist_ext.cpu_isa import use_cpu_isa
from torchdist_ext.ops import moe_combine, moe_dispatch, moe_grouped_mm, moe_permute, moe_unpermute
from torchdist_ext.testing import cached_mesh, gather_replicated, shard_replicated

E, K, D, T = 8, 2, 8, 10


def group():
    return cached_mesh((dist.get_world_size(),), ("ep",)).get_group().group_name


def routing(seed, tokens=T, num_experts=E, top_k=K):
    """expert_ids [T, k] (distinct per token, some slots dropped) and fp32 weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[torch.rand(tokens, top_k, generator=gen) < 0.2] = -1
    return ids, torch.rand(tokens, top_k, generator=gen)


def expected_received(xs, ids_all, weights_all, rank, experts_per_rank):
    """The rows rank `rank` must receive: every source's tokens with an expert here, in order."""
    rows, row_ids, row_weights = [], [], []
    for x, ids, weights in zip(xs, ids_all, weights_all):
        here = (ids >= 0) & (ids // experts_per_rank == rank)
        for t in range(x.shape[0]):
            if here[t].any():
                rows.append(x[t])
                row_ids.append(torch.where(here[t], ids[t] - rank * experts_per_rank, -1))
                row_weights.append(torch.where(here[t], weights[t], 0.0))
    if not rows:
        return torch.zeros(0, xs[0].shape[1]), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K)
    return torch.stack(rows), torch.stack(row_ids), torch.stack(row_weights)


def check_dispatch_values(rows_per_rank):
    n, r = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(T, D, generator=torch.Generator().manual_seed(10 + s)) for s in range(n)]
    routes = [routing(s) for s in range(n)]
    ids_all, weights_all = [ids for ids, _ in routes], [w for _, w in routes]
    got_x, got_ids, got_w, counts = moe_dispatch(xs[r], ids_all[r], weights_all[r], E, rows_per_rank, group())
    want_x, want_ids, want_w = expected_received(xs, ids_all, weights_all, r, E // n)
    if rows_per_rank >= 0:  # rank pairs padded to rows_per_rank: drop the blank rows
        valid = (got_ids >= 0).any(1)
        assert got_x.shape[0] == n * rows_per_rank and got_x[~valid].eq(0).all()
        got_x, got_ids, got_w = got_x[valid], got_ids[valid], got_w[valid]
    else:
        assert counts[1, :, 0].sum() == got_x.shape[0] and counts[1, :, 1:].sum() == (got_ids >= 0).sum()
    assert torch.equal(got_x, want_x) and torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    # The way back: a token's rows summed over the ranks that received it, its weights from their owners.
    out, out_w = moe_combine(got_x if rows_per_rank < 0 else moe_dispatch(xs[r], ids_all[r], weights_all[r], E,
                                                                          rows_per_rank, group())[0],
                             moe_dispatch(xs[r], ids_all[r], weights_all[r], E, rows_per_rank, group())[2],
                             ids_all[r], counts, E, rows_per_rank, group())
    ranks_holding = torch.stack([((ids_all[r] >= 0) & (ids_all[r] // (E // n) == d)).any(1) for d in range(n)]).sum(0)
    torch.testing.assert_close(out, xs[r] * ranks_holding.unsqueeze(1))
    assert torch.equal(out_w, torch.where(ids_all[r] >= 0, weights_all[r], 0.0))
    sent_once = int(((ids_all[r] >= 0).unsqueeze(-1) & (ids_all[r].unsqueeze(-1) // (E // n) ==
                                                         torch.arange(n))).any(1).sum())
    return {"rows sent": sent_once, "slots": int((ids_all[r] >= 0).sum())}


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("rows_per_rank", [-1, T], ids=["dropless", "capacity"])
def test_dispatch_delivers_each_token_once_per_rank_and_combine_sums_it_back(world, rows_per_rank, request):
    results = request.getfixturevalue(world).run(check_dispatch_values, rows_per_rank)
    assert sum(r["rows sent"] for r in results) < sum(r["slots"] for r in results)  # deduplication happened


def exchange(x_full, weights_full, ids_full, rows_per_rank):
    """A replicated function: shard, dispatch, a row-wise nonlinearity, combine, gather (for gradcheck)."""
    mesh = cached_mesh((dist.get_world_size(),), ("ep",))
    x = shard_replicated(x_full, mesh=mesh, dim=0)
    weights = shard_replicated(weights_full, mesh=mesh, dim=0)
    ids = ids_full.chunk(dist.get_world_size())[dist.get_rank()]
    rows, _, row_weights, counts = moe_dispatch(x, ids, weights, E, rows_per_rank, group())
    y = rows.sin() * (1 + row_weights.sum(1, keepdim=True))
    out, out_w = moe_combine(y, row_weights.square(), ids, counts, E, rows_per_rank, group())
    return gather_replicated(out, mesh=mesh, dim=0), gather_replicated(out_w, mesh=mesh, dim=0)


def run_gradcheck(rows_per_rank):
    n = dist.get_world_size()
    ids = torch.cat([routing(s, tokens=4)[0] for s in range(n)])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4 * n, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4 * n, K, generator=gen, dtype=torch.float64, requires_grad=True)
    return torch.autograd.gradcheck(lambda a, b: exchange(a, b, ids, rows_per_rank), (x, w))


@pytest.mark.parametrize("rows_per_rank", [-1, 4], ids=["dropless", "capacity"])
def test_gradcheck_fp64(world2, rows_per_rank):
    assert all(world2.run(run_gradcheck, rows_per_rank))


def run_opcheck():
    ids, weights = routing(dist.get_rank())
    for rows_per_rank in (-1, T):
        for grad in (False, True):
            x = torch.randn(T, D, requires_grad=grad)
            w = weights.clone().requires_grad_(grad)
            torch.library.opcheck(torch.ops.tdx.moe_dispatch, (x, ids, w, E, rows_per_rank, group()))
            rows, _, row_w, counts = moe_dispatch(x.detach(), ids, w.detach(), E, rows_per_rank, group())
            y = rows.clone().requires_grad_(grad)
            torch.library.opcheck(torch.ops.tdx.moe_combine,
                                  (y, row_w.clone().requires_grad_(grad), ids, counts, E, rows_per_rank, group()))
    return True


def test_opcheck_exchange(world2):
    assert all(world2.run(run_opcheck))


def permute_inputs(rows=7, local=3, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, local, (rows, K), generator=gen)
    x = torch.randn(rows, D, generator=gen, dtype=torch.float64).to(dtype)
    per_expert = torch.stack([(ids == e).sum() for e in range(local)])
    return x, ids, per_expert


def test_permute_sorts_slots_expert_major_and_unpermute_weights_them_back(cpu_isa):
    x, ids, per_expert = permute_inputs()
    weights = torch.rand(ids.shape)
    roomy = int(per_expert.max()) + 1
    with use_cpu_isa(cpu_isa):
        for capacity in (-1, roomy):
            sorted_rows, positions, offsets = moe_permute(x, ids, per_expert, 3, capacity)
            starts = per_expert.cumsum(0) - per_expert if capacity < 0 else torch.arange(3) * capacity
            for e in range(3):
                slots = [(r, j) for r in range(ids.shape[0]) for j in range(K) if ids[r, j] == e]  # slot order
                for i, (r, j) in enumerate(slots):
                    assert positions[r, j] == starts[e] + i and torch.equal(sorted_rows[starts[e] + i], x[r])
            assert positions[ids < 0].eq(-1).all()
            ends = per_expert.cumsum(0) if capacity < 0 else torch.arange(1, 4) * capacity
            assert torch.equal(offsets, ends.int())
            if capacity >= 0:
                used = positions[positions >= 0]
                unused = torch.ones(3 * capacity, dtype=torch.bool)
                unused[used] = False
                assert sorted_rows[unused].eq(0).all()  # padding rows
            y = moe_unpermute(sorted_rows * 2, positions, weights)
            expected = (x.unsqueeze(1) * 2 * torch.where(ids >= 0, weights, 0).unsqueeze(-1)).sum(1)
            torch.testing.assert_close(y, expected)


def test_permute_with_too_few_rows_for_an_expert_drops_its_last_slots_and_refuses_negative_counts():
    x, ids, per_expert = permute_inputs()
    short = per_expert.clone()
    short[1] -= 1  # the caller's counts disagree with the ids: expert 1's last slot finds no row
    sorted_rows, positions, _ = moe_permute(x, ids, short, 3, -1)
    last = [(r, j) for r in range(ids.shape[0]) for j in range(K) if ids[r, j] == 1][-1]
    assert sorted_rows.shape[0] == int(short.sum()) and positions[last] == -1
    assert positions.max() < sorted_rows.shape[0]
    short[0] = -1
    with pytest.raises(ValueError, match="tokens_per_expert must be >= 0"):
        moe_permute(x, ids, short, 3, -1)


def test_permute_refuses_an_expert_id_out_of_range_in_both_modes():
    x, ids, per_expert = permute_inputs()
    ids[4, 1] = 3
    for capacity in (-1, 8):
        with pytest.raises(ValueError, match=r"moe_permute: every expert id must lie in \[0, num_experts=3\) or be "
                                             r"-1 \(dropped\); expert_ids \(flattened\) \[9\] = 3"):
            moe_permute(x, ids, per_expert, 3, capacity)


def test_permute_gradcheck_fp64_and_opcheck():
    x, ids, per_expert = permute_inputs(dtype=torch.float64)
    weights = torch.rand(ids.shape, dtype=torch.float64)
    for capacity in (-1, int(per_expert.max()) + 1):
        def through(a, w):
            sorted_rows, positions, _ = moe_permute(a, ids, per_expert, 3, capacity)
            return moe_unpermute(sorted_rows.tanh(), positions, w)

        assert torch.autograd.gradcheck(through, (x.clone().requires_grad_(True), weights.clone().requires_grad_(True)))
        for grad in (False, True):
            torch.library.opcheck(torch.ops.tdx.moe_permute,
                                  (x.float().requires_grad_(grad), ids, per_expert, 3, capacity))
            sorted_rows, positions, _ = moe_permute(x.float(), ids, per_expert, 3, capacity)
            for w in (weights.float().requires_grad_(grad), None):
                torch.library.opcheck(torch.ops.tdx.moe_unpermute, (sorted_rows.requires_grad_(grad), positions, w))


def bad_expert_id():
    ids, weights = routing(0)
    ids[3, 1] = E
    moe_dispatch(torch.randn(T, D), ids, weights, E, -1, group())


def experts_not_divisible():
    ids, weights = routing(0)
    moe_dispatch(torch.randn(T, D), ids, weights, 7, -1, group())


def weights_not_fp32():
    ids, weights = routing(0)
    moe_dispatch(torch.randn(T, D), ids, weights.double(), E, -1, group())


def combine_rows_mismatch():
    ids, weights = routing(0)
    rows, _, row_w, counts = moe_dispatch(torch.randn(T, D), ids, weights, E, -1, group())
    moe_combine(rows[1:], None, ids, counts, E, -1, group())


CASES = [
    (bad_expert_id, ValueError, r"every expert id must lie in \[0, num_experts=8\) or be -1 \(dropped\); "
                                r"expert_ids \(flattened\) \[7\] = 8"),
    (experts_not_divisible, ValueError, "num_experts=7 must be a positive multiple of the group size 2"),
    (weights_not_fp32, TypeError, "weights must be Float for Float tokens, got Double"),
    (combine_rows_mismatch, RuntimeError, "moe_dispatch delivered"),
]


@pytest.mark.parametrize("fn, error, message", CASES, ids=[case[0].__name__ for case in CASES])
def test_bad_input(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
    assert world2.alive


def unchecked_expert_ids_poison_their_tokens():
    """With index checks off, an expert id out of range makes its token's output and gradient NaN (never a
    plausible value); the other tokens equal the checked run's."""
    ids, weights = routing(dist.get_rank())
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    bad = ids.clone()
    bad[3, 1] = E + 3 if dist.get_rank() == 0 else -5  # past the count buckets as well
    previous = torchdist_ext.set_index_checks(False)
    try:
        rows, row_ids, row_weights, counts = moe_dispatch(x, bad, weights, E, -1, group())
        out, out_weights = moe_combine(rows, row_weights, bad, counts, E, -1, group())
        out.sum().backward()
    finally:
        torchdist_ext.set_index_checks(previous)
    reference, _, reference_weights, reference_counts = moe_dispatch(x.detach(), ids, weights, E, -1, group())
    back, _ = moe_combine(reference, reference_weights, ids, reference_counts, E, -1, group())
    valid = torch.arange(T) != 3
    assert out[3].isnan().all() and x.grad[3].isnan().all() and out_weights[3, 1].isnan()
    torch.testing.assert_close(out[valid], back[valid], rtol=0, atol=0)
    assert not x.grad[valid].isnan().any()

    rows_here, ids_here, _ = permute_inputs()
    ids_here[2, 0] = 3  # past the 3 local experts
    per_expert = torch.stack([(ids_here == e).sum() for e in range(3)])
    previous = torchdist_ext.set_index_checks(False)
    try:
        sorted_rows, positions, _ = moe_permute(rows_here, ids_here, per_expert, 3, -1)
    finally:
        torchdist_ext.set_index_checks(previous)
    y = moe_unpermute(sorted_rows, positions, torch.ones(ids_here.shape))
    assert y[2].isnan().all() and not y[torch.arange(7) != 2].isnan().any()


def test_unchecked_expert_ids_poison_their_tokens(world2):
    world2.run(unchecked_expert_ids_poison_their_tokens)


def test_unpermute_refuses_positions_out_of_range():
    sorted_rows, weights = torch.randn(8, D), torch.ones(2, 2)
    for position in (8, 10**12, -3):
        positions = torch.tensor([[0, 1], [2, position]])
        for call in (lambda: moe_unpermute(sorted_rows, positions, weights),
                     lambda: torch.ops.tdx.moe_unpermute_bwd(torch.randn(2, D), sorted_rows, positions, weights)):
            with pytest.raises(ValueError, match=rf"every position must name a row of sorted \(0 <= position < 8\) "
                                                 rf"or be -1 \(none\) or -2 \(moe_permute's invalid slot\); "
                                                 rf"positions \(flattened\) \[3\] = {position}"):
                call()


def test_unchecked_positions_out_of_range_give_nan_rows_not_reads_out_of_bounds():
    sorted_rows, weights = torch.randn(8, D), torch.ones(3, 2)
    positions = torch.tensor([[0, 1], [2, 8], [3, 10**12]])
    previous = torchdist_ext.set_index_checks(False)
    try:
        y = moe_unpermute(sorted_rows, positions, weights)
        grad_sorted, grad_weights = torch.ops.tdx.moe_unpermute_bwd(torch.ones(3, D), sorted_rows, positions, weights)
    finally:
        torchdist_ext.set_index_checks(previous)
    assert y[1:].isnan().all() and torch.equal(y[0], sorted_rows[0] + sorted_rows[1])
    assert grad_weights[1:, 1].isnan().all() and not grad_weights[:, 0].isnan().any()
    assert torch.equal(grad_sorted[4:], torch.zeros(4, D))  # nothing written for the bad slots


def rows_past_rows_per_rank(checks: bool):
    """Rank 0 sends its 4 tokens to rank 1's experts, more than rows_per_rank = 2 (rank 1 sends 2 and drops
    2); returns what each rank raised (index checks on) or the combined tokens (off)."""
    x = torch.arange(1.0, 5.0).view(4, 1).expand(4, D).contiguous()
    ids = torch.full((4, 1), E - 1) if dist.get_rank() == 0 else torch.tensor([[0], [0], [-1], [-1]])
    weights = torch.ones(4, 1)
    previous = torchdist_ext.set_index_checks(checks)
    try:
        rows, _, row_weights, counts = moe_dispatch(x, ids, weights, E, 2, group())
        return moe_combine(rows, row_weights, ids, counts, E, 2, group())[0][:, 0].tolist()
    except ValueError as error:
        return str(error)
    finally:
        torchdist_ext.set_index_checks(previous)


def test_dispatch_refuses_rows_past_rows_per_rank_and_never_drops_them_silently(world2):
    rank0, rank1 = world2.run(rows_past_rows_per_rank, True)
    assert rank0.startswith("moe_dispatch: this rank sends 4 rows to rank 1, more than rows_per_rank=2")
    assert rank1 == f"moe_dispatch: rank 0 of the group refused its input, so every rank stops: {rank0}"
    rank0, rank1 = world2.run(rows_past_rows_per_rank, False)
    assert rank0[:2] == [1.0, 2.0] and all(math.isnan(v) for v in rank0[2:])  # dropped tokens come out NaN
    assert rank1 == [1.0, 2.0, 0.0, 0.0]


def bad_expert_id_on_one_rank():
    ids, weights = routing(0)
    if dist.get_rank() == 1:
        ids[5, 0] = -7
    try:
        moe_dispatch(torch.randn(T, D), ids, weights, E, -1, group())
    except ValueError as error:
        return str(error)


def test_a_bad_expert_id_on_one_rank_stops_every_rank(world2):
    rank0, rank1 = world2.run(bad_expert_id_on_one_rank)
    assert rank1.startswith("moe_dispatch: every expert id must lie in [0, num_experts=8) or be -1 (dropped); "
                            "expert_ids (flattened) [10] = -7")
    assert rank0 == f"moe_dispatch: rank 1 of the group refused its input, so every rank stops: {rank1}"


def test_grouped_mm_matches_a_loop_with_an_idle_expert():
    gen = torch.Generator().manual_seed(5)
    per_expert = torch.tensor([3, 0, 4])  # expert 1 gets no rows
    x = torch.randn(7, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 5, D, generator=gen, dtype=torch.float64, requires_grad=True)
    out = moe_grouped_mm(x, weight, per_expert)
    expected = torch.cat([x[:3] @ weight[0].t(), x[3:] @ weight[2].t()])
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda a, w: moe_grouped_mm(a, w, per_expert), (x, weight))
    out.sum().backward()
    assert weight.grad[1].eq(0).all()
    for grad in (False, True):
        torch.library.opcheck(torch.ops.tdx.moe_grouped_mm,
                              (x.detach().float().requires_grad_(grad), weight.detach().float().requires_grad_(grad),
                               per_expert))
