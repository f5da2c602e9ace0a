"""The delayed scale rule against a direct transcription of TransformerEngine's rule (Python floats and
lists), and the recipes' argument checks."""

import math

import pytest
import torch

from torchdist_ext.fp8 import FP8_MAX, CurrentScaling, DelayedScaling, current_scale, update_delayed_scales_
from torchdist_ext.ops import fp8_cast_amax

FLOAT32_MAX = torch.finfo(torch.float32).max


def reference_update(history: list[float], scale: float, fp8_max: float, margin: int, algo: str):
    """TE: amax from the history (max, NaN winning, or the newest row), scale = (fp8_max / amax) / 2**margin,
    kept when amax is 0 or not finite, FLT_MAX when it overflows; then non-finite amaxes stored as 0 (ours),
    roll by one, row 0 zeroed."""
    amax = (math.nan if any(math.isnan(a) for a in history) else max(history)) if algo == "max" else history[0]
    if amax > 0 and math.isfinite(amax):
        new = float(torch.tensor(fp8_max, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
                    / 2.0**margin)
        scale = FLOAT32_MAX if math.isinf(new) else new
    history = [a if math.isfinite(a) else 0.0 for a in history]
    return [0.0] + history[2:] + history[:1] if len(history) > 1 else [0.0], scale


@pytest.mark.parametrize("history_len", [1, 16, 1024])
@pytest.mark.parametrize("margin", [0, 1, 2])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scale_rule_matches_the_reference(history_len, margin, algo):
    fp8_max = torch.tensor([448.0, 57344.0])
    amaxes = [3.0, 0.0, 1e-30, 1e-45, 2.5, float("inf"), 7.0, float("nan"), 0.5, 4.0]
    history = torch.zeros(history_len, 2)
    scale = torch.ones(2)
    reference = [([0.0] * history_len, 1.0), ([0.0] * history_len, 1.0)]
    for step, amax in enumerate(amaxes):
        history[0] = torch.tensor([amax, amax * 2])
        for role in range(2):
            rows, role_scale = reference[role]
            rows = [float(history[0, role])] + rows[1:]
            reference[role] = reference_update(rows, role_scale, float(fp8_max[role]), margin, algo)
        update_delayed_scales_(history, scale, fp8_max, margin, algo)
        for role in range(2):
            rows, role_scale = reference[role]
            assert scale[role].item() == role_scale, f"step {step} role {role}: {scale[role].item()} vs {role_scale}"
            assert history[:, role].tolist() == pytest.approx(rows, nan_ok=True), f"step {step} role {role}"


def test_scale_rule_cases_stated_in_the_docstring():
    fp8_max = torch.tensor([FP8_MAX[torch.float8_e4m3fn]])
    for amax, expected in ((0.0, 5.0), (float("inf"), 5.0), (float("nan"), 5.0), (1e-38, FLOAT32_MAX),
                           (448.0, 1.0), (2.0, 224.0)):
        history, scale = torch.tensor([[amax]]), torch.tensor([5.0])
        update_delayed_scales_(history, scale, fp8_max, 0, "max")
        assert scale.item() == pytest.approx(expected), amax
        assert history.item() == 0.0
    history, scale = torch.tensor([[2.0]]), torch.tensor([5.0])
    update_delayed_scales_(history, scale, fp8_max, 2, "max")
    assert scale.item() == 56.0  # (448 / 2) / 2**2


def test_current_scale():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan")])
    scale = current_scale(amax, 448.0, 1e-12)
    assert scale[0] == 224.0 and scale[1] == pytest.approx(448e12) and scale[2] == 1.0 and scale[3] == 1.0


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(margin=-1), ValueError, r"margin must be an int in \[0, 8\], got -1"),
    (dict(margin=1.5), TypeError, r"margin must be an int in \[0, 8\], got 1.5"),
    (dict(amax_history_len="4"), TypeError, "amax_history_len must be an int >= 1, got '4'"),
    (dict(amax_history_len=0), ValueError, "amax_history_len must be an int >= 1, got 0"),
    (dict(amax_compute_algo="mean"), ValueError, r"amax_compute_algo must be one of \('max', 'most_recent'\)"),
    (dict(fp8_format="e5m2"), ValueError, r"fp8_format must be one of \('hybrid', 'e4m3'\), got 'e5m2'"),
    (dict(reduce_amax=1), TypeError, "reduce_amax must be a bool, got 1"),
])
def test_delayed_scaling_refuses_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        DelayedScaling(**kwargs)


def test_current_scaling_refuses_bad_arguments():
    with pytest.raises(ValueError, match="eps must be a positive finite number, got 0"):
        CurrentScaling(eps=0)
    with pytest.raises(ValueError, match="fp8_format must be one of"):
        CurrentScaling(fp8_format="fp8")


MARGIN_RULE = (r"margin must be an int in \[0, 8\], got {}: the scale is fp8_max / amax / 2\*\*margin, and "
               r"fp8_format='{}' casts to float8_e4m3fn \(max 448\), where a larger margin scales the amax below 1")


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("margin, error", [(9, ValueError), (30, ValueError), (200, ValueError), (2000, ValueError),
                                           (-1, ValueError), (True, TypeError), (8.0, TypeError)])
def test_a_margin_that_scales_the_amax_below_1_is_refused(margin, error, fp8_format):
    """scale = fp8_max / amax / 2**margin: past margin 8 the amax scales below 1 in e4m3 (max 448), which both
    formats cast the forward tensors to; margin 30 rounded every cast to 0, 200 gave zero scales and NaN, 2000
    a bare OverflowError."""
    with pytest.raises(error, match=MARGIN_RULE.format(margin, fp8_format)):
        DelayedScaling(margin=margin, fp8_format=fp8_format)


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_the_largest_margin_still_casts_with_precision(fp8_format):
    """At margin 8 the delayed rule's scales still cast a tensor (each role's format) with more than 20 dB of
    SQNR through tdx::fp8_cast_amax."""
    recipe = DelayedScaling(margin=8, fp8_format=fp8_format, amax_history_len=1)
    dtypes = (torch.float8_e4m3fn, torch.float8_e4m3fn, recipe.grad_dtype)  # input, weight, grad_output
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 3
    history, scale = x.abs().max().expand(1, len(dtypes)).clone(), torch.ones(len(dtypes))
    update_delayed_scales_(history, scale, torch.tensor([FP8_MAX[d] for d in dtypes]), recipe.margin,
                           recipe.amax_compute_algo)
    for role, dtype in enumerate(dtypes):
        assert scale[role].item() == pytest.approx(FP8_MAX[dtype] / x.abs().max().item() / 2**8)
        x_fp8, _ = fp8_cast_amax(x, scale[role:role + 1], dtype)
        error = x_fp8.float() / scale[role] - x
        sqnr = (20 * torch.log10(x.norm() / error.norm())).item()
        assert sqnr > 20, f"role {role} ({dtype}): SQNR {sqnr:.1f} dB"
