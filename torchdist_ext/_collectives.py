"""torch's functional collectives (``torch.ops._c10d_functional``) along any dim.

Thin, non-differentiable helpers below the op and layer packages (the backward of
``tdx`` ops, the parallel regions): registered torch ops only, so torch.compile
traces them without graph breaks. They are not ``tdx`` ops. Blocks follow
``torch.chunk`` order: rank r holds the r-th block.
"""

import torch
from torch import Tensor

__all__ = ["all_reduce", "all_gather", "reduce_scatter"]

_functional = torch.ops._c10d_functional


def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """Sum of ``x`` over the group, on every rank."""
    return _functional.wait_tensor(_functional.all_reduce(x.contiguous(), "sum", group_name))


def all_gather(x: Tensor, group_name: str, group_size: int, dim: int) -> Tensor:
    """Every rank's equal block ``x`` concatenated along ``dim``."""
    stacked = _functional.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), group_size, group_name)
    return _functional.wait_tensor(stacked).movedim(0, dim).contiguous()


def reduce_scatter(x: Tensor, group_name: str, group_size: int, dim: int) -> Tensor:
    """This rank's block along ``dim`` of the sum of ``x`` over the group (size divisible by the group)."""
    reduced = _functional.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", group_size, group_name)
    return _functional.wait_tensor(reduced).movedim(0, dim).contiguous()
