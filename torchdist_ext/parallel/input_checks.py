"""Argument checks the parallel layers share: each raises ValueError / TypeError naming the argument,
its value and the rule."""

import torch

from torchdist_ext.parallel.mesh_group import MeshGroup

__all__ = ["check_divisible", "check_features", "check_floating_input", "check_floating_dtype", "sequence_dim"]

_PARAMETER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_divisible(arg: str, value: int, group: MeshGroup, what: str = "the tensor-parallel size") -> None:
    if value % group.size != 0:
        raise ValueError(f"{arg}={value} must be divisible by {what} {group.size}")


def check_floating_dtype(dtype) -> None:
    """A layer's ``dtype=`` argument: None (the default dtype) or a floating-point dtype."""
    if dtype is not None and dtype not in _PARAMETER_DTYPES:
        raise TypeError(f"dtype must be a floating-point dtype (float32, float64, bfloat16, float16), got {dtype}")


def check_floating_input(x, arg: str, expected_dtype: torch.dtype) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != expected_dtype:
        raise TypeError(f"{arg} has dtype {x.dtype} but the layer's parameters are {expected_dtype}; cast one of them")


def check_features(x: torch.Tensor, arg: str, expected: int, rule: str) -> None:
    if x.dim() < 1 or x.shape[-1] != expected:
        raise ValueError(f"{arg} has shape {tuple(x.shape)}; its last dim must be {expected} ({rule})")


def sequence_dim(x: torch.Tensor, seq_dim: int, arg: str = "input") -> int:
    """``seq_dim`` normalised for ``x``; it must exist and not be the feature dim."""
    dim = seq_dim + x.dim() if seq_dim < 0 else seq_dim
    if not 0 <= dim < x.dim() - 1:
        raise ValueError(
            f"{arg} has shape {tuple(x.shape)}; seq_dim={seq_dim} must name one of its dims before the last"
        )
    return dim
