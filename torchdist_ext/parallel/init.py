"""Initialisation that does not depend on the layout: a parameter's shard, on any rank, gets what the whole
parameter holds there, so that a model built on the meta device and initialised after parallelisation (no
rank ever holding it whole) equals the same model initialised whole in one process."""

import hashlib

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchdist_ext.ops.init import counter_trunc_normal_

__all__ = ["trunc_normal_"]


def trunc_normal_(tensor: Tensor, *, key: str, seed: int = 0, mean: float = 0.0, std: float = 1.0,
                  a: float = -2.0, b: float = 2.0) -> Tensor:
    """Fills ``tensor`` with N(mean, std^2) truncated to [a, b] (absolute bounds, as in
    ``torch.nn.init.trunc_normal_``), in place, and returns it. Element ``i`` (row-major in the whole tensor)
    is a function of ``(seed, key, i)`` alone: a DTensor's local shard (any mesh, ``Shard`` /
    ``Replicate`` placements: FSDP2's, tensor, expert parallelism's) gets the whole tensor's values there,
    bit for bit, on every rank and without communication; a plain tensor is the whole.

    ``key`` names the tensor (e.g. its parameter's name in the unparallelised model): two tensors with the
    same ``(seed, key)`` get the same values. A meta tensor stays meta."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"trunc_normal_: key must be a non-empty str, got {key!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not -2**63 <= seed < 2**63:
        raise TypeError(f"trunc_normal_: seed must be an int64, got {seed!r}")
    whole_shape = list(tensor.shape)
    if isinstance(tensor, DTensor):
        if any(isinstance(p, Partial) for p in tensor.placements):
            raise ValueError(f"trunc_normal_: a DTensor with Partial placements {tensor.placements} holds no "
                             "block of the whole tensor")
        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        with torch.no_grad():
            local = tensor.to_local()
    else:
        offsets, local = [0] * tensor.dim(), tensor
    with torch.no_grad():
        block = local if local.is_contiguous() else torch.empty_like(local, memory_format=torch.contiguous_format)
        counter_trunc_normal_(block, whole_shape, list(offsets), seed, _key_id(key), float(mean), float(std),
                              float(a), float(b))
        if block is not local:
            local.copy_(block)
    return tensor


def _key_id(key: str) -> int:
    """A stable int64 for ``key`` (the same in every process and Python version)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)
