"""Counter-based initialisation (``tdx::counter_trunc_normal_``): a block of a tensor filled with what the
whole tensor holds there, element ``i`` (row-major in the whole tensor) a function of ``(seed, key, i)``.

    counter_trunc_normal_   self [block], whole_shape, offsets, seed, key, mean, std, a, b   (in place)

Not differentiable (it initialises). ``torchdist_ext.parallel.trunc_normal_`` is the face that takes a
DTensor and finds its block.
"""

import math

import torch
from torch import Tensor

__all__ = ["counter_trunc_normal_"]

_OP = "counter_trunc_normal_"
_MAX_DIMS = 8


def counter_trunc_normal_(self: Tensor, whole_shape: list[int], offsets: list[int], seed: int, key: int,
                          mean: float, std: float, a: float, b: float) -> None:
    """Fills the contiguous ``self``, the block at ``offsets`` of a tensor of shape ``whole_shape``, with
    N(mean, std^2) truncated to [a, b] as the whole tensor holds it there. ``seed`` and ``key`` are int64."""
    torch.ops.tdx.counter_trunc_normal_(self, whole_shape, offsets, seed, key, mean, std, a, b)


@torch.library.register_fake("tdx::counter_trunc_normal_")
def _(self, whole_shape, offsets, seed, key, mean, std, a, b):
    torch._check_type(self.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                      lambda: f"{_OP}: expected float32, float64, bfloat16 or float16, got {self.dtype}")
    torch._check_value(self.is_contiguous(), lambda: f"{_OP}: self must be contiguous")
    torch._check_value(self.dim() <= _MAX_DIMS,
                       lambda: f"{_OP}: self may have at most {_MAX_DIMS} dimensions, got {self.dim()}")
    torch._check_value(len(whole_shape) == self.dim() and len(offsets) == self.dim(),
                       lambda: f"{_OP}: whole_shape and offsets must have self's {self.dim()} dimensions, got "
                               f"{list(whole_shape)} and {list(offsets)}")
    for d in range(self.dim()):
        torch._check_value(0 <= offsets[d] and offsets[d] + self.shape[d] <= whole_shape[d],
                           lambda: f"{_OP}: the block of shape {list(self.shape)} at offsets {list(offsets)} must "
                                   f"lie inside whole_shape {list(whole_shape)} (dimension {d})")
    torch._check_value(math.isfinite(mean) and math.isfinite(std) and std > 0,
                       lambda: f"{_OP}: mean must be finite and std positive, got mean={mean}, std={std}")
    torch._check_value(a < b, lambda: f"{_OP}: the truncation [a, b] must have a < b, got a={a}, b={b}")
