"""The main job's ``--ledger`` report: the planner's prediction for the run's layout next to what one step
measured on every rank (``LedgerProbe``: the trainer calls it around its last step, then ``report``).

    memory per rank   planner: params + grads + optimizer + activations + backward + buffers (without its framework
                      reserve; backward: what a backward pass allocates on top of the held activations, a
                      recomputed layer's rerun and the layer's gradients)
                      measured: the step's peak of live tensors (the caching allocator's on CUDA, less
                      cuBLAS's workspaces; ``torchdist_ext.cpu_memory``'s on the CPU), the largest rank's
    between passes    with a pipeline, the planner's figure less its backward next to the largest live bytes right
                      after a pipeline action (``TimedAction.live_bytes``): the memory held between passes
    pp rank r         with a pipeline, each pipeline rank's: the planner's for that rank (its own ends and
                      held micro-batches: ``Estimate.pipeline_ranks``) next to the largest peak, and peak
                      between passes, among the ranks at that pipeline coordinate
    bubble            planner: the schedule simulated with the step's measured F / B / W times (the closed form,
                      equal times, beside it); measured: the pipeline's idle fraction
    bytes per axis    planner: ``Estimate.comm``; measured: the communication ledger (``torchdist_ext.ledger``),
                      bytes sent per step, the busiest rank's

With experts the planner is asked at the step's measured routing (``Layout.expert_imbalance``: the busiest ep
rank's routed rows over the mean, ``RoutingLoad``), each pipeline rank at its own stage's, as the bubble is
predicted for the measured pass times; the uniform-routing figure is printed beside it.

The planner models bf16 or fp8 training on GPUs; it is asked about this run's precision (``fp32`` on the CPU),
so its bytes are this run's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchdist_ext import cpu_memory, ledger
from torchdist_ext.planner import ClusterSpec, Estimate, Layout, ModelSpec, estimate

# The planner's per-GPU allowance for the CUDA context, NCCL buffers, library workspaces and fragmentation
# (csrc/planner/estimate.cpp): not the model's tensors, so not in the measured peak (``peak_memory``).
FRAMEWORK_RESERVE_BYTES = 2 * 2**30


@dataclass
class StepMeasurement:
    """One rank's measurement of one step."""

    pipeline_rank: int = 0
    peak_memory: float = 0.0
    peak_between_passes: float | None = None  # with a pipeline
    sent_bytes: dict[str, float] = field(default_factory=dict)  # per axis label
    calls: dict[str, int] = field(default_factory=dict)
    expert_imbalance: float = 1.0  # RoutingLoad.imbalance of the step


class RoutingLoad:
    """The (token, expert) rows this rank's MoE layers route to each expert in a step: every call's kept counts
    (``MoE.last_tokens_per_expert``, through forward hooks) summed from ``start()`` to ``imbalance()``."""

    def __init__(self, moes: list):
        self.recording = False
        self.rows: torch.Tensor | None = None
        for moe in moes:
            moe.register_forward_hook(self._add)

    def start(self) -> None:
        """Records the calls from now on, from no rows."""
        self.recording, self.rows = True, None

    def _add(self, moe, args, output) -> None:
        if self.recording:
            counts = moe.last_tokens_per_expert
            self.rows = counts.clone() if self.rows is None else self.rows + counts

    def imbalance(self, ep_mesh) -> float:
        """The busiest ep rank's rows over the mean, the rows of every rank of ``ep_mesh`` summed (a collective
        over it; the experts in ep contiguous blocks); 1 without expert parallelism or rows. Stops recording."""
        self.recording = False
        if ep_mesh is None or ep_mesh.size() == 1 or self.rows is None:
            return 1.0
        rows = self.rows.to(torch.float64)
        dist.all_reduce(rows, group=ep_mesh.get_group())
        per_rank = rows.view(ep_mesh.size(), -1).sum(1)
        return float(per_rank.max() / per_rank.mean()) if per_rank.sum() > 0 else 1.0


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak of live tensor bytes on ``device``: CUDA's caching-allocator statistics, or on the CPU
    ``torchdist_ext.cpu_memory``'s (``track()`` it before the model is built)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        cpu_memory.reset_peak_memory_stats()


def peak_memory(device: torch.device) -> float:
    """The peak bytes of live tensors on ``device`` since ``reset_peak_memory``. On CUDA, the caching
    allocator's peak less what cuBLAS's workspaces hold in it (``cublas_workspace_bytes``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return float(peak - cublas_workspace_bytes(device))
    return float(cpu_memory.max_memory_allocated())


def cublas_workspace_bytes(device: torch.device) -> int:
    """The bytes cuBLAS's workspaces hold in the caching allocator (one per cuBLAS handle and stream, made at
    its first GEMM and kept): the library's, like the CUDA context the planner's framework reserve stands for,
    not the model's tensors. Frees them to count them (the next GEMM makes them again)."""
    before = torch.cuda.memory_allocated(device)
    torch._C._cuda_clearCublasWorkspaces()
    return before - torch.cuda.memory_allocated(device)


def ledger_axes(meshes, experts: bool) -> dict:
    """The ledger's axes of a run's ``ParallelMeshes``: FSDP2's traffic goes over dp_shard x cp (the experts'
    over the ranks holding the same experts), HSDP's replicas' all-reduce over dp_replicate; the groups of no
    axis (the gradient norm's, fp8's amax reductions) are "other"."""
    def shard_and_replicas(mesh, shard_dim: str) -> tuple[list, list]:
        return ([mesh[shard_dim]], [mesh["dp_replicate"]]) if mesh.ndim == 2 else ([mesh], [])

    dp, replicas = shard_and_replicas(meshes.fsdp, "dp_shard_cp")
    if experts:
        expert_dp, expert_replicas = shard_and_replicas(meshes.expert_fsdp, "expert_dp_shard")
        dp, replicas = dp + expert_dp, replicas + expert_replicas
    return {"tp": meshes.tp, "cp": [meshes.world["ring"], meshes.world["ulysses"]], "pp": meshes.pp, "dp": dp,
            **({"dp_replicate": replicas} if replicas else {}), **({"ep": meshes.ep} if experts else {})}


def comm_totals(groups: dict) -> tuple[dict[str, float], dict[str, int]]:
    """Bytes sent and calls per axis label since the ledger's last reset (``groups`` as ``ledger.by_label``'s;
    groups of no axis under "other"), without the rank-agreement check's all-gathers (the planner prices a run
    with the check off)."""
    tallies = ledger.by_label(groups, rest="other")
    totals = {label: ledger.total({op: t for op, t in ops.items() if op != "agreement_check"})
              for label, ops in tallies.items()}
    return {k: t.sent_bytes for k, t in totals.items()}, {k: t.calls for k, t in totals.items()}


def planner_bytes(e: Estimate, label: str) -> float | None:
    """The planner's bytes for an axis label ("dp+ep": both summed); None for what it does not model."""
    axes = label.split("+")
    if any(axis not in ("tp", "cp", "ep", "dp", "dp_replicate", "pp") for axis in axes):
        return None
    return sum(e.comm[axis].bytes if axis in e.comm else 0.0 for axis in axes)


def print_report(model: ModelSpec, layout: Layout, world_size: int, measured: list[StepMeasurement],
                 bubbles: tuple[float, float] | None) -> None:
    """Rank 0 prints the table (``measured`` holds every rank's; ``bubbles``: the planner's for the measured
    times and the measured, with a pipeline)."""
    cluster = ClusterSpec.preset("h100-80gb", world_size)

    def imbalance_of(ranks: list[StepMeasurement]) -> float:
        return min(max(m.expert_imbalance for m in ranks), float(layout.ep))

    def at(imbalance: float) -> Estimate:
        return estimate(model, cluster, dataclasses.replace(layout, expert_imbalance=imbalance))

    imbalance = imbalance_of(measured)
    e = at(imbalance)
    stage_imbalances = [imbalance_of([m for m in measured if m.pipeline_rank == r]) for r in range(layout.pp)]
    per_rank = [at(x).pipeline_ranks[r] for r, x in enumerate(stage_imbalances)]
    fullest = max(per_rank, key=lambda memory: memory.total)

    def row(name: str, predicted: float | None, value: float, unit: str, note: str = "") -> str:
        scale = 2**20 if unit == "MiB" else 1
        shown = "        n/a" if predicted is None else f"{predicted / scale:11.3f}"
        ratio = "    " if not predicted else f"{value / predicted:5.2f}"
        return f"  {name:<22}{shown} {value / scale:11.3f}  {ratio}  {unit} {note}"

    planner_memory = fullest.total - FRAMEWORK_RESERVE_BYTES
    lines = [f"planner vs measured ({layout.precision}, the last step; measured: the busiest rank's)"]
    if layout.ep > 1 and imbalance > 1:
        stages = ", ".join(f"{x:.2f}" for x in stage_imbalances)
        uniform = at(1.0)
        lines.append(f"  routing: the busiest ep rank's experts got {imbalance:.2f} x the mean of the "
                     f"rows{f' (per pp rank {stages})' if layout.pp > 1 else ''}; the planner is asked at that "
                     f"(at uniform routing: memory {(uniform.total_memory - FRAMEWORK_RESERVE_BYTES) / 2**20:.3f} MiB,"
                     f" ep bytes {planner_bytes(uniform, 'ep') / 2**20:.3f} MiB)")
    states = fullest.params + fullest.grads + fullest.optimizer
    buffers = fullest.buffers - FRAMEWORK_RESERVE_BYTES
    lines += [f"  {'':<22}{'planner':>11} {'measured':>11}  ratio",
              row("memory per rank", planner_memory, max(m.peak_memory for m in measured), "MiB",
                  f"(planner: states {states / 2**20:.2f}, activations {fullest.activations / 2**20:.2f}, "
                  f"backward {fullest.backward / 2**20:.2f}, buffers {buffers / 2**20:.2f})")]
    between = [m.peak_between_passes for m in measured if m.peak_between_passes is not None]
    if between:
        planner_between = max(memory.total - memory.backward for memory in per_rank) - FRAMEWORK_RESERVE_BYTES
        lines.append(row("  between passes", planner_between, max(between), "MiB",
                         "(the planner's, less its backward)"))
        for pipeline_rank, predicted in enumerate(per_rank):
            ranks = [m for m in measured if m.pipeline_rank == pipeline_rank]
            held = max(m.peak_between_passes for m in ranks)
            tensors = predicted.total - FRAMEWORK_RESERVE_BYTES
            lines.append(row(f"  pp rank {pipeline_rank}", tensors, max(m.peak_memory for m in ranks), "MiB",
                             f"(between passes {held / 2**20:.3f}: {held / (tensors - predicted.backward):.2f})"))
    if bubbles is not None:
        lines.append(row("pipeline bubble", bubbles[0], bubbles[1], "of the step",
                         f"(planner for equal F/B/W times {e.bubble:.3f})"))
    labels = sorted({label for m in measured for label in m.sent_bytes})
    for label in labels:
        busiest = max(m.sent_bytes.get(label, 0.0) for m in measured)
        calls = max(m.calls.get(label, 0) for m in measured)
        lines.append(row(f"{label} bytes sent", planner_bytes(e, label), busiest, "MiB", f"({calls} calls)"))
    print("\n".join(lines), flush=True)


def gather_measurements(measurement: StepMeasurement) -> list[StepMeasurement]:
    """Every rank's measurement, on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measurement)
    return gathered


class LedgerProbe:
    """Measures one step of a run (the ``step`` given: bytes sent per axis, this rank's peak memory and its
    peak between pipeline passes, the experts' routing) and prints it beside the planner's figures. The
    trainer calls ``start(step)`` before each step, ``finish(step, pipe)`` after its optimizer step and
    ``report(...)`` after the run; every call is collective where it reduces (``finish`` with experts,
    ``report``)."""

    def __init__(self, meshes, parts: list, device: torch.device, step: int, experts: bool):
        from torchdist_ext.parallel import MoE

        self.meshes, self.device, self.step = meshes, device, step
        self.axes = ledger_axes(meshes, experts)
        self.routing = RoutingLoad([m for part in parts for m in part.modules() if isinstance(m, MoE)])
        self.measurement = StepMeasurement(pipeline_rank=meshes.pp.get_local_rank())
        self.measured = False

    def start(self, step: int) -> None:
        if step == self.step:
            ledger.reset()
            reset_peak_memory(self.device)
            self.routing.start()

    def finish(self, step: int, pipe) -> None:
        if step != self.step:
            return
        self.measurement.peak_memory = peak_memory(self.device)
        if pipe is not None:
            self.measurement.peak_between_passes = max(a.live_bytes for a in pipe.timeline)
        self.measurement.sent_bytes, self.measurement.calls = comm_totals(self.axes)
        self.measurement.expert_imbalance = self.routing.imbalance(self.meshes.ep)
        self.measured = True

    def report(self, model: ModelSpec, layout: Layout, world_size: int, bubbles: tuple[float, float] | None,
               rank: int) -> None:
        """Rank 0 prints the table (nothing when the measured step did not run: a run resumed past it)."""
        if not self.measured:
            return
        measured = gather_measurements(self.measurement)
        if rank == 0:
            print_report(model, layout, world_size, measured, bubbles)
