"""The MoE layer against a single-process reference that loops over experts with plain torch.

Every rank builds the same full weights and the same full batch ``x [n, T, dim]``; rank r
routes and feeds chunk ``x[r]`` (expert-parallel ranks see different tokens). The reference
runs each chunk on its own (routing and capacity are per rank), the expert weights' and the
router's gradients summed over the chunks; the layer's x gradient on rank r must match the
reference's for chunk r, its gate gradient summed over the ranks the reference's, its expert
gradients (gathered) the reference's.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchdist_ext
from tests.numerics import assert_close_to_scale
from torchdist_ext.parallel import MoE
from torchdist_ext.testing import cached_mesh

DIM, FFN, TOKENS = 16, 32, 24


def ep_mesh():
    return cached_mesh((dist.get_world_size(),), ("ep",))


def full_weights(num_experts, num_shared, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, scale):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    gate = draw(num_experts, DIM, scale=1.0)
    w1, w3 = draw(num_experts, FFN, DIM, scale=DIM ** -0.5), draw(num_experts, FFN, DIM, scale=DIM ** -0.5)
    w2 = draw(num_experts, DIM, FFN, scale=FFN ** -0.5)
    shared = None
    if num_shared:
        width = num_shared * FFN
        shared = (draw(width, DIM, scale=DIM ** -0.5), draw(width, DIM, scale=DIM ** -0.5),
                  draw(DIM, width, scale=width ** -0.5))
    return gate, w1, w3, w2, shared


def reference_routing(x, gate, top_k, score_func):
    logits = x.double() @ gate.double().t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    top_scores, top_ids = scores.topk(top_k, dim=-1)
    weights = top_scores
    if score_func == "sigmoid" or top_k > 1:
        weights = top_scores / top_scores.sum(-1, keepdim=True)
    distribution = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    return logits, distribution, top_ids, weights


def reference_kept(top_ids, weights, num_experts, capacity_factor, drop_policy, capacity_tokens=None):
    """[T, k] bool: the documented rule, expert by expert (a plain loop); the capacity follows
    ``capacity_tokens`` (the most tokens of any rank), by default T."""
    tokens, k = top_ids.shape
    keep = torch.ones_like(top_ids, dtype=torch.bool)
    if capacity_factor is None:
        return keep
    capacity = math.ceil(capacity_factor * (capacity_tokens or tokens) * k / num_experts)
    for e in range(num_experts):
        slots = [(t, j) for t in range(tokens) for j in range(k) if top_ids[t, j] == e]
        if drop_policy == "probs":
            slots.sort(key=lambda s: (-weights[s].item(), s[0]))  # highest weight first, ties: lower token
        for t, j in slots[capacity:]:
            keep[t, j] = False
    return keep


def reference_moe(x, gate, w1, w3, w2, shared, top_k, score_func, capacity_factor, drop_policy,
                  capacity_tokens=None, sequences=1):
    """One rank's chunk through the MoE with a loop over experts; returns (out, aux, z). With ``sequences``
    > 1 the balance loss is DeepSeek-V3's sequence-wise one: each of that many equal sequences of the chunk on
    its own, averaged."""
    num_experts = gate.shape[0]
    logits, distribution, top_ids, weights = reference_routing(x, gate, top_k, score_func)
    keep = reference_kept(top_ids.detach(), weights.detach(), num_experts, capacity_factor, drop_policy,
                          capacity_tokens)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(num_experts):
        for j in range(top_k):
            mask = (top_ids[:, j] == e) & keep[:, j]
            if mask.any():
                h = x[mask].double()
                y = (F.silu(h @ w1[e].double().t()) * (h @ w3[e].double().t())) @ w2[e].double().t()
                out = out.index_add(0, mask.nonzero().squeeze(1), weights[mask, j].unsqueeze(1) * y)
    if shared is not None:
        s1, s3, s2 = (s.double() for s in shared)
        out = out + (F.silu(x.double() @ s1.t()) * (x.double() @ s3.t())) @ s2.t()
    aux = 0.0
    for ids, probabilities in zip(top_ids.chunk(sequences), distribution.chunk(sequences)):
        share = torch.zeros(num_experts, dtype=torch.float64).index_add(
            0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.float64)) / ids.numel()
        aux = aux + num_experts * (share * probabilities.mean(0)).sum() / sequences
    z = logits.logsumexp(-1).square().mean()
    return out, aux, z, torch.where(keep, top_ids, -1)


def skew_to_the_first_rank(gate, n):
    """A gate under which every token's top-1 expert lives on rank 0: rank 0's first two experts score
    +-8 (x . v), every other expert 0. The other ranks' experts get no tokens, and no rank sends any."""
    skewed = torch.zeros_like(gate)
    v = torch.ones(gate.shape[1], dtype=gate.dtype) / gate.shape[1] ** 0.5
    skewed[0], skewed[1] = 8 * v, -8 * v
    return skewed


def check_against_reference(num_experts, top_k, score_func, capacity_factor, drop_policy, num_shared, dtype,
                            aux_coef=0.0, z_coef=0.0, skewed=False, aux_loss="switch"):
    n, r = dist.get_world_size(), dist.get_rank()
    weights = full_weights(num_experts, num_shared, dtype)
    if skewed:
        weights = (skew_to_the_first_rank(weights[0], n), *weights[1:])
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(n, TOKENS, DIM, generator=gen, dtype=torch.float64).to(dtype)
    upstream = torch.randn(n, TOKENS, DIM, generator=gen, dtype=torch.float64).to(dtype)
    kwargs = dict(top_k=top_k, score_func=score_func, capacity_factor=capacity_factor, drop_policy=drop_policy,
                  aux_loss=aux_loss, aux_loss_coef=aux_coef, z_loss_coef=z_coef)
    gate, w1, w3, w2, shared = weights
    moe = MoE.from_experts(gate, w1, w3, w2, ep_mesh=ep_mesh(), shared=shared, **kwargs)
    x = x_full[r].clone().view(2, TOKENS // 2, DIM).requires_grad_(True)
    out = moe(x)
    (out.float() * upstream[r].view_as(out).float()).sum().backward()

    params = [t.double().requires_grad_(True) for t in (gate, w1, w3, w2)]
    shared_params = [t.double().requires_grad_(True) for t in shared] if shared else None
    xs = x_full.double().requires_grad_(True)
    total = 0.0
    for chunk in range(n):
        ref, aux, z, kept = reference_moe(xs[chunk], *params, shared_params, top_k, score_func, capacity_factor,
                                          drop_policy, sequences=2 if aux_loss == "sequence" else 1)
        total = total + (ref * upstream[chunk].double()).sum() + aux_coef * aux + z_coef * z
        if chunk == r:
            ref_out, ref_aux, ref_z, ref_kept = ref.detach(), aux.detach(), z.detach(), kept
    total.backward()

    counted = torch.zeros(num_experts + 1, dtype=torch.int64).index_add(
        0, torch.where(ref_kept >= 0, ref_kept, num_experts).flatten(), torch.ones(ref_kept.numel(), dtype=torch.int64))
    assert moe.last_tokens_per_expert.tolist() == counted[:num_experts].tolist()
    assert_close_to_scale(out.reshape(TOKENS, DIM), ref_out, dtype, "out")
    assert_close_to_scale(moe.last_aux_loss, ref_aux, torch.float32, "aux loss")
    assert_close_to_scale(moe.last_z_loss, ref_z, torch.float32, "z loss")
    assert_close_to_scale(x.grad.reshape(TOKENS, DIM), xs.grad[r], dtype, "x grad")
    gate_grad = moe.gate.grad.clone()
    dist.all_reduce(gate_grad)
    assert_close_to_scale(gate_grad, params[0].grad, dtype, "gate grad")
    for name, ref in zip(("w1", "w3", "w2"), params[1:]):
        assert_close_to_scale(getattr(moe.experts, name).grad.full_tensor(), ref.grad, dtype, f"{name} grad")
    if shared:
        for name, ref in zip(("shared_w1", "shared_w3", "shared_w2"), shared_params):
            grad = getattr(moe, name).grad.clone()
            dist.all_reduce(grad)
            assert_close_to_scale(grad, ref.grad, dtype, f"{name} grad")
    return {"dropped": int((ref_kept < 0).sum()), "idle experts": int((counted[:num_experts] == 0).sum())}


CAPACITY = [pytest.param(None, "probs", id="dropless"), pytest.param(1.0, "probs", id="capacity-probs"),
            pytest.param(1.0, "position", id="capacity-position")]


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("capacity_factor, drop_policy", CAPACITY)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_matches_reference_fp32(world, capacity_factor, drop_policy, top_k, score_func, request):
    results = request.getfixturevalue(world).run(check_against_reference, 8, top_k, score_func, capacity_factor,
                                                 drop_policy, 0, torch.float32)
    if capacity_factor is not None:
        assert sum(r["dropped"] for r in results) > 0, "the capacity drops nothing: the test would not see the rule"


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("capacity_factor, drop_policy", CAPACITY)
def test_idle_experts_and_ranks_that_receive_nothing(world, capacity_factor, drop_policy, request):
    results = request.getfixturevalue(world).run(check_against_reference, 8, 1, "softmax", capacity_factor,
                                                 drop_policy, 0, torch.float32, 0.1, 0.01, True)
    assert all(r["idle experts"] == 6 for r in results)


@pytest.mark.parametrize("capacity_factor, drop_policy", CAPACITY)
def test_shared_experts_and_auxiliary_losses(world2, capacity_factor, drop_policy):
    world2.run(check_against_reference, 4, 2, "softmax", capacity_factor, drop_policy, 1, torch.float32, 0.1, 0.01)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sequence_wise_balance_loss(world2, score_func):
    """DeepSeek-V3's complementary sequence-wise loss (aux_loss="sequence"): each of a rank's two sequences
    balanced on its own; the loss and every gradient (the gate's carries it) against the reference."""
    world2.run(check_against_reference, 4, 2, score_func, None, "probs", 0, torch.float32, 0.1, 0.0, False,
               "sequence")


@pytest.mark.parametrize("capacity_factor, drop_policy", CAPACITY[:2])
def test_bf16(world2, capacity_factor, drop_policy):
    world2.run(check_against_reference, 4, 2, "softmax", capacity_factor, drop_policy, 1, torch.bfloat16)


def check_unequal_token_counts(counts):
    """Rank r holds counts[r] tokens (0 allowed): out and every gradient against the reference, whose capacity
    C = ceil(c T k / E) follows the most tokens any rank holds (what the ranks agree on)."""
    r = dist.get_rank()
    gate, w1, w3, w2, _ = full_weights(4, 0)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(c, DIM, generator=gen, dtype=torch.float64) for c in counts]
    upstream = [torch.randn(c, DIM, generator=gen, dtype=torch.float64) for c in counts]
    moe = MoE.from_experts(gate, w1, w3, w2, ep_mesh=ep_mesh(), top_k=2, capacity_factor=1.0)
    x = xs[r].float().requires_grad_(True)
    (moe(x) * upstream[r].float()).sum().backward()
    out = moe(x).detach()

    params = [t.double().requires_grad_(True) for t in (gate, w1, w3, w2)]
    refs = [chunk.clone().requires_grad_(True) for chunk in xs]
    total, dropped = 0.0, 0
    for chunk, (x_ref, up) in enumerate(zip(refs, upstream)):
        ref, _, _, kept = reference_moe(x_ref, *params, None, 2, "softmax", 1.0, "probs", capacity_tokens=max(counts))
        total = total + (ref * up).sum()
        dropped += int((kept < 0).sum())
        if chunk == r:
            ref_out = ref.detach()
    total.backward()
    if counts[r]:
        assert_close_to_scale(out, ref_out, torch.float32, "out")
        assert_close_to_scale(x.grad, refs[r].grad, torch.float32, "x grad")
    assert x.grad.shape == (counts[r], DIM)
    gate_grad = moe.gate.grad.clone()
    dist.all_reduce(gate_grad)
    assert_close_to_scale(gate_grad, params[0].grad, torch.float32, "gate grad")
    for name, ref in zip(("w1", "w3", "w2"), params[1:]):
        assert_close_to_scale(getattr(moe.experts, name).grad.full_tensor(), ref.grad, torch.float32, f"{name} grad")
    return dropped


@pytest.mark.parametrize("counts", [(6, 4), (5, 0)], ids=["6-and-4", "5-and-0"])
def test_capacity_with_unequal_token_counts(world2, counts):
    assert sum(world2.run(check_unequal_token_counts, counts)) > 0, "nothing dropped: the test would not see C"


DEEPSEEK_ROUTING = dict(score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        score_correction_bias=True, shared_expert_gate=True)


def run_compiled(capacity_factor, routing):
    """A residual block with the MoE, compiled whole: equal to eager in output and gradients over 5 steps whose
    routing differs, on one graph (no recompile after the first step). With a correction bias, the bias moves
    between the steps (update_correction_bias) and the compiled forwards count their loads as eager ones do."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    moe = MoE(DIM, FFN, 8, top_k=2, ep_mesh=ep_mesh(), capacity_factor=capacity_factor, aux_loss_coef=0.01,
              z_loss_coef=0.001, num_shared_experts=1, **routing)

    def block(x):
        return x + moe(x)

    compiled = torch.compile(block, fullgraph=True)
    params = [moe.gate, moe.experts.w1, moe.experts.w2, moe.shared_w1]
    for step in range(5):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(2, TOKENS // 2, DIM, generator=gen, requires_grad=True)
        eager = block(x)
        eager_grads = torch.autograd.grad(eager.square().sum(), [x, *params])
        eager_tokens = moe.last_tokens_per_expert.clone()
        eager_load = None if moe.routed_load is None else moe.routed_load.clone()
        with torch.compiler.set_stance("fail_on_recompile" if step > 0 else "default"):
            out = compiled(x)
        if eager_load is not None:
            assert torch.equal(moe.routed_load, 2 * eager_load)  # the compiled forward's loads: the eager one's
            moe.update_correction_bias(0.01, group=dist.group.WORLD)
        grads = torch.autograd.grad(out.square().sum(), [x, *params])
        torch.testing.assert_close(out, eager)
        for got, want in zip(grads, eager_grads):
            torch.testing.assert_close(got.full_tensor() if hasattr(got, "full_tensor") else got,
                                       want.full_tensor() if hasattr(want, "full_tensor") else want)
        assert torch.equal(moe.last_tokens_per_expert, eager_tokens)
    return True


@pytest.mark.parametrize("capacity_factor, routing", [(None, {}), (1.25, DEEPSEEK_ROUTING)],
                         ids=["dropless", "capacity-deepseek-routing"])
def test_compile_fullgraph_without_recompiles(world2, capacity_factor, routing):
    assert all(world2.run(run_compiled, capacity_factor, routing))


def experts_not_divisible():
    MoE(DIM, FFN, 7, ep_mesh=ep_mesh())


def top_k_too_large():
    MoE(DIM, FFN, 4, top_k=5, ep_mesh=ep_mesh())


def top_k_zero():
    MoE(DIM, FFN, 4, top_k=0, ep_mesh=ep_mesh())


def capacity_not_positive():
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh(), capacity_factor=0.0)


def unknown_drop_policy():
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh(), capacity_factor=1.0, drop_policy="random")


def unknown_score_func():
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh(), score_func="relu")


def nan_router_logits():
    x = torch.randn(2, 3, DIM)
    x[1, 2, 5] = float("nan")
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh())(x)


def raised(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    raise AssertionError("nothing was raised")


def nan_router_input_on_one_rank():
    """Rank 1's tokens hold a NaN; rank 0's are fine: both must raise (rank 0 with rank 1's message)."""
    moe = MoE(DIM, FFN, 4, ep_mesh=ep_mesh())
    x = torch.randn(2, 3, DIM)
    if dist.get_rank() == 1:
        x[1, 2, 5] = float("nan")
    return raised(lambda: moe(x))


def test_nan_router_input_on_one_rank_stops_every_rank(world2):
    mine, theirs = world2.run(nan_router_input_on_one_rank)[::-1]
    assert mine.startswith("moe_dispatch: the router weights hold NaN, at (flattened) [10]")
    assert theirs == f"moe_dispatch: rank 1 of the group refused its input, so every rank stops: {mine}"


def wrong_width_on_one_rank(capacity_factor):
    """Rank 1 alone passes tokens of the wrong width: both ranks raise (before the capacity's all-reduce and the
    exchanges, where rank 0 would otherwise wait)."""
    moe = MoE(DIM, FFN, 4, ep_mesh=ep_mesh(), capacity_factor=capacity_factor)
    return raised(lambda: moe(torch.randn(2, 3, DIM + dist.get_rank())))


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_bad_input_on_one_rank_stops_every_rank(world2, capacity_factor):
    mine, theirs = world2.run(wrong_width_on_one_rank, capacity_factor)[::-1]
    assert "its last dim must be 16 (dim)" in mine
    assert theirs == f"MoE.forward: rank 1 of the group refused its input, so every rank stops: {mine}"


def expert_counts_that_differ():
    return raised(lambda: MoE(DIM, FFN, 4 if dist.get_rank() == 0 else 8, ep_mesh=ep_mesh()))


def test_constructor_refuses_ranks_whose_configurations_differ(world2):
    for rank, text in enumerate(world2.run(expert_counts_that_differ)):
        assert text.startswith(f"MoE: the ranks of the group must agree on num_experts: rank {rank} has "
                               f"{4 if rank == 0 else 8}, rank {1 - rank} has {8 if rank == 0 else 4}")


def wrong_width():
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh())(torch.randn(2, 3, DIM + 1))


def unknown_aux_loss():
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh(), aux_loss="global")


def coefficient_without_aux_loss():
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh(), aux_loss=None, aux_loss_coef=0.01)


def sequence_loss_of_flat_tokens():
    MoE(DIM, FFN, 4, ep_mesh=ep_mesh(), aux_loss="sequence", aux_loss_coef=0.01)(torch.randn(6, DIM))


BAD = [
    (experts_not_divisible, ValueError, "num_experts=7 must be divisible by the expert-parallel size 2"),
    (top_k_too_large, ValueError, r"top_k must be an int in \[1, num_experts=4\], got 5"),
    (top_k_zero, ValueError, r"top_k must be an int in \[1, num_experts=4\], got 0"),
    (capacity_not_positive, ValueError, "capacity_factor must be None .* or a positive number, got 0.0"),
    (unknown_drop_policy, ValueError, "drop_policy must be one of .* got 'random'"),
    (unknown_score_func, ValueError, "score_func must be one of .* got 'relu'"),
    (nan_router_logits, ValueError, r"moe_dispatch: the router weights hold NaN, at \(flattened\) \[10\]"),
    (wrong_width, ValueError, r"its last dim must be 16 \(dim\)"),
    (unknown_aux_loss, ValueError, r"aux_loss must be one of \('switch', 'sequence'\) or None, got 'global'"),
    (coefficient_without_aux_loss, ValueError, "aux_loss=None computes no load-balancing loss, but aux_loss_coef"),
    (sequence_loss_of_flat_tokens, ValueError, r"aux_loss='sequence' balances each sequence: the input must be "
                                               r"\[..., seq, dim\], got shape \(6, 16\)"),
]


@pytest.mark.parametrize("fn, error, message", BAD, ids=[case[0].__name__ for case in BAD])
def test_bad_input(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
    assert world2.alive
