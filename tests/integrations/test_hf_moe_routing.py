"""``MoE``'s routing options against the Hugging Face modules that define them, fp32, at ep 2 and 4: the
output and the gradients of the input and of every parameter (router, experts, shared experts and their gate).

Every rank builds the same HF block and the same tokens ``x [n, T, dim]``; the HF block runs all of them, rank r
feeds ``x[r]`` to ``MoE.from_experts`` of the block's weights (the fused ``gate_up_proj`` split into w1 and w3).
Mixtral (softmax, normalised top-2), Qwen2-MoE (no normalisation, a shared expert behind its sigmoid gate),
Qwen3-MoE (``norm_topk_prob`` False, its default, and True), DeepSeek-V3 (sigmoid scores, group-limited top-k
with the correction bias in the choice only, normalised and scaled by 2.5, a shared expert)."""

import pytest
import torch
import torch.distributed as dist
from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.numerics import assert_close_to_scale
from torchdist_ext.parallel import MoE
from torchdist_ext.testing import cached_mesh

DIM, FFN, EXPERTS, TOKENS = 16, 8, 8, 24


def hf_block(kind: str) -> torch.nn.Module:
    """The HF block of ``kind`` with seeded weights (HF leaves the experts uninitialised and the router zero)."""
    torch.manual_seed(0)
    common = dict(hidden_size=DIM, num_experts_per_tok=2)
    if kind == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=FFN, num_local_experts=EXPERTS, **common))
    elif kind == "qwen2-moe":
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(moe_intermediate_size=FFN, shared_expert_intermediate_size=2 * FFN,
                                                      num_experts=EXPERTS, **common))
    elif kind.startswith("qwen3-moe"):
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(moe_intermediate_size=FFN, num_experts=EXPERTS,
                                                      norm_topk_prob=kind.endswith("normalised"), **common))
    else:
        block = DeepseekV3MoE(DeepseekV3Config(moe_intermediate_size=FFN, n_routed_experts=EXPERTS, n_group=4,
                                               topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                               norm_topk_prob=True, **common))
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
        if kind == "deepseek-v3":
            block.gate.e_score_correction_bias.normal_(0, 0.1)
    return block.float()


def shared_weights(block: torch.nn.Module):
    mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if mlp is None:
        return None
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


def ours(block: torch.nn.Module, kind: str, mesh) -> MoE:
    gate_up = block.experts.gate_up_proj.detach()
    options = {"mixtral": dict(norm_topk_prob=True), "qwen2-moe": dict(norm_topk_prob=False),
               "qwen3-moe": dict(norm_topk_prob=False), "qwen3-moe-normalised": dict(norm_topk_prob=True),
               "deepseek-v3": dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4,
                                   topk_group=2)}[kind]
    shared_gate = getattr(block, "shared_expert_gate", None)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    return MoE.from_experts(block.gate.weight.detach(), gate_up[:, :FFN].contiguous(), gate_up[:, FFN:].contiguous(),
                            block.experts.down_proj.detach(), ep_mesh=mesh, top_k=2,
                            shared=shared_weights(block),
                            shared_gate=None if shared_gate is None else shared_gate.weight.detach(),
                            correction_bias=bias, **options)


def check_against_hf(kind: str):
    n, r = dist.get_world_size(), dist.get_rank()
    block = hf_block(kind)
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(n, TOKENS, DIM, generator=gen)
    upstream = torch.randn(n, TOKENS, DIM, generator=gen)
    moe = ours(block, kind, cached_mesh((n,), ("ep",)))

    xs = x_full.clone().requires_grad_(True)
    (block(xs.view(1, n * TOKENS, DIM)).view(n, TOKENS, DIM) * upstream).sum().backward()
    with torch.no_grad():
        ref_out = block(x_full.view(1, n * TOKENS, DIM)).view(n, TOKENS, DIM)[r]

    x = x_full[r].clone().view(2, TOKENS // 2, DIM).requires_grad_(True)
    out = moe(x)
    (out * upstream[r].view_as(out)).sum().backward()

    assert_close_to_scale(out.reshape(TOKENS, DIM), ref_out, torch.float32, "out")
    assert_close_to_scale(x.grad.reshape(TOKENS, DIM), xs.grad[r], torch.float32, "x grad")

    def summed(grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad

    assert_close_to_scale(summed(moe.gate.grad), block.gate.weight.grad, torch.float32, "router grad")
    gate_up = block.experts.gate_up_proj.grad
    for name, ref in (("w1", gate_up[:, :FFN]), ("w3", gate_up[:, FFN:]), ("w2", block.experts.down_proj.grad)):
        assert_close_to_scale(getattr(moe.experts, name).grad.full_tensor(), ref, torch.float32, f"{name} grad")
    for name, param in zip(("shared_w1", "shared_w3", "shared_w2"), shared_weights(block) or ()):
        assert_close_to_scale(summed(getattr(moe, name).grad), param.grad, torch.float32, f"{name} grad")
    if moe.shared_gate is not None:
        assert_close_to_scale(summed(moe.shared_gate.grad), block.shared_expert_gate.weight.grad, torch.float32,
                              "shared gate grad")


KINDS = ["mixtral", "qwen2-moe", "qwen3-moe", "qwen3-moe-normalised", "deepseek-v3"]


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("kind", KINDS)
def test_routing_equals_the_hf_module(kind, world, request):
    request.getfixturevalue(world).run(check_against_hf, kind)


def update_after_a_forward(rate: float):
    """The bias moves by rate * sign(mean - load), the loads the slots every rank's training forward routed
    (exactly), which are HF's routing of the same tokens (bounded: GEMMs blocked otherwise on another CPU may
    flip a near tie, one token's slot moving between two experts)."""
    n, r = dist.get_world_size(), dist.get_rank()
    block = hf_block("deepseek-v3")
    x_full = torch.randn(n, TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    moe = ours(block, "deepseek-v3", cached_mesh((n,), ("ep",)))
    moe(x_full[r]).sum().backward()
    load = moe.last_tokens_per_expert.float()
    dist.all_reduce(load)
    with torch.no_grad():
        moe(x_full[r])  # without autograd: not counted
        _, _, chosen = block.gate(x_full.view(-1, DIM))
    assert (load - torch.bincount(chosen.flatten(), minlength=EXPERTS)).abs().sum() <= 2
    before = moe.e_score_correction_bias.clone()
    assert torch.equal(moe.update_correction_bias(rate, group=dist.group.WORLD), load)
    assert torch.equal(moe.e_score_correction_bias, before + rate * torch.sign(load.mean() - load))
    assert not moe.routed_load.any()
    assert "e_score_correction_bias" in moe.state_dict() and "routed_load" not in moe.state_dict()
    return load.tolist()


def test_aux_loss_free_bias_update(world2):
    loads = world2.run(update_after_a_forward, 1e-3)
    assert loads[0] == loads[1] and len(set(loads[0])) > 1  # summed over the ranks; unequal loads


def refuse_a_rate_on_one_rank():
    moe = ours(hf_block("deepseek-v3"), "deepseek-v3", cached_mesh((2,), ("ep",)))
    with pytest.raises(ValueError, match=r"rate must be a positive number, got -0.1"):
        moe.update_correction_bias(-0.1 if dist.get_rank() == 0 else 0.1, group=dist.group.WORLD)


def test_bad_rate_on_one_rank_is_refused_on_both(world2):
    world2.run(refuse_a_rate_on_one_rank)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(n_group=3), ValueError, r"n_group=3 must divide num_experts=8 into groups of at least 2"),
    (dict(n_group=8), ValueError, r"n_group=8 must divide num_experts=8 into groups of at least 2"),
    (dict(n_group=4, topk_group=5), ValueError, r"topk_group must be an int in \[1, n_group=4\], got 5"),
    (dict(n_group=4, topk_group=1, top_k=3), ValueError, r"top_k=3 must not exceed the experts of topk_group=1"),
    (dict(routed_scaling_factor=0.0), ValueError, r"routed_scaling_factor must be a positive number, got 0.0"),
    (dict(routed_scaling_factor="2"), TypeError, r"routed_scaling_factor must be a number, got '2'"),
    (dict(norm_topk_prob="yes"), TypeError, r"norm_topk_prob must be a bool or None, got 'yes'"),
    (dict(shared_expert_gate=True), ValueError, r"shared_expert_gate=True needs shared experts"),
])
def test_bad_routing_options(world2, kwargs, error, message):
    world2.run(refuse, kwargs, error, message)


def refuse(kwargs, error, message):
    with pytest.raises(error, match=message):
        MoE(DIM, FFN, EXPERTS, ep_mesh=cached_mesh((2,), ("ep",)), **{"top_k": 2, **kwargs})
    if "shared_expert_gate" not in kwargs:
        return
    moe = MoE(DIM, FFN, EXPERTS, ep_mesh=cached_mesh((2,), ("ep",)))
    with pytest.raises(ValueError, match="update_correction_bias needs score_correction_bias=True"):
        moe.update_correction_bias(0.1, group=dist.group.WORLD)


def bias_stays_fp32():
    """Cast to bf16, the bias and the running load stay fp32 and train; built on the meta device and given
    storage, they start at 0."""
    mesh = cached_mesh((2,), ("ep",))
    moe = MoE(DIM, FFN, EXPERTS, ep_mesh=mesh, score_func="sigmoid", score_correction_bias=True).to(torch.bfloat16)
    assert moe.e_score_correction_bias.dtype == moe.routed_load.dtype == torch.float32
    moe(torch.randn(4, DIM, dtype=torch.bfloat16)).sum().backward()
    assert moe.routed_load.sum().item() == 4 * 2
    meta = MoE(DIM, FFN, EXPERTS, ep_mesh=mesh, score_correction_bias=True, device="meta").to_empty(device="cpu")
    assert not meta.e_score_correction_bias.any() and not meta.routed_load.any()


def test_bias_stays_fp32_and_starts_at_zero(world2):
    world2.run(bias_stays_fp32)
