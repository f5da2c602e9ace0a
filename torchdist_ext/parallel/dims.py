"""The sizes of a run's parallel axes, checked once, and every DeviceMesh they need, built once.

    dims = ParallelDims(world_size=8, tp=2, cp=2)        # dp_shard takes the rest: 2
    meshes = dims.build_meshes("cpu")                    # meshes.tp, meshes.fsdp, meshes.cp, ...
    layout = dims.layout(seq_len=4096, micro_batch=1)    # the planner's Layout of the same run
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from torchdist_ext.parallel.context_attention import hybrid_attention, ring_attention, ulysses_attention
from torchdist_ext.parallel.sequence_plan import SequencePlan, balanced_sequence_plan
from torchdist_ext.planner import Layout

__all__ = ["ParallelDims", "ParallelMeshes"]

_AXES = ("dp_replicate", "dp_shard", "cp", "cp_ulysses", "tp", "pp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel axes of a run on ``world_size`` ranks (row-major rank order, innermost last: pp, dp_replicate,
    dp_shard, cp, tp).

    Attributes:
        world_size: the number of ranks; the product of pp, dp_replicate, dp_shard, cp and tp.
        dp_replicate: data-parallel replicas (HSDP's replicate dim: gradients all-reduced across them).
        dp_shard: FSDP2's shard dim (with cp: parameters are sharded over dp_shard x cp); -1 takes what the other
            axes leave of ``world_size``.
        cp: context-parallel ranks (each holds a shard of every sequence).
        cp_ulysses: the Ulysses ranks within cp: 1 is ring attention over every cp rank, cp is Ulysses over every
            one, between is ``hybrid_attention``'s cp / cp_ulysses ring ranks around Ulysses groups.
        tp: tensor-parallel ranks.
        pp: pipeline ranks.
        ep: expert-parallel ranks, carved out of dp_shard x cp (consecutive ranks of one replica): they see
            different tokens and hold different experts. The experts run replicated over tp.
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    cp_ulysses: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("world_size", *_AXES):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"ParallelDims: {name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1 and not (name == "dp_shard" and value == -1):
                rule = "at least 1, or -1 for what the other axes leave" if name == "dp_shard" else "at least 1"
                raise ValueError(f"ParallelDims: {name}={value} must be {rule}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(f"ParallelDims: dp_replicate x cp x tp x pp = {self.dp_replicate} x {self.cp} x "
                                 f"{self.tp} x {self.pp} = {others} must divide world_size={self.world_size} "
                                 f"(dp_shard=-1 takes the rest)")
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if others * self.dp_shard != self.world_size:
            raise ValueError(f"ParallelDims: pp x dp_replicate x dp_shard x cp x tp = {self.pp} x {self.dp_replicate} "
                             f"x {self.dp_shard} x {self.cp} x {self.tp} = {others * self.dp_shard} must equal "
                             f"world_size={self.world_size}")
        if self.cp % self.cp_ulysses:
            raise ValueError(f"ParallelDims: cp_ulysses={self.cp_ulysses} must divide cp={self.cp}")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"ParallelDims: ep={self.ep} must divide dp_shard x cp = {self.dp_shard} x {self.cp} "
                             f"(the expert-parallel ranks are data- or context-parallel ranks of one replica)")

    @property
    def dp(self) -> int:
        """The data-parallel ranks (dp_replicate x dp_shard): each reads its own rows of every batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def cp_method(self) -> str | None:
        """The context-parallel attention these dims run: "ring" (cp_ulysses 1), "ulysses" (cp_ulysses = cp),
        "hybrid" (between); None without cp."""
        if self.cp == 1:
            return None
        return {1: "ring", self.cp: "ulysses"}.get(self.cp_ulysses, "hybrid")

    @property
    def ring(self) -> int:
        """The ring-attention ranks of cp (cp / cp_ulysses)."""
        return self.cp // self.cp_ulysses

    @classmethod
    def from_layout(cls, layout: Layout) -> ParallelDims:
        """The axes of a planner ``Layout`` (which must be ZeRO-3: FSDP2 over dp_shard x cp, or HSDP with
        ``layout.dp_replicate``). The planner's ep ranks are data-parallel ranks: dp_shard = its dp x ep / its
        dp_replicate."""
        if not isinstance(layout, Layout):
            raise TypeError(f"ParallelDims.from_layout: layout must be a torchdist_ext.planner.Layout, got "
                            f"{type(layout).__name__}")
        if layout.zero_stage != 3:
            raise ValueError(f"ParallelDims.from_layout: layout.zero_stage={layout.zero_stage}; the meshes are "
                             f"FSDP2's, whose sharding is ZeRO-3 (set zero_stage=3)")
        data = layout.dp * layout.ep  # (Layout checks that dp_replicate divides dp)
        return cls(world_size=layout.num_gpus, dp_replicate=layout.dp_replicate,
                   dp_shard=data // layout.dp_replicate, cp=layout.cp, cp_ulysses=layout.cp_ulysses,
                   tp=layout.tp, pp=layout.pp, ep=layout.ep)

    def layout(self, **settings) -> Layout:
        """The planner's ``Layout`` of these axes (ZeRO-3, as FSDP2 shards), with its other fields from
        ``settings`` (e.g. ``seq_len``, ``micro_batch``, ``recompute``). The planner's ep ranks are
        data-parallel ranks: an ep larger than what dp_shard can hold (ep not dividing dp_shard) is refused.
        With cp > 1 the run's ep groups take cp ranks first (consecutive ranks of dp_shard x cp) where the
        planner places ep outside cp: the bytes and memory agree, its node placement of ep is approximate."""
        given = set(settings) & {"tp", "pp", "dp", "dp_replicate", "cp", "ep", "cp_ulysses", "zero_stage"}
        if given:
            raise ValueError(f"ParallelDims.layout: {sorted(given)} are the dims' own; pass only training "
                             f"settings (seq_len, micro_batch, recompute, ...)")
        if self.dp_shard % self.ep:
            raise ValueError(f"ParallelDims.layout: ep={self.ep} does not divide dp_shard={self.dp_shard}: the "
                             f"planner's ep ranks are data-parallel ranks, it cannot price an ep that needs cp ranks")
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp // self.ep, dp_replicate=self.dp_replicate, cp=self.cp,
                      cp_ulysses=self.cp_ulysses, ep=self.ep, zero_stage=3, **settings)

    def build_meshes(self, device_type: str) -> ParallelMeshes:
        """Every mesh of the run (collective: every rank calls it, after ``init_process_group``)."""
        return ParallelMeshes(self, device_type)


class ParallelMeshes:
    """The DeviceMeshes of a ``ParallelDims``, each built once: 1-D meshes ``pp``, ``tp``; ``dp`` (dp_replicate x
    dp_shard flattened: the sampler's ranks); ``cp`` (None without cp; ring or Ulysses 1-D, the hybrid's
    ``(ring, ulysses)`` 2-D); ``fsdp`` (FSDP2's: dp_shard x cp flattened, or with dp_replicate > 1 the 2-D HSDP
    mesh ``(dp_replicate, dp_shard_cp)``); ``batch`` (every rank that sees other tokens than this one's tp peers:
    dp x cp flattened, over which a loss is averaged); ``stage`` (all of a pipeline stage's ranks); ``ep`` and
    ``expert_fsdp`` (an MoE's: the expert-parallel ranks, one each with ep = 1, and the ranks holding the same
    experts, the 2-D ``(dp_replicate, expert_dp_shard)`` with HSDP). ``world`` has the dims ``pp, dp_replicate, dp_shard,
    ring, ulysses, tp``."""

    def __init__(self, dims: ParallelDims, device_type: str):
        if not torch.distributed.is_initialized():
            raise RuntimeError("ParallelDims.build_meshes: call torch.distributed.init_process_group first")
        if torch.distributed.get_world_size() != dims.world_size:
            raise ValueError(f"ParallelDims.build_meshes: world_size={dims.world_size} but the process group has "
                             f"{torch.distributed.get_world_size()} ranks")
        self.dims = dims
        # Every view unflattens one 1-D mesh of the world, so that all share its root (FSDP2 composes with the
        # DTensors of another view's tp mesh) and no flattened dim is sliced from a root.
        flat = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
        self.world = flat._unflatten(0, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.ring, dims.cp_ulysses,
                                         dims.tp), ("pp", "dp_replicate", "dp_shard", "ring", "ulysses", "tp"))
        world = self.world
        self.pp, self.tp = world["pp"], world["tp"]
        self.dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        self.batch = world["dp_replicate", "dp_shard", "ring", "ulysses"]._flatten("batch")
        self.stage = world["dp_replicate", "dp_shard", "ring", "ulysses", "tp"]._flatten("stage")
        shard_cp = dims.dp_shard * dims.cp
        dense = flat._unflatten(0, (dims.pp, dims.dp_replicate, shard_cp, dims.tp),
                                ("pp", "dp_replicate", "dp_shard_cp", "tp"))
        self.fsdp = dense["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else dense["dp_shard_cp"]
        if dims.dp_replicate > 1:  # a gradient norm's one all-reduce over the dims HSDP's DTensors are partial on
            dense["dp_shard_cp", "tp"]._flatten("replica")
        self.cp = None
        if dims.cp > 1:
            self.cp = {"ring": world["ring"], "ulysses": world["ulysses"]}.get(dims.cp_method, world["ring", "ulysses"])
        experts = flat._unflatten(0, (dims.pp, dims.dp_replicate, shard_cp // dims.ep, dims.ep, dims.tp),
                                  ("pp", "dp_replicate", "expert_dp_shard", "ep", "tp"))
        # The experts' gradient norm: one all-reduce over the dims their DTensors are partial on.
        experts["expert_dp_shard", "ep"]._flatten("experts")
        if dims.dp_replicate > 1:
            experts["dp_replicate", "expert_dp_shard", "ep"]._flatten("replicated_experts")
        self.ep = experts["ep"]
        self.expert_fsdp = (experts["dp_replicate", "expert_dp_shard"] if dims.dp_replicate > 1
                            else experts["expert_dp_shard"])

    def context_attention(self, *, causal: bool = True, order: str | None = None):
        """The attention of these dims' cp (``ring_attention``, ``ulysses_attention`` or ``hybrid_attention``
        over ``cp``, with ``causal`` and the sequence ``order``: None is zigzag, or the ``positions`` of a
        ``sequence_plan`` when the call passes them), a function of (q, k, v); None without cp."""
        if self.cp is None:
            return None
        method = {"ring": ring_attention, "ulysses": ulysses_attention, "hybrid": hybrid_attention}[self.dims.cp_method]
        return partial(method, cp_mesh=self.cp, causal=causal, order=order)

    def sequence_plan(self, document_ids: Tensor) -> SequencePlan:
        """``balanced_sequence_plan`` of the full rows' ``document_ids`` ``[batch, seq]`` over these dims' cp, for
        their cp method (ring, Ulysses or hybrid)."""
        if self.cp is None:
            raise ValueError("sequence_plan needs context parallelism (cp > 1)")
        method = self.dims.cp_method
        cp_size = (self.dims.ring, self.dims.cp_ulysses) if method == "hybrid" else self.dims.cp
        return balanced_sequence_plan(document_ids, cp_size, method=method)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{f.name}={getattr(self.dims, f.name)}" for f in dataclasses.fields(self.dims))
        return f"ParallelMeshes({sizes})"

