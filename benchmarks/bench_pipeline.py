"""Pipeline schedules on 2 CPU ranks: step time against torch.distributed.pipelining's schedules, and the
measured bubble of each schedule next to the planner's predictions, on the same model.

    python benchmarks/bench_pipeline.py [--microbatches 4 8] [--batch 2048] [--out DIR]

The model: 8 blocks of ``Linear(1024, 1024) + tanh``, split into 2 stages (gpipe, 1f1b, zb-h1) or 4
(interleaved-1f1b with 2 chunks per rank, zb-v), a batch of ``--batch`` rows in ``m`` micro-batches, one thread
per rank. For each schedule and m, the median of 3 steps (after one warm-up): the step time, its ratio to
1f1b's, the measured idle fraction (1 - busy / makespan, averaged over the ranks), the planner's
prediction for the measured per-stage F / B / W times (``replay_schedule``: the order that ran, timed with
those costs), the same with each message between the ranks taking its measured transfer time (half a round
trip of one stage output, alone), the same with each action's own measured time instead of its stage's mean
(what it leaves out is the runtime's: its gaps between actions, message latency beyond the transfer) and the
planner's closed form (equal F / B / W). Against torch: the median wall time of
``step`` (slowest rank) of ours over that of torch's schedule on the same stages, in the same run
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``; torch has no
zb-h1 with one stage per rank: ``ScheduleInterleavedZeroBubble`` needs several). ``--out`` writes each
schedule's timeline PNG.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from torchdist_ext import _planner  # noqa: E402
from torchdist_ext.pipeline import (  # noqa: E402
    SCHEDULES,
    Pipeline,
    gather_timeline,
    measured_idle_fractions,
    num_stages,
    partition_layers,
    planner_name,
    plot_timeline,
    predicted_idle_fraction,
    stages_of_rank,
)

WIDTH, LAYERS = 1024, 8
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "zb-v": "ScheduleZBVZeroBubble"}


def stage_modules(schedule: str, rank: int) -> dict[int, nn.Module]:
    """This rank's stages of the benchmark model (the same weights on every call)."""
    v = 2 if schedule == "interleaved-1f1b" else 1
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    layers = partition_layers(LAYERS, num_stages(schedule, 2, v))
    return {s: nn.Sequential(*(blocks[i] for i in layers[s])) for s in stages_of_rank(schedule, 2, rank, v)}


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


def torch_step_seconds(schedule: str, microbatches: int, batch: int) -> float | None:
    """The step time of torch.distributed.pipelining's version of ``schedule`` on the same stages."""
    import torch.distributed.pipelining as pipelining

    if schedule not in TORCH_SCHEDULES:
        return None
    from torchdist_ext.testing import cached_mesh

    mesh = cached_mesh((2,), ("pp",))
    rank = mesh.get_local_rank()
    total = num_stages(schedule, 2, 2 if schedule == "interleaved-1f1b" else 1)
    stages = [pipelining.PipelineStage(module, index, total, torch.device("cpu"), group=mesh.get_group())
              for index, module in sorted(stage_modules(schedule, rank).items())]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
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
    """One stage-boundary message's transfer time between the two ranks: half the median of 5 round trips of
    a [rows, WIDTH] fp32 tensor (after one warm-up), measured alone."""
    rank = torch.distributed.get_rank(group)
    message = torch.randn(rows, WIDTH)
    trips = []
    for _ in range(6):
        torch.distributed.barrier(group)
        start = time.perf_counter()
        if rank == 0:
            torch.distributed.send(message, group_dst=1, group=group)
            torch.distributed.recv(message, group_src=1, group=group)
        else:
            torch.distributed.recv(message, group_src=0, group=group)
            torch.distributed.send(message, group_dst=0, group=group)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips[1:]) / 2


def measure(schedule: str, microbatches: int, batch: int, out: str | None) -> dict:
    from torchdist_ext.testing import cached_mesh

    mesh = cached_mesh((2,), ("pp",))
    v = 2 if schedule == "interleaved-1f1b" else 1
    pipe = Pipeline(stage_modules(schedule, mesh.get_local_rank()), pp_mesh=mesh, schedule=schedule,
                    num_microbatches=microbatches, loss_fn=nn.functional.mse_loss, virtual_stages=v)
    inputs, targets = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    ours = slowest_rank_seconds(lambda: pipe.step(inputs, targets))
    theirs = torch_step_seconds(schedule, microbatches, batch)
    runs = []
    for _ in range(3):
        torch.distributed.barrier()
        pipe.step(inputs, targets)
        timelines = gather_timeline(pipe)
        start = min(a.start for t in timelines for a in t)
        makespan = max(a.end for t in timelines for a in t) - start
        runs.append((makespan, measured_idle_fractions(timelines)[1], predicted_idle_fraction(pipe, timelines),
                     timelines))
    makespan, measured, predicted, timelines = sorted(runs, key=lambda r: r[0])[1]
    transfer = message_seconds(batch // microbatches, mesh.get_group())
    with_messages = predicted_idle_fraction(pipe, timelines, transfer)
    each_action = predicted_idle_fraction(pipe, timelines, transfer, each_action=True)
    closed = _planner.bubble_fraction(2, microbatches, planner_name(schedule), v)
    if out and mesh.get_local_rank() == 0:
        plot_timeline(Path(out) / f"pipeline_{schedule}_m{microbatches}.png", timelines,
                      title=f"{schedule}, p=2, m={microbatches}: measured bubble {measured:.3f}, planner "
                            f"{predicted:.3f} (closed form {closed:.3f})")
    return {"bench": "pipeline", "schedule": schedule, "pp": 2, "microbatches": microbatches, "batch": batch,
            "step_ms": round(makespan * 1e3, 1), "ours_ms": round(ours * 1e3, 1),
            "torch_ms": None if theirs is None else round(theirs * 1e3, 1),
            "ours_over_torch": None if theirs is None else round(ours / theirs, 3),
            "measured_bubble": round(measured, 3),
            "planner_bubble": round(predicted, 3), "message_ms": round(transfer * 1e3, 2),
            "planner_bubble_with_messages": round(with_messages, 3),
            "replayed_each_action": round(each_action, 3), "closed_form_bubble": round(closed, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--batch", type=int, default=2048, help="rows per step (8192: a few hundred ms per "
                        "micro-batch at m = 4, where compute dominates the messages)")
    parser.add_argument("--out", type=Path, default=None, help="write the timeline PNGs here")
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    from torchdist_ext.testing import spawn_world

    rows = []
    with spawn_world(2, timeout=600.0) as world:
        for m in args.microbatches:
            for schedule in SCHEDULES:
                rows.append(world.run(measure, schedule, m, args.batch, str(args.out) if args.out else None)[0])
                print(json.dumps(rows[-1]), flush=True)
    print()
    print(f"{'schedule':>17} {'m':>3} {'step ms':>8} {'/ 1f1b':>7} {'torch ms':>9} {'ours/torch':>10} {'bubble':>7} "
          f"{'planner':>8} {'relative':>9} {'message ms':>10} {'+ messages':>10} {'relative':>9} {'each action':>11} "
          f"{'relative':>9} {'closed form':>11}")
    for r in rows:
        base = next(b["ours_ms"] for b in rows if b["schedule"] == "1f1b" and b["microbatches"] == r["microbatches"])
        gap = (r["measured_bubble"] - r["planner_bubble"]) / r["planner_bubble"]
        gap_with = (r["measured_bubble"] - r["planner_bubble_with_messages"]) / r["planner_bubble_with_messages"]
        gap_each = (r["measured_bubble"] - r["replayed_each_action"]) / r["replayed_each_action"]
        torch_ms = "-" if r["torch_ms"] is None else f"{r['torch_ms']:.1f}"
        ratio = "-" if r["ours_over_torch"] is None else f"{r['ours_over_torch']:.3f}"
        print(f"{r['schedule']:>17} {r['microbatches']:>3} {r['ours_ms']:8.1f} {r['ours_ms'] / base:7.3f} "
              f"{torch_ms:>9} {ratio:>10} {r['measured_bubble']:7.3f} {r['planner_bubble']:8.3f} {gap:+9.1%} "
              f"{r['message_ms']:10.2f} {r['planner_bubble_with_messages']:10.3f} {gap_with:+9.1%} "
              f"{r['replayed_each_action']:11.3f} {gap_each:+9.1%} {r['closed_form_bubble']:11.3f}")


if __name__ == "__main__":
    main()
