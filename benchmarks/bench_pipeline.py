"""Pipeline schedules on CPU ranks: step time against torch.distributed.pipelining's schedules, and the
measured bubble of each schedule next to the planner's predictions, on the same model.

    python -m benchmarks.bench_pipeline [--pp 4] [--microbatches 4 8 16] [--batch 2048] [--steps 5] [--out DIR]

The model: 8 blocks of ``Linear(1024, 1024) + tanh``, split into ``pp`` stages (gpipe, 1f1b, zb-h1) or
``2 pp`` (interleaved-1f1b with 2 chunks per rank, zb-v), a batch of ``--batch`` rows in ``m`` micro-batches,
one thread per rank. For each schedule and m:

- step time: the median over 3 steps (after one warm-up) of the slowest rank's wall time of ``step``, its
  ratio to 1f1b's, and its ratio to each torch schedule of the same kind on the same stages, in the same run
  (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``; zb-v against both of torch's two-chunk
  zero-bubble schedules, ``ScheduleZBVZeroBubble`` on the same V placement and
  ``ScheduleInterleavedZeroBubble`` on the looped one; torch has no zb-h1 with one stage per rank);
- bubble, over ``--steps`` timed steps: the measured idle fraction (1 - busy / makespan, averaged over the
  ranks, then over the steps) and the planner's prediction for the measured F / B / W times
  (``replay_schedule``: the order that ran, timed with each stage's mean F / B / W cost over those steps),
  the same with each message between the ranks taking its measured transfer time (half a round trip of one
  stage output, alone), the same with each action's own measured time instead of its stage's mean (the
  mean over the steps of each step's replay; what it leaves out is the runtime's: its gaps between
  actions, message latency beyond the transfer), and the planner's closed form (equal F / B / W).

With more ranks than cores (``--pp 4`` on a 2-core machine) the ranks share cores, and an action's wall time
includes the time its rank waited for a core: the bubble figures then describe that machine, not the
schedule; read them at ``--pp 2`` with ``--batch 8192`` (a few hundred ms per micro-batch). ``--out`` writes
each schedule's timeline PNG (the last timed step).
"""

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.report import arguments, emit, print_table
from torchdist_ext import pipeline
from torchdist_ext.planner import bubble_fraction

WIDTH, LAYERS = 1024, 8
# Each of our schedules' counterparts in torch.distributed.pipelining, with the placement (our schedule whose
# stages_of_rank it uses) of its stages.
TORCH_SCHEDULES = {
    "gpipe": [("ScheduleGPipe", "gpipe")],
    "1f1b": [("Schedule1F1B", "1f1b")],
    "interleaved-1f1b": [("ScheduleInterleaved1F1B", "interleaved-1f1b")],
    "zb-v": [("ScheduleZBVZeroBubble", "zb-v"), ("ScheduleInterleavedZeroBubble", "interleaved-1f1b")],
}


def virtual_stages(schedule: str) -> int:
    return 2 if schedule == "interleaved-1f1b" else 1


def stage_modules(placement: str, pp: int, rank: int) -> dict[int, nn.Module]:
    """This rank's stages of the benchmark model as ``placement`` (one of our schedules) places them (the
    same weights on every call)."""
    v = virtual_stages(placement)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    layers = pipeline.partition_layers(LAYERS, pipeline.num_stages(placement, pp, v))
    return {s: nn.Sequential(*(blocks[i] for i in layers[s])) for s in pipeline.stages_of_rank(placement, pp, rank, v)}


def slowest_rank_seconds(step) -> float:
    """The median over 3 calls (after a warm-up) of the slowest rank's wall time of ``step()``."""
    step()
    times = []
    for _ in range(3):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - start)
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def torch_step_seconds(name: str, placement: str, pp: int, microbatches: int, batch: int) -> float:
    """The step time of torch.distributed.pipelining's schedule ``name`` on the benchmark's stages, placed
    as our ``placement`` places them."""
    import torch.distributed.pipelining as pipelining

    from torchdist_ext.testing import cached_mesh

    mesh = cached_mesh((pp,), ("pp",))
    rank = mesh.get_local_rank()
    total = pipeline.num_stages(placement, pp, virtual_stages(placement))
    stages = [pipelining.PipelineStage(module, index, total, torch.device("cpu"), group=mesh.get_group())
              for index, module in sorted(stage_modules(placement, pp, rank).items())]
    cls = getattr(pipelining, name)
    runner = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=microbatches,
                 loss_fn=nn.functional.mse_loss)
    inputs, targets = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    holds = {s.stage_index for s in stages}
    args = (inputs,) if 0 in holds else ()
    target = targets if total - 1 in holds else None

    def step():
        runner.step(*args, target=target, losses=[] if target is not None else None)

    return slowest_rank_seconds(step)


def message_seconds(rows: int, group) -> float:
    """One stage-boundary message's transfer time between ranks 0 and 1: half the median of 5 round trips
    of a [rows, WIDTH] fp32 tensor (after one warm-up), measured alone."""
    rank = torch.distributed.get_rank(group)
    message = torch.randn(rows, WIDTH)
    trips = []
    for _ in range(6):
        torch.distributed.barrier(group)
        start = time.perf_counter()
        if rank == 0:
            torch.distributed.send(message, group_dst=1, group=group)
            torch.distributed.recv(message, group_src=1, group=group)
        elif rank == 1:
            torch.distributed.recv(message, group_src=0, group=group)
            torch.distributed.send(message, group_dst=0, group=group)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips[1:]) / 2


def measure(schedule: str, pp: int, microbatches: int, batch: int, steps: int, out: str | None) -> dict:
    from torchdist_ext.testing import cached_mesh

    mesh = cached_mesh((pp,), ("pp",))
    v = virtual_stages(schedule)
    pipe = pipeline.Pipeline(stage_modules(schedule, pp, mesh.get_local_rank()), pp_mesh=mesh, schedule=schedule,
                    num_microbatches=microbatches, loss_fn=nn.functional.mse_loss, virtual_stages=v)
    inputs, targets = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    ours = slowest_rank_seconds(lambda: pipe.step(inputs, targets))
    theirs = {name: torch_step_seconds(name, placement, pp, microbatches, batch)
              for name, placement in TORCH_SCHEDULES.get(schedule, [])}
    kept = []
    for _ in range(steps):
        torch.distributed.barrier()
        pipe.step(inputs, targets)
        kept.append(pipe.timeline)
    timed = pipeline.gather_timelines(pipe, kept)
    transfer = message_seconds(batch // microbatches, mesh.get_group())
    pooled = pipeline.pool_steps(timed)  # the stages' mean costs over every timed step
    each_step = [pipeline.measured_idle_fractions(timelines)[1] for timelines in timed]
    measured = statistics.mean(each_step)
    predicted = pipeline.predicted_idle_fraction(pipe, pooled)
    with_messages = pipeline.predicted_idle_fraction(pipe, pooled, transfer)
    each_action = statistics.mean(pipeline.predicted_idle_fraction(pipe, timelines, transfer, each_action=True)
                                  for timelines in timed)
    closed = bubble_fraction(pp, microbatches, schedule=schedule, virtual_stages=v)
    if out and mesh.get_local_rank() == 0:
        pipeline.plot_timeline(Path(out) / f"pipeline_{schedule}_p{pp}_m{microbatches}.png", timed[-1],
                      title=f"{schedule}, p={pp}, m={microbatches}: measured bubble "
                            f"{each_step[-1]:.3f} (mean of {steps} steps {measured:.3f}), "
                            f"planner {predicted:.3f} (closed form {closed:.3f})")
    return {"bench": "pipeline", "schedule": schedule, "pp": pp, "microbatches": microbatches, "batch": batch,
            "steps": steps, "ours_ms": round(ours * 1e3, 1),
            "torch_ms": {name: round(t * 1e3, 1) for name, t in theirs.items()},
            "ours_over_torch": {name: round(ours / t, 3) for name, t in theirs.items()},
            "measured_bubble": round(measured, 4),
            "measured_bubble_range": [round(min(each_step), 3), round(max(each_step), 3)],
            "planner_bubble": round(predicted, 4), "message_ms": round(transfer * 1e3, 2),
            "planner_bubble_with_messages": round(with_messages, 4),
            "replayed_each_action": round(each_action, 4), "closed_form_bubble": round(closed, 3)}


def table(rows: list[dict]) -> list[tuple]:
    """The table's columns: "/ 1f1b" divides the step time by 1f1b's at the same m; each "relative" is the measured
    bubble's gap to the prediction on its left, relative to that prediction."""
    def versus_1f1b(r: dict) -> float:
        return r["ours_ms"] / next(b["ours_ms"] for b in rows
                                   if b["schedule"] == "1f1b" and b["microbatches"] == r["microbatches"])

    def gap(key: str):
        return lambda r: (r["measured_bubble"] - r[key]) / r[key]

    def ratios(r: dict) -> str:
        return ", ".join(f"{ratio:.3f} ({name.removeprefix('Schedule')})"
                         for name, ratio in r["ours_over_torch"].items()) or "-"

    return [("schedule", 17, "schedule"), ("m", 3, "microbatches"), ("step ms", 8, "ours_ms", ".1f"),
            ("/ 1f1b", 7, versus_1f1b, ".3f"), ("ours / torch", 40, ratios), ("bubble", 7, "measured_bubble", ".3f"),
            ("range", 13, lambda r: "{:.3f}-{:.3f}".format(*r["measured_bubble_range"])),
            ("planner", 8, "planner_bubble", ".3f"), ("relative", 9, gap("planner_bubble"), "+.1%"),
            ("message ms", 10, "message_ms", ".2f"), ("+ messages", 10, "planner_bubble_with_messages", ".3f"),
            ("relative", 9, gap("planner_bubble_with_messages"), "+.1%"),
            ("each action", 11, "replayed_each_action", ".3f"), ("relative", 9, gap("replayed_each_action"), "+.1%"),
            ("closed form", 11, "closed_form_bubble", ".3f")]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (one process each)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--batch", type=int, default=2048, help="rows per step (8192 at --pp 2: a few hundred "
                        "ms per micro-batch at m = 4, where compute dominates the messages)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps whose bubble is averaged")
    parser.add_argument("--out", type=Path, default=None, help="write the timeline PNGs here")
    args = parser.parse_args()
    if args.pp < 2 or LAYERS % (2 * args.pp):
        parser.error(f"--pp must be at least 2 and 2 pp must divide the {LAYERS} blocks, got {args.pp}")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    from torchdist_ext.testing import spawn_world

    rows = []
    with spawn_world(args.pp, timeout=900.0) as world:
        for m in args.microbatches:
            for schedule in pipeline.SCHEDULES:
                emit(world.run(measure, schedule, args.pp, m, args.batch, args.steps,
                               str(args.out) if args.out else None)[0], rows)
    print()
    print_table(rows, table(rows))


if __name__ == "__main__":
    main()
