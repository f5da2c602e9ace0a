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

__all__ = ["AMAX_COMPUTE_ALGOS", "CurrentScaling", "DelayedScaling", "FP8_FORMATS", "Recipe"]

FP8_FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _check_format(fp8_format) -> None:
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format must be one of {FP8_FORMATS}, got {fp8_format!r}")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling with an amax history of ``amax_history_len`` steps per tensor role.

    Args:
        margin: the scale is divided by ``2**margin`` (headroom against growth between updates), an int >= 0.
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
        for name, value, least in (("margin", self.margin, 0), ("amax_history_len", self.amax_history_len, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= {least}, got {value!r}")
            if value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, got {self.amax_compute_algo!r}")
        _check_format(self.fp8_format)
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
