"""Fp8Linear, convert_to_fp8 and fp8_step: bit-for-bit against a plain-torch emulation of the same casts and
GEMMs, SQNR against fp32, the amax bookkeeping, compile, the one-collective amax reduction, bad input."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchdist_ext.fp8 import CurrentScaling, DelayedScaling, Fp8Linear, convert_to_fp8, fp8_step
from torchdist_ext.fp8.gemm import scaled_mm
from torchdist_ext.fp8.scaling import FP8_MAX

RECIPES = {
    "delayed_hybrid": DelayedScaling(amax_history_len=16),
    "delayed_e4m3": DelayedScaling(amax_history_len=16, fp8_format="e4m3", margin=1),
    "current_hybrid": CurrentScaling(),
}


def saturating_cast(x, scale, dtype):
    limit = FP8_MAX[dtype]
    return torch.where(x.isfinite(), (x.float() * scale).clamp(-limit, limit), float("nan")).to(dtype)


def emulated_linear(x, weight, bias, scales, grad_out, grad_dtype):
    """The casts in plain torch, the same fp8 GEMMs (``scaled_mm``, checked against ATen's in test_gemm.py):
    (out, grad_x, grad_w, grad_bias)."""
    s_x, s_w, s_g = (torch.tensor([s]) for s in scales)
    x_fp8, w_fp8 = saturating_cast(x, s_x, torch.float8_e4m3fn), saturating_cast(weight, s_w, torch.float8_e4m3fn)
    out = scaled_mm(x_fp8, w_fp8.t(), 1 / s_x, 1 / s_w, x.dtype) + bias
    g_fp8 = saturating_cast(grad_out, s_g, grad_dtype)
    grad_x = scaled_mm(g_fp8, w_fp8.t().contiguous().t(), 1 / s_g, 1 / s_w, x.dtype)
    grad_w = scaled_mm(g_fp8.t().contiguous(), x_fp8.t().contiguous().t(), 1 / s_g, 1 / s_x, weight.dtype)
    return out, grad_x, grad_w, grad_out.sum(0)


def sqnr_db(actual, reference):
    return (20 * torch.log10(reference.norm() / (actual - reference).norm())).item()


def run_layer(layer, x, grad_out):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(grad_out)
    grads = (x.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
    layer.weight.grad = layer.bias.grad = None
    return (out.detach(), *grads)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_bit_for_bit_equal_to_the_emulation_and_at_least_20_db_from_fp32(recipe):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = Fp8Linear.from_linear(copy.deepcopy(linear), recipe)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # the delayed scales move after the first step
        x, grad_out = torch.randn(32, 64, generator=gen) * 3, torch.randn(32, 48, generator=gen) * 1e-3
        if isinstance(recipe, DelayedScaling):
            scales = layer.scale.tolist()
        else:
            scales = [FP8_MAX[d] / t.abs().max().item() for d, t in
                      ((torch.float8_e4m3fn, x), (torch.float8_e4m3fn, linear.weight), (recipe.grad_dtype, grad_out))]
        ours = run_layer(layer, x, grad_out)
        expected = emulated_linear(x, linear.weight.detach(), linear.bias.detach(), scales, grad_out,
                                   recipe.grad_dtype)
        for name, a, b in zip(("out", "grad_x", "grad_w", "grad_bias"), ours, expected):
            assert torch.equal(a, b), f"step {step}: {name} differs from the emulation"
        reference = run_layer(linear, x, grad_out)
        # Step 0 of delayed scaling casts with the initial scale 1 (as TE does): gradients of 1e-3 then fall
        # below e4m3's smallest subnormal. From step 1 the scales come from the recorded amaxes.
        if step > 0 or isinstance(recipe, CurrentScaling):
            for name, a, b in zip(("out", "grad_x", "grad_w", "grad_bias"), ours, reference):
                assert sqnr_db(a, b) >= 20, f"step {step}: {name} SQNR {sqnr_db(a, b):.1f} dB < 20"
        fp8_step(layer)


def test_weight_gradient_with_rows_not_a_multiple_of_16_equals_the_unpadded_gemm():
    """The weight gradient's GEMM pads its contraction (the rows) to a multiple of 16 with zero rows, as
    torch._scaled_mm needs on a GPU; the zeros change nothing."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    layer = Fp8Linear.from_linear(copy.deepcopy(linear), DelayedScaling())
    x, grad_out = torch.randn(10, 32), torch.randn(10, 16)
    ours = run_layer(layer, x, grad_out)
    expected = emulated_linear(x, linear.weight.detach(), linear.bias.detach(), [1.0, 1.0, 1.0], grad_out,
                               torch.float8_e5m2)
    assert torch.equal(ours[2], expected[2])


def test_buffers_stay_fp32_when_the_module_is_cast_and_reset_after_to_empty():
    layer = Fp8Linear(32, 16, recipe=DelayedScaling())
    layer.scale.fill_(144.8081)
    layer = layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and layer.scale.dtype == torch.float32
    assert layer.scale.eq(torch.tensor(144.8081)).all()
    meta = Fp8Linear(32, 16, recipe=DelayedScaling(), device="meta").to_empty(device="cpu")
    meta.reset_fp8_state()
    assert meta.amax_history.eq(0).all() and meta.scale.eq(1).all() and meta.fp8_max.tolist() == [448, 448, 57344]


def test_amaxes_of_the_step_gather_in_row_0_over_micro_batches_and_roll():
    torch.manual_seed(0)
    layer = Fp8Linear(32, 16, recipe=DelayedScaling(amax_history_len=4))
    xs = [torch.randn(8, 32) * s for s in (1.0, 5.0)]
    gs = [torch.randn(8, 16) * s for s in (3.0, 0.5)]
    outs = [layer(x) for x in xs]  # two forwards, then their backwards (as pipeline schedules run them)
    for out, g in zip(reversed(outs), reversed(gs)):
        out.backward(g)
    expected = [max(x.abs().max().item() for x in xs), layer.weight.abs().max().item(),
                max(g.abs().max().item() for g in gs)]
    assert layer.amax_history[0].tolist() == expected
    fp8_step(layer)
    assert layer.amax_history[-1].tolist() == expected and layer.amax_history[0].eq(0).all()
    assert layer.scale.tolist() == pytest.approx([448 / expected[0], 448 / expected[1], 57344 / expected[2]])


def test_a_nan_input_reaches_the_loss_and_keeps_the_scales():
    layer = Fp8Linear(32, 16, recipe=DelayedScaling())
    layer(torch.randn(4, 32)).sum().backward()
    fp8_step(layer)
    before = layer.scale.clone()
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    out = layer(x)
    assert out[1].isnan().all() and out[[0, 2, 3]].isfinite().all()
    out.sum().backward()
    fp8_step(layer)
    assert torch.equal(layer.scale[0], before[0])  # the input's amax was NaN: its scale stays
    assert layer.amax_history.isfinite().all()  # and is forgotten: the next step's amaxes set the scale again
    x = torch.randn(4, 32) * 10
    layer(x).sum().backward()
    fp8_step(layer)
    assert layer.scale[0].item() == pytest.approx(448 / x.abs().max().item())


def test_compiled_equals_eager_over_steps_with_scale_updates_and_no_recompile():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    eager = convert_to_fp8(copy.deepcopy(base), DelayedScaling(amax_history_len=4))
    compiled_model = convert_to_fp8(copy.deepcopy(base), DelayedScaling(amax_history_len=4))
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    for step in range(5):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)) * (step + 1)
        results = []
        for model, run in ((eager, eager), (compiled_model, compiled)):
            x_step = x.clone().requires_grad_(True)
            out = run(x_step)
            out.square().sum().backward()
            results.append([out.detach(), x_step.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            fp8_step(model)
            results[-1] += [buf.clone() for buf in model.buffers()]
        for i, (a, b) in enumerate(zip(*results)):
            assert torch.equal(a, b), f"step {step}: tensor {i} differs between compiled and eager"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["recompiles"]


def test_convert_swaps_eligible_linears_keeping_their_parameters_and_state_dict_names():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10), nn.Sequential(nn.Linear(64, 64)))
    before = dict(model.named_parameters())
    convert_to_fp8(model, DelayedScaling(amax_history_len=8), filter_fn=lambda name, m: name != "2.0")
    # model[1]: 10 features, not a multiple of 16; model[2][0]: refused by filter_fn.
    assert isinstance(model[0], Fp8Linear) and type(model[1]) is nn.Linear and type(model[2][0]) is nn.Linear
    assert all(p is before[name] for name, p in model.named_parameters())
    state = model.state_dict()
    assert {"0.amax_history", "0.scale"} <= state.keys() and state["0.amax_history"].shape == (8, 3)
    model[0].scale.fill_(7.0)
    restored = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10), nn.Sequential(nn.Linear(64, 64))),
                              DelayedScaling(amax_history_len=8), filter_fn=lambda name, m: name != "2.0")
    restored.load_state_dict(model.state_dict())
    assert restored[0].scale.eq(7.0).all()


def test_converting_again_keeps_the_same_settings_and_refuses_others():
    """A second convert_to_fp8 with the recipe a module has leaves it as it is (and converts what the first call
    left); with another recipe, or another fp8_all_gather, it used to keep the first silently: now it is refused,
    naming both, before anything changes."""
    recipe = DelayedScaling(amax_history_len=8)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    convert_to_fp8(model, recipe, filter_fn=lambda name, module: name == "0")
    first = model[0]
    has = (r"DelayedScaling\(margin=0, amax_history_len=8, amax_compute_algo='max', fp8_format='hybrid', "
           r"reduce_amax=True\)")
    with pytest.raises(ValueError, match=rf"convert_to_fp8: module '0' \(Fp8Linear\) is already converted with "
                                         rf"recipe={has}, and was asked again with recipe=CurrentScaling\("):
        convert_to_fp8(model, CurrentScaling())
    with pytest.raises(ValueError, match=r"module '0' \(Fp8Linear\) is already converted with fp8_all_gather=False, "
                                         r"and was asked again with fp8_all_gather=True"):
        convert_to_fp8(model, recipe, fp8_all_gather=True)
    assert model[0] is first and first.fp8_recipe == recipe and type(model[1]) is nn.Linear  # nothing changed
    convert_to_fp8(model, DelayedScaling(amax_history_len=8))  # an equal recipe
    assert model[0] is first and isinstance(model[1], Fp8Linear) and model[1].fp8_recipe == recipe
    convert_to_fp8(model, DelayedScaling(margin=1), filter_fn=lambda name, module: False)  # excluded: allowed
    with pytest.raises(ValueError, match=r"convert_to_fp8: the model \(Fp8Linear\) is already converted with "
                                         rf"recipe={has}, and was asked again with recipe=DelayedScaling\(margin=1,"):
        convert_to_fp8(first, DelayedScaling(margin=1))
    assert first.fp8_recipe == recipe


def test_bad_input():
    with pytest.raises(ValueError, match="in_features must be a positive multiple of 16 .fp8 GEMMs., got 24"):
        Fp8Linear(24, 16, recipe=DelayedScaling())
    with pytest.raises(TypeError, match="recipe must be a DelayedScaling, CurrentScaling, RowwiseScaling or BlockScaling, got str"):
        Fp8Linear(16, 16, recipe="delayed")
    with pytest.raises(TypeError, match="recipe must be a DelayedScaling, CurrentScaling, RowwiseScaling or BlockScaling, got dict"):
        convert_to_fp8(nn.Linear(16, 16), {})
    with pytest.raises(ValueError, match=r"x's last dim must be in_features=16, got shape \(2, 8\)"):
        Fp8Linear(16, 16, recipe=DelayedScaling())(torch.randn(2, 8))
    with pytest.raises(TypeError, match="amax_reduction_mesh must be a DeviceMesh or None, got str"):
        Fp8Linear(16, 16, recipe=DelayedScaling(), amax_reduction_mesh="world")


def reduced_scales_agree():
    """Each rank casts different inputs; after fp8_step every scale equals the one computed from the largest
    amax over the ranks, on every rank, and the step made one all-reduce."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)), DelayedScaling(amax_history_len=4))
    rank = dist.get_rank()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    model(x).sum().backward()
    local = torch.stack([m.amax_history[0].clone() for m in model])
    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        fp8_step(model)
    finally:
        dist.all_reduce = original
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)
    largest = torch.stack(everyone).amax(0)
    expected = torch.tensor([448.0, 448.0, 57344.0]) / largest
    scales = torch.stack([m.scale for m in model])
    gathered = [torch.empty_like(scales) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, scales)
    return len(calls), torch.equal(scales, expected), all(torch.equal(g, gathered[0]) for g in gathered)


def test_one_all_reduce_makes_every_rank_agree_on_every_scale(world2):
    for calls, matches, agree in world2.run(reduced_scales_agree):
        assert calls == 1 and matches and agree
