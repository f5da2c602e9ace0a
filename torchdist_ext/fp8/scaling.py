"""The scale rules, written once, as in-place tensor updates (no host sync, so compiled steps and CUDA
graphs can hold them).

Delayed scaling (``update_delayed_scales_``), TransformerEngine's rule (``transformer_engine.common.recipe``
and its ``delayed_scaling.cu`` kernel), side by side with ours:

    TE                                                   here
    amax = max over the history (or its newest row)      the same (``amax_compute_algo``)
    scale = (fp8_max / amax) / 2**margin                 the same, in fp32
    amax == 0 or not finite: keep the previous scale     the same (NaN and inf amaxes are not finite)
    scale == inf (a tiny amax): FLT_MAX                  the same
    history rolls by one, the new row 0 zeroed           the same: row 0 collects this step's amaxes
                                                         (the max over every cast of the step)
    NaN never enters the history (its amax              a NaN or inf amax is recorded (the step keeps its
    kernels' fmaxf skips NaN elements)                   scales; the cast made the loss NaN), then stored as
                                                         0, so one bad step does not freeze a scale for the
                                                         history's length

fp8_max is 448 for e4m3 and 57344 for e5m2. The amax of every cast since the last update sits in row 0
of the history [L, roles]; the update reads it, then rolls: row i moves to row i - 1 (row 0 to row L - 1,
the newest of the past) and row 0 starts again at 0, as TE's ``torch.roll(history, -1, 0)`` does.
"""

import torch
from torch import Tensor

__all__ = ["FP8_MAX", "current_scale", "update_delayed_scales_"]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FLOAT32_MAX = torch.finfo(torch.float32).max


def update_delayed_scales_(amax_history: Tensor, scale: Tensor, fp8_max: Tensor, margin: int,
                           amax_compute_algo: str) -> None:
    """Updates ``scale [roles]`` from ``amax_history [L, roles]`` (both fp32, in place) and rolls the history.
    ``fp8_max [roles]``: each role's format maximum."""
    amax = amax_history.amax(0) if amax_compute_algo == "max" else amax_history[0]
    new_scale = (fp8_max / amax) / (2.0**margin)
    new_scale = torch.where(new_scale.isinf(), _FLOAT32_MAX, new_scale)
    scale.copy_(torch.where((amax > 0) & amax.isfinite(), new_scale, scale))
    amax_history.copy_(torch.roll(torch.where(amax_history.isfinite(), amax_history, 0.0), -1, 0))
    amax_history[0].zero_()


def current_scale(amax: Tensor, fp8_max: float, eps: float) -> Tensor:
    """``fp8_max / max(amax, eps)`` (fp32, amax's shape); a non-finite amax gives scale 1 (the cast then
    carries the NaN on)."""
    scale = fp8_max / amax.clamp_min(eps)
    return torch.where(amax.isfinite(), scale, torch.ones_like(scale))
