"""Estimates, findings and the layout search: Python faces of csrc/planner/{estimate,checks,search}.h."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torchdist_ext import _planner
from torchdist_ext.planner.specs import ClusterSpec, Layout, ModelSpec

__all__ = ["Estimate", "Finding", "estimate", "check", "search"]


@dataclass(frozen=True)
class Finding:
    """A failure mode found in a layout or a script: a stable ``code`` (TDX001..TDX007),
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
class Estimate:
    """Per-GPU memory (bytes, on the fullest pipeline stage), step time and its parts.

    ``comm`` maps each parallel axis of size > 1 to the bytes a GPU sends per
    step, the seconds that takes on the axis's link, the part not hidden
    behind compute, and whether the axis stays inside an NVLink domain.
    """

    memory: dict[str, float]
    gpu_memory: float
    fits: bool
    params_per_gpu: float
    tokens_per_step: float
    flops_per_step: float
    compute_seconds: float
    bubble: float
    comm: dict[str, dict] = field(default_factory=dict)
    step_seconds: float = 0.0
    mfu: float = 0.0
    tokens_per_second: float = 0.0

    @classmethod
    def from_cpp(cls, e) -> "Estimate":
        memory = {k: getattr(e, k) for k in ("params", "grads", "optimizer", "activations", "buffers")}
        memory["total"] = e.total_memory()
        comm = {
            axis: {"bytes": c.bytes, "seconds": c.seconds, "exposed_seconds": c.exposed,
                   "placement": "intra-domain" if c.intra_domain else "inter-node"}
            for axis, c in e.comm.items()
        }
        return cls(memory=memory, gpu_memory=e.gpu_memory, fits=e.fits(), params_per_gpu=e.params_per_gpu,
                   tokens_per_step=e.tokens_per_step, flops_per_step=e.model_flops_per_step,
                   compute_seconds=e.compute_seconds, bubble=e.bubble, comm=comm, step_seconds=e.step_seconds,
                   mfu=e.mfu, tokens_per_second=e.tokens_per_second())

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> Estimate:
    """Memory per GPU (params, grads, optimizer, activations, buffers), FLOPs, communication per
    axis, pipeline bubble, step time and MFU of ``layout`` for ``model`` on ``cluster``."""
    return Estimate.from_cpp(_planner.estimate(model.to_cpp(), cluster.to_cpp(), layout.to_cpp()))


def check(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> list[Finding]:
    """The layout's failure modes (TDX001, TDX002, TDX006, TDX007); the code-level ones come from ``lint``."""
    return [Finding(f.code, f.severity, f.message)
            for f in _planner.check(model.to_cpp(), cluster.to_cpp(), layout.to_cpp())]


def search(model: ModelSpec, cluster: ClusterSpec, *, seq_len: int, global_batch: int,
           top: int = 10) -> list[tuple[Layout, Estimate]]:
    """Feasible layouts (fit in memory, no error-level finding) for ``global_batch`` sequences of
    ``seq_len`` tokens per step, fastest first."""
    results = _planner.search(model.to_cpp(), cluster.to_cpp(), seq_len, global_batch, top)
    return [(Layout.from_cpp(layout), Estimate.from_cpp(e)) for layout, e in results]
