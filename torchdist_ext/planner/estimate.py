"""Estimates, findings and the layout search: Python faces of csrc/planner/{estimate,checks,search}.h.

Field names are the C++ ones (``Estimate``'s methods ``total_memory()``, ``fits()`` and
``tokens_per_second()`` become values here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torchdist_ext import _planner
from torchdist_ext.planner.specs import ClusterSpec, Layout, ModelSpec

__all__ = ["AxisComm", "ComputeTime", "Estimate", "RankMemory", "Finding", "estimate", "check", "search"]


@dataclass(frozen=True)
class Finding:
    """A failure mode found in a layout or a script: a stable ``code`` (TDX001..TDX008),
    ``severity`` ("error" or "warning") and a message that says what to do."""

    code: str
    severity: str
    message: str
    path: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}: " if self.path else ""
        return f"{where}{self.code} {self.severity}: {self.message}"


@dataclass(frozen=True)
class AxisComm:
    """One parallel axis's communication per GPU per step."""

    bytes: float  # sent
    seconds: float  # at the axis's link bandwidth
    exposed_seconds: float  # the part not hidden behind compute
    intra_domain: bool  # every group of the axis inside one NVLink domain


@dataclass(frozen=True)
class ComputeTime:
    """Busy time of one GPU per step, seconds, and its parts (csrc/planner/compute.h): the GEMMs, the attention
    kernels, the memory-bound ops and the optimizer's step."""

    seconds: float
    gemm_seconds: float
    attention_seconds: float
    memory_seconds: float
    optimizer_seconds: float

    @classmethod
    def from_cpp(cls, c) -> "ComputeTime":
        return cls(c.seconds, c.gemm_seconds, c.attention_seconds, c.memory_seconds, c.optimizer_seconds)


@dataclass(frozen=True)
class RankMemory:
    """One GPU's memory, bytes: ``activations`` held between passes at the rank's peak, ``backward`` what a
    backward pass allocates on top of them at its largest: a recomputed layer's rerun (``layer_rerun_bytes``)
    and the layer's gradients (``layer_backward_bytes``)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    backward: float
    buffers: float
    total: float


@dataclass(frozen=True)
class Estimate:
    """Per-GPU memory (bytes, on the fullest pipeline rank), step time and its parts.

    ``pipeline_ranks`` holds each pipeline rank's memory in rank order (one entry without pp): its own layers,
    the embedding with the first stage, the final norm, LM head and logits with the last, and the micro-batches
    its own order of passes holds at its peak; the top-level figures are ``pipeline_ranks[fullest_pipeline_rank]``.
    ``comm`` maps each parallel axis of size > 1 to its ``AxisComm``.
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    backward: float
    buffers: float
    total_memory: float
    gpu_memory: float  # the smallest GPU's
    fits: bool
    params_per_gpu: float  # parameters held (before ZeRO sharding)
    tokens_per_step: float
    model_flops_per_step: float  # 6 N_active D + causal attention, without recomputation
    compute: ComputeTime  # busy time of one GPU (with recomputation) and its parts
    bubble: float  # idle fraction of the pipeline
    attention_spread: float = 0.0  # the ring ranks' attention work, max / mean - 1 (packed documents, cp order)
    comm: dict[str, AxisComm] = field(default_factory=dict)
    step_seconds: float = 0.0
    # the model FLOPs per step over what the GPUs could do in the step at the peak of the unit running each
    # (the GEMMs' precision: fp8, TF32 or bf16; the LM head's; bf16 for the attention)
    mfu: float = 0.0
    tokens_per_second: float = 0.0
    pipeline_ranks: list[RankMemory] = field(default_factory=list)
    fullest_pipeline_rank: int = 0

    @classmethod
    def from_cpp(cls, e) -> "Estimate":
        comm = {axis: AxisComm(c.bytes, c.seconds, c.exposed_seconds, c.intra_domain) for axis, c in e.comm.items()}
        return cls(params=e.params, grads=e.grads, optimizer=e.optimizer, activations=e.activations,
                   backward=e.backward, buffers=e.buffers, total_memory=e.total_memory(), gpu_memory=e.gpu_memory,
                   fits=e.fits(),
                   params_per_gpu=e.params_per_gpu, tokens_per_step=e.tokens_per_step,
                   model_flops_per_step=e.model_flops_per_step, compute=ComputeTime.from_cpp(e.compute), bubble=e.bubble,
                   attention_spread=e.attention_spread, comm=comm, step_seconds=e.step_seconds, mfu=e.mfu, tokens_per_second=e.tokens_per_second(),
                   pipeline_ranks=[RankMemory(r.params, r.grads, r.optimizer, r.activations, r.backward, r.buffers,
                                              r.total()) for r in e.pipeline_ranks],
                   fullest_pipeline_rank=e.fullest_pipeline_rank)

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> Estimate:
    """Memory per GPU (params, grads, optimizer, activations, backward, buffers), FLOPs, communication per
    axis, pipeline bubble, step time and MFU of ``layout`` for ``model`` on ``cluster``."""
    return Estimate.from_cpp(_planner.estimate(model.to_cpp(), cluster.to_cpp(), layout.to_cpp()))


def check(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> list[Finding]:
    """The layout's failure modes (TDX001, TDX002, TDX006, TDX007; TDX008 alone when it cannot run at all); the
    code-level ones come from ``lint``."""
    return [Finding(f.code, f.severity, f.message)
            for f in _planner.check(model.to_cpp(), cluster.to_cpp(), layout.to_cpp())]


def search(model: ModelSpec, cluster: ClusterSpec, *, seq_len: int, global_batch: int,
           top: int = 10, expert_imbalance: float = 1.0, compiled: bool = False) -> list[tuple[Layout, Estimate]]:
    """Feasible layouts (fit in memory, no error-level finding) for ``global_batch`` sequences of
    ``seq_len`` tokens per step, fastest first. The candidates per axis depend on the model and the
    NVLink domain, not on the cluster's size, so the search is bounded. Layouts with experts are priced
    at ``expert_imbalance`` (``Layout.expert_imbalance``, capped at each layout's ep); ``compiled`` prices every
    layout with compiled blocks (``Layout.compiled``)."""
    if isinstance(expert_imbalance, bool) or not isinstance(expert_imbalance, (int, float)):
        raise TypeError(f"expert_imbalance must be a number, got {expert_imbalance!r}")
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled must be a bool, got {compiled!r}")
    results = _planner.search(model.to_cpp(), cluster.to_cpp(), seq_len, global_batch, top, float(expert_imbalance),
                              compiled)
    return [(Layout.from_cpp(layout), Estimate.from_cpp(e)) for layout, e in results]
