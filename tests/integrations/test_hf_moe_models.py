"""Hugging Face MoE models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) through parallelize_hf_model
with expert parallelism: the loss, the logits and every parameter's gradient equal the single-process model's
(fp32), at dp2 x ep2, tp2 (SP) x dp2 x ep2, cp2 x ep2 and dp2 x cp2 x ep2 (each expert sharded over 2 ranks), on
padded or packed batches. Our MoE's parameters are compared with the HF block's they came from
(``gate_up_proj`` = w1 over w3)."""

import pytest
import torch
import torch.distributed as dist
import transformers

from tests.integrations.test_hf import VOCAB, assert_loss_and_logits_match, batches, full, local_inputs
from torchdist_ext.integrations.hf import parallelize_hf_model, save_hf_checkpoint
from torchdist_ext.parallel import ParallelDims

FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {"sliding_window": None}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "norm_topk_prob": False,
                   "sliding_window": None}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  {"moe_intermediate_size": 16, "norm_topk_prob": False}),
}


def build(family: str) -> torch.nn.Module:
    """A 2-layer model of 8 experts (top-2), the same weights on every call and rank (HF leaves the experts
    uninitialised and the routers zero)."""
    config_class, model_class, extra = FAMILIES[family]
    experts = {"num_local_experts": 8} if family == "mixtral" else {"num_experts": 8}
    config = config_class(hidden_size=32, intermediate_size=16, num_attention_heads=8, num_key_value_heads=4,
                          num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=128, num_experts_per_tok=2,
                          attn_implementation="sdpa", tie_word_embeddings=False, **experts, **extra)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.normal_(0, 0.2)
    return model


def hf_gradients(reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The reference's gradients under our model's parameter names."""
    grads = {}
    for name, param in reference.named_parameters():
        if ".mlp.experts.gate_up_proj" in name:
            prefix, ffn = name.replace("mlp.experts.gate_up_proj", "mlp.moe.experts."), param.shape[1] // 2
            grads[prefix + "w1"], grads[prefix + "w3"] = param.grad[:, :ffn], param.grad[:, ffn:]
            continue
        renamed = (name.replace("mlp.experts.down_proj", "mlp.moe.experts.w2")
                   .replace("mlp.gate.weight", "mlp.moe.gate")
                   .replace("mlp.shared_expert_gate.weight", "mlp.moe.shared_gate"))
        for ours, theirs in (("shared_w1", "gate_proj"), ("shared_w3", "up_proj"), ("shared_w2", "down_proj")):
            renamed = renamed.replace(f"mlp.shared_expert.{theirs}.weight", f"mlp.moe.{ours}")
        grads[renamed] = param.grad
    return grads


def layout_dims(layout: str) -> dict:
    return {"dp2_ep2": dict(ep=2), "tp2_sp_dp2_ep2": dict(tp=2, ep=2), "cp2_ep2": dict(cp=2, ep=2),
            "dp2_cp2_ep2": dict(cp=2, ep=2)}[layout]


def check_moe_model(family: str, layout: str, name: str):
    dims = ParallelDims(world_size=dist.get_world_size(), **layout_dims(layout))
    built = dims.build_meshes("cpu")
    kwargs = {"meshes": built}
    views = {"dp_mesh": built.dp if dims.dp > 1 else None, "tp_mesh": built.tp if dims.tp > 1 else None,
             "cp_mesh": built.cp}
    batch = batches()[name]
    reference = build(family)
    model = parallelize_hf_model(build(family), sequence_parallel=dims.tp > 1, **kwargs)
    expected = reference(**batch, use_cache=False)
    expected.loss.backward()
    actual = model(**local_inputs(batch, views))
    actual.loss.backward()
    assert_loss_and_logits_match(actual, expected, batch, views, name)
    want = hf_gradients(reference)
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for key, grad in want.items():
        torch.testing.assert_close(full(got[key].grad), grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")
    return True


# dp2 x cp2 x ep2: each expert sharded over 2 ranks (expert_fsdp), its gradient summed over them. Each case
# one batch: left padding or packed documents.
CASES = [("mixtral", "dp2_ep2", "left_padded", "world2"), ("qwen2_moe", "tp2_sp_dp2_ep2", "packed", "world4"),
         ("qwen3_moe", "cp2_ep2", "packed", "world2"), ("mixtral", "tp2_sp_dp2_ep2", "left_padded", "world4"),
         ("qwen3_moe", "dp2_cp2_ep2", "left_padded", "world4")]


@pytest.mark.parametrize("family, layout, batch, world", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_moe_model_matches_single_process(family, layout, batch, world, request):
    assert all(request.getfixturevalue(world).run(check_moe_model, family, layout, batch))


def refuse_moe(case: str):
    n = dist.get_world_size()
    model = build("qwen3_moe")
    built = ParallelDims(world_size=n, ep=n).build_meshes("cpu")
    if case == "deepseek":
        config = transformers.DeepseekV3Config(hidden_size=32, intermediate_size=16, moe_intermediate_size=16,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                               n_routed_experts=8, vocab_size=VOCAB)
        parallelize_hf_model(transformers.DeepseekV3ForCausalLM(config), meshes=built)
    elif case == "no_meshes":
        parallelize_hf_model(model, dp_mesh=built.dp)
    elif case == "checkpoint":
        save_hf_checkpoint(parallelize_hf_model(model, meshes=built), "unused")
    elif case == "jitter":
        model = build("mixtral")
        model.config.router_jitter_noise = 0.1
        parallelize_hf_model(model, meshes=built)
    elif case == "router_logits":
        model.config.output_router_logits = True
        parallelize_hf_model(model, meshes=built)
    else:
        parallelize_hf_model(model, meshes=built, compile=True)


@pytest.mark.parametrize("case, message", [
    ("no_meshes", r"config.model_type='qwen3_moe' is an MoE model: pass meshes=ParallelDims"),
    ("deepseek", r"config.model_type='deepseek_v3': its multi-head latent attention .* is not supported"),
    ("router_logits", r"config.output_router_logits=True .* is not supported yet"),
    ("compile", r"compile=True is not supported with an MoE model \(qwen3_moe\) yet"),
    ("jitter", r"config.router_jitter_noise=0.1 .* is not supported; set it to 0.0"),
    ("checkpoint", r"HF checkpoints of a parallelised MoE model \(qwen3_moe\) are not supported yet"),
])
def test_refuses_what_it_does_not_cover_yet(world2, case, message):
    world2.run(refuses, case, message)


def refuses(case: str, message: str):
    with pytest.raises(ValueError, match=message):
        refuse_moe(case)
