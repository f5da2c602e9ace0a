"""A sequence plan balanced over the documents of packed rows (``balanced_sequence_plan``): which tokens each
context-parallel rank holds, so that every rank holds as many tokens and about the same causal attention work.

    plan = balanced_sequence_plan(document_ids, cp_size=4)         # [batch, seq]: the full rows' documents
    tokens = plan.shard(tokens_full, dim=1, cp_mesh=mesh["cp"])
    ids, positions = plan.shard(document_ids, dim=1, cp_mesh=mesh["cp"]), plan.positions(cp_mesh=mesh["cp"])
    out = ring_attention(q, k, v, cp_mesh=mesh["cp"], causal=True, document_ids=ids, positions=positions)
    out_full = plan.unshard(out, dim=2, cp_mesh=mesh["cp"])

The algorithm and its bound: csrc/ops/sequence_plan.h; the design: docs/architecture.md.
"""

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import ops
from torchdist_ext.parallel.regions import gather_from_region, scatter_to_region
from torchdist_ext.parallel.sequence_sharding import context_parallel_groups

__all__ = ["METHODS", "SequencePlan", "balanced_sequence_plan"]

METHODS = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class SequencePlan:
    """Which global positions of each row every context-parallel rank holds.

    Attributes:
        indices: ``[batch, ring, seq / ring]`` int64 (CPU): per row, the positions each ring rank holds, ascending
            (``ring`` = the cp size for "ring" and "ulysses", the ring dim of the 2-D mesh for "hybrid", where each
            ring rank's positions are then split contiguously over its ``ulysses`` ranks).
        costs: ``[cp]`` float64: each cp rank's causal attention work per head (the (query, key) pairs of one
            document with key <= query), summed over the rows, in the mesh's rank order. Ulysses ranks attend
            every query for a share of the heads, so they share their ring rank's (or the sequence's) work.
        method: "ring", "ulysses" or "hybrid": the attention the plan is for.
        ulysses: the Ulysses ranks per ring rank (1 unless "hybrid").
    """

    indices: Tensor
    costs: Tensor
    method: str
    ulysses: int = 1

    @property
    def spread(self) -> float:
        """max / mean - 1 of ``costs``: how much longer the slowest rank's attention takes than the average's."""
        mean = float(self.costs.mean())
        return float(self.costs.max()) / mean - 1.0 if mean > 0 else 0.0

    def shard(self, x: Tensor, *, dim: int, cp_mesh: DeviceMesh) -> Tensor:
        """This rank's tokens of the replicated ``x`` (batch at dim 0, the sequence at ``dim``), in the plan's
        order; differentiable like ``shard_sequence`` (each rank keeps its part, the gradient of ``x`` is
        gathered from every rank)."""
        ring, ulysses = self._groups(cp_mesh)
        dim = self._check(x, dim, "x", self.indices.shape[1] * self.indices.shape[2])
        x = x.gather(dim, self._index(self.indices.flatten(1), x, dim))
        x = scatter_to_region(x, ring, dim)
        return scatter_to_region(x, ulysses, dim) if ulysses is not None else x

    def unshard(self, x_local: Tensor, *, dim: int, cp_mesh: DeviceMesh) -> Tensor:
        """The full rows, in sequence order, on every rank, from each rank's ``x_local`` (the inverse of
        ``shard``); its gradient is taken as replicated (each rank keeps its part)."""
        ring, ulysses = self._groups(cp_mesh)
        local = self.indices.shape[2] // self.ulysses
        dim = self._check(x_local, dim, "x_local", local)
        x = gather_from_region(x_local, ulysses, dim) if ulysses is not None else x_local
        x = gather_from_region(x, ring, dim)
        return x.gather(dim, self._index(self.indices.flatten(1).argsort(dim=1), x, dim))

    def positions(self, *, cp_mesh: DeviceMesh) -> Tensor:
        """``[batch, seq_local]`` int64 on the CPU (move it to the attention's device): the global positions of
        this rank's tokens (the attention's ``positions``, and the RoPE positions of its tokens)."""
        batch, seq = self.indices.shape[0], self.indices.shape[1] * self.indices.shape[2]
        return self.shard(torch.arange(seq).expand(batch, seq), dim=1, cp_mesh=cp_mesh)

    def _groups(self, cp_mesh: DeviceMesh):
        ring, ulysses = context_parallel_groups(cp_mesh)
        mesh_shape = (ring.size,) if ulysses is None else (ring.size, ulysses.size)
        plan_shape = (self.indices.shape[1],) if self.method != "hybrid" else (self.indices.shape[1], self.ulysses)
        if mesh_shape != plan_shape:
            raise ValueError(
                f"cp_mesh has shape {mesh_shape}; this {self.method} plan is for a mesh of shape {plan_shape}"
            )
        return ring, ulysses

    def _check(self, x, dim: int, arg: str, length: int) -> int:
        if not isinstance(x, Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
        if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim={dim!r} is out of range for {arg} of shape {tuple(x.shape)}")
        dim %= x.dim()
        if dim == 0:
            raise ValueError(f"dim=0 is the batch dim; the plan shards the sequence dim of {arg}")
        if x.shape[0] != self.indices.shape[0] or x.shape[dim] != length:
            raise ValueError(
                f"{arg} has shape {tuple(x.shape)}; the plan needs {self.indices.shape[0]} rows at dim 0 and "
                f"{length} tokens at dim {dim}"
            )
        return dim

    @staticmethod
    def _index(index: Tensor, x: Tensor, dim: int) -> Tensor:
        """``index`` [batch, seq] as a gather index of ``x`` along ``dim``."""
        shape = [1] * x.dim()
        shape[0], shape[dim] = index.shape
        return index.to(x.device).view(shape).expand(*x.shape[:dim], index.shape[1], *x.shape[dim + 1:])


def balanced_sequence_plan(document_ids: Tensor, cp_size, *, method: str = "ring") -> SequencePlan:
    """The plan of packed rows over the context-parallel ranks, from their documents.

    Every rank holds ``seq / cp`` tokens of each row. For "ring" each row is planned on its own (the step's
    work is the sum over rows, so balanced rows balance the step): long documents are cut zigzag-like into
    2 x cp pieces, short ones placed whole where the work is least (measured spread on the long-tailed mixes of
    ``bench_context_parallel --packed``: docs/architecture.md). "hybrid" plans the ring dim so, then splits each
    ring rank's tokens contiguously over its Ulysses ranks. "ulysses" needs no balancing (every rank attends
    every query for its share of the heads): the plan is contiguous.

    Args:
        document_ids: ``[batch, seq]`` integers: the full rows' documents (a negative id is padding), the same
            on every cp rank.
        cp_size: the number of cp ranks (an int) for "ring" and "ulysses"; ``(ring, ulysses)`` for "hybrid".
        method: "ring", "ulysses" or "hybrid".
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    ring, ulysses = _cp_shape(cp_size, method)
    if not isinstance(document_ids, Tensor):
        raise TypeError(f"document_ids must be a torch.Tensor, got {type(document_ids).__name__}")
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}; it must be [batch, seq]")
    seq = document_ids.shape[1]
    if seq % (ring * ulysses):
        raise ValueError(f"the sequence ({seq}) must split into {ring * ulysses} equal shards, one per cp rank")
    if method == "ulysses":  # the sequence's whole work (a one-rank plan's), shared by heads
        _, total = ops.balanced_sequence_plan(document_ids, 1)
        batch = document_ids.shape[0]
        indices = torch.arange(seq).expand(batch, seq).reshape(batch, ring, seq // ring).contiguous()
        costs = (total.sum().double() / ring).expand(ring).clone()
    else:
        indices, costs = ops.balanced_sequence_plan(document_ids, ring)
        costs = (costs.sum(0).double() / ulysses).repeat_interleave(ulysses)
    return SequencePlan(indices=indices, costs=costs, method=method, ulysses=ulysses)


def _cp_shape(cp_size, method: str) -> tuple[int, int]:
    def positive_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if method == "hybrid":
        if not (isinstance(cp_size, tuple) and len(cp_size) == 2 and all(positive_int(n) for n in cp_size)):
            raise ValueError(
                f"cp_size must be (ring, ulysses), two positive ints, for method='hybrid'; got {cp_size!r}"
            )
        return cp_size
    if not positive_int(cp_size):
        raise ValueError(f"cp_size must be a positive int for method={method!r}, got {cp_size!r}")
    return cp_size, 1
