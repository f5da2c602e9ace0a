"""FP8 recipes: how each tensor role gets its scale.

Tensorwise (one scale per tensor): ``DelayedScaling`` (TransformerEngine's recipe): a tensor is cast with a
scale computed from the amaxes recorded over the previous steps (an amax history per tensor role), so the
cast needs no pass over the tensor before it. ``CurrentScaling``: the scale comes from the tensor's own amax
at the cast (one more read of the tensor).

Finer scales, each from its own block's amax at the cast (``tdx::fp8_cast_blockwise``), which an outlier
channel then cannot flatten for the whole tensor: ``RowwiseScaling`` (torchao's rowwise recipe: one scale per
row of each GEMM operand along its non-contracted dim) and ``BlockScaling`` (DeepSeek-V3 section 3.3.2:
1 x 128 tiles for activations and gradients, 128 x 128 blocks for weights; TransformerEngine's
``Float8BlockScaling``).

Formats: ``"hybrid"`` casts the forward tensors (input, weight) to e4m3 and the gradients to e5m2 (TE's
default; e5m2 has the range gradients need); ``"e4m3"`` casts everything to e4m3.
"""

import math
from dataclasses import dataclass

import torch

from torchdist_ext.fp8.scaling import FP8_MAX, max_margin

__all__ = ["AMAX_COMPUTE_ALGOS", "BlockScaling", "CurrentScaling", "DelayedScaling", "FP8_FORMATS", "Recipe",
           "RowwiseScaling", "TENSORWISE"]

FP8_FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The formats each fp8_format casts to: the forward tensors' (input, weight), then the gradients'.
_FORMAT_DTYPES = {"hybrid": (torch.float8_e4m3fn, torch.float8_e5m2), "e4m3": (torch.float8_e4m3fn,)}


class _GradFormat:
    """``grad_dtype``: the gradients' fp8 format under ``fp8_format`` (e5m2 for "hybrid", else e4m3)."""

    fp8_format: str

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn


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
class DelayedScaling(_GradFormat):
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


@dataclass(frozen=True)
class CurrentScaling(_GradFormat):
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


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a positive finite number, got {eps!r}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")


def _check_power_of_2(power_of_2_scales) -> None:
    if not isinstance(power_of_2_scales, bool):
        raise TypeError(f"power_of_2_scales must be a bool, got {power_of_2_scales!r}")


@dataclass(frozen=True)
class RowwiseScaling(_GradFormat):
    """Rowwise (axiswise) current scaling, torchao's ``Float8LinearConfig.from_recipe_name("rowwise")``: every
    GEMM operand gets one scale per row along its non-contracted dim (``y = x W^T``: x per token, W per output
    channel; ``dx = g W``: g per token, W per input channel; ``dW = g^T x``: g per output channel and x per
    input channel, over the tokens), each from that row's own amax.

    Args:
        fp8_format: ``"e4m3"`` (torchao's rowwise: e4m3 everywhere) or ``"hybrid"`` (gradients in e5m2).
        power_of_2_scales: round each scale down to a power of two (torchao's default for rowwise: the
            scaling multiplies exactly).
        eps: the smallest amax a scale is computed from, > 0.
    """

    fp8_format: str = "e4m3"
    power_of_2_scales: bool = True
    eps: float = 1e-12

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_power_of_2(self.power_of_2_scales)
        _check_eps(self.eps)


@dataclass(frozen=True)
class BlockScaling(_GradFormat):
    """Blockwise current scaling, DeepSeek-V3's (section 3.3.2) and TransformerEngine's
    ``Float8BlockScaling``: activations and gradients cast in ``activation_block`` = (1, b) tiles along the
    GEMM's contracted dim (per token per b channels; for the weight gradient, which contracts over the tokens,
    b x 1 tiles), weights in ``weight_block`` = (b, b) blocks (which serve both of their GEMMs).

    Args:
        activation_block: (1, b), b >= 1.
        weight_block: (b, b), the same b: a GEMM contracts activation tiles against weight blocks.
        fp8_format: ``"e4m3"`` (DeepSeek-V3: e4m3 everywhere) or ``"hybrid"`` (gradients in e5m2).
        power_of_2_scales: round each scale down to a power of two (TransformerEngine's default).
        eps: the smallest amax a scale is computed from, > 0.
    """

    activation_block: tuple[int, int] = (1, 128)
    weight_block: tuple[int, int] = (128, 128)
    fp8_format: str = "e4m3"
    power_of_2_scales: bool = True
    eps: float = 1e-12

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_power_of_2(self.power_of_2_scales)
        _check_eps(self.eps)
        for name in ("activation_block", "weight_block"):
            value = getattr(self, name)
            if not (isinstance(value, tuple) and len(value) == 2 and
                    all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value)):
                raise ValueError(f"{name} must be a tuple of two positive ints, got {value!r}")
        b = self.activation_block[1]
        if self.activation_block != (1, b) or self.weight_block != (b, b):
            raise ValueError(f"activation_block={self.activation_block} and weight_block={self.weight_block} must "
                             f"be (1, b) and (b, b) with one b: each GEMM contracts b-wide activation tiles against "
                             f"b-wide weight blocks")

    @property
    def block(self) -> int:
        return self.activation_block[1]


TENSORWISE = (DelayedScaling, CurrentScaling)
Recipe = DelayedScaling | CurrentScaling | RowwiseScaling | BlockScaling
