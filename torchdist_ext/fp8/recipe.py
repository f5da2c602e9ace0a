"""FP8 recipes: how each tensor role gets its scale.

``DelayedScaling`` (TransformerEngine's recipe): a tensor is cast with a scale computed from the amaxes
recorded over the previous steps (an amax history per tensor role), so the cast needs no pass over the
tensor before it. ``CurrentScaling``: the scale comes from the tensor's own amax at the cast (one more
read of the tensor), for comparison.

Formats: ``"hybrid"`` casts the forward tensors (input, weight) to e4m3 and the gradients to e5m2 (TE's
default; e5m2 has the range gradients need); ``"e4m3"`` casts everything to e4m3.
"""

import math
from dataclasses import dataclass

import torch

from torchdist_ext.fp8.scaling import FP8_MAX, max_margin

__all__ = ["AMAX_COMPUTE_ALGOS", "CurrentScaling", "DelayedScaling", "FP8_FORMATS", "Recipe"]

FP8_FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The formats each fp8_format casts to: the forward tensors' (input, weight), then the gradients'.
_FORMAT_DTYPES = {"hybrid": (torch.float8_e4m3fn, torch.float8_e5m2), "e4m3": (torch.float8_e4m3fn,)}


def _check_format(fp8_format) -> None:
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format must be one of {FP8_FORMATS}, got {fp8_format!r}")


def _check_margin(margin, fp8_format: str) -> None:
    """Refuses a ``margin`` that is not an int in [0, max_margin] for the formats ``fp8_format`` casts to: past
    that bound the scale ``fp8_max / amax / 2**margin`` maps the amax below 1 in the narrowest format, and every
    cast loses its precision, then rounds to 0."""
    dtypes = _FORMAT_DTYPES[fp8_format]
    limit = max_margin(dtypes)
    narrowest = min(dtypes, key=lambda dtype: FP8_MAX[dtype])
    rule = (f"margin must be an int in [0, {limit}], got {margin!r}: the scale is fp8_max / amax / 2**margin, and "
            f"fp8_format={fp8_format!r} casts to {str(narrowest).removeprefix('torch.')} (max "
            f"{FP8_MAX[narrowest]:g}), where a larger margin scales the amax below 1 (the casts lose their precision, "
            f"then round to 0) and a negative one saturates")
    if isinstance(margin, bool) or not isinstance(margin, int):
        raise TypeError(rule)
    if not 0 <= margin <= limit:
        raise ValueError(rule)


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling with an amax history of ``amax_history_len`` steps per tensor role.

    Args:
        margin: the scale is divided by ``2**margin`` (headroom against growth between updates), an int in
            [0, 8]: the amax must still scale to at least 1 in e4m3 (max 448), which both formats cast the
            forward tensors to (``torchdist_ext.fp8.scaling.max_margin``).
        amax_history_len: steps of amax kept, an int >= 1.
        amax_compute_algo: ``"max"`` (the largest amax in the history) or ``"most_recent"`` (this step's).
        fp8_format: ``"hybrid"`` or ``"e4m3"``.
        reduce_amax: reduce the amaxes over the ranks (one all-reduce per step, ``fp8_step``) so that every
            rank computes the same scales.
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: str = "hybrid"
    reduce_amax: bool = True

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_margin(self.margin, self.fp8_format)
        value = self.amax_history_len
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"amax_history_len must be an int >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {value!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, got {self.amax_compute_algo!r}")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"reduce_amax must be a bool, got {self.reduce_amax!r}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn


@dataclass(frozen=True)
class CurrentScaling:
    """Current (dynamic, tensorwise) scaling: ``scale = fp8_max / max(amax, eps)`` from each tensor's own amax.

    Args:
        fp8_format: ``"hybrid"`` or ``"e4m3"``.
        eps: the smallest amax a scale is computed from (an all-zero tensor keeps a finite scale), > 0.
    """

    fp8_format: str = "hybrid"
    eps: float = 1e-12

    def __post_init__(self):
        _check_format(self.fp8_format)
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
            raise TypeError(f"eps must be a positive finite number, got {self.eps!r}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a positive finite number, got {self.eps!r}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn


Recipe = DelayedScaling | CurrentScaling
