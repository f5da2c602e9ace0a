"""The fp8 scale rules, written once, as in-place tensor updates (no host sync, so compiled steps and CUDA graphs
can hold them): delayed scaling (``update_delayed_scales_``, TransformerEngine's rule) and current scaling
(``current_scale``).

    update_delayed_scales_(m.amax_history, m.scale, m.fp8_max, recipe.margin, recipe.amax_compute_algo)

Where the delayed rule follows TransformerEngine and where it differs: docs/architecture.md, "fp8".
"""

import math

import torch
from torch import Tensor

__all__ = ["FP8_MAX", "current_scale", "max_margin", "update_delayed_scales_"]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FLOAT32_MAX = torch.finfo(torch.float32).max


def max_margin(fp8_dtypes) -> int:
    """The largest ``margin`` the delayed rule can take for casts to ``fp8_dtypes``: the one at which a tensor's
    amax still scales to at least 1 (``fp8_max / 2**margin >= 1``) in the narrowest of them, i.e.
    ``floor(log2(fp8_max))``: 8 for e4m3 (448), 15 for e5m2 (57344). Past it the values crowd into the
    subnormals, a few margins on they round to 0, then the scale itself underflows to 0 (NaN after the cast's
    0 * inf) and at last ``2.0**margin`` overflows."""
    return min(math.floor(math.log2(FP8_MAX[dtype])) for dtype in fp8_dtypes)


def update_delayed_scales_(amax_history: Tensor, scale: Tensor, fp8_max: Tensor, margin: int,
                           amax_compute_algo: str) -> None:
    """Updates ``scale [roles]`` from ``amax_history [L, roles]`` (both fp32, in place) and rolls the history.

    ``fp8_max [roles]``: each role's format maximum (``FP8_MAX``: 448 for e4m3, 57344 for e5m2). Row 0 of the
    history holds the amax of every cast since the last update (the max over the step's casts). Per role:
    ``amax`` is the max over the history (``amax_compute_algo="max"``) or its row 0 (``"most_recent"``);
    ``scale = (fp8_max / amax) / 2**margin`` in fp32, ``FLT_MAX`` where that is inf (a tiny amax), and the
    previous scale where ``amax`` is 0 or not finite (NaN, inf). Then the history's non-finite entries are
    stored as 0 and it rolls: row i moves to row i - 1 (row 0 to row L - 1, the newest of the past) and row 0
    starts again at 0."""
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
