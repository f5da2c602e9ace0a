"""Measured pipeline timelines: every rank's actions of the last step, the measured idle ("bubble") fraction
next to the planner's prediction for the measured F / B / W times, and a PNG of the timeline.

    timelines = gather_timeline(pipe)                   # every rank: [[TimedAction, ...] per pipeline rank]
    per_rank, overall = measured_idle_fractions(timelines)   # of one step
    predicted = predicted_idle_fraction(pipe, timelines)   # the planner's schedule, timed with the mean costs
    steps = gather_timelines(pipe, kept)                  # kept: this rank's pipe.timeline of each step
    predicted = predicted_idle_fraction(pipe, pool_steps(steps))   # with the mean costs over those steps
    plot_timeline("timeline.png", timelines, title=...)

The idle fraction of a rank is ``1 - busy / makespan`` over the step (from the first action's start on any
rank to the last one's end); the overall one averages the ranks, as the planner's ``bubble`` does.
"""

from pathlib import Path

import torch.distributed as dist

from torchdist_ext.pipeline.runtime import Pipeline, TimedAction
from torchdist_ext.planner.plot import draw_timeline
from torchdist_ext.planner.schedule import idle_fraction, replay_schedule

__all__ = ["action_costs", "gather_timeline", "gather_timelines", "mean_costs", "measured_idle_fractions",
           "plot_timeline", "pool_steps", "predicted_idle_fraction"]

def gather_timeline(pipe: Pipeline) -> list[list[TimedAction]]:
    """Every pipeline rank's timeline of the last step, on every rank (one all-gather of objects)."""
    return gather_timelines(pipe, [pipe.timeline])[0]


def gather_timelines(pipe: Pipeline, kept: list[list[TimedAction]]) -> list[list[list[TimedAction]]]:
    """Every pipeline rank's timelines of several steps, on every rank, in one all-gather of objects after
    the steps (none between them): ``kept`` holds this rank's ``pipe.timeline`` of each step, the same steps
    on every rank. Returns each step's ``[[TimedAction, ...] per pipeline rank]``."""
    gathered: list = [None] * pipe.pp
    dist.all_gather_object(gathered, [[tuple(a) for a in timeline] for timeline in kept], group=pipe.group)
    return [[[TimedAction(*a) for a in ranks[step]] for ranks in gathered] for step in range(len(kept))]


def pool_steps(steps: list[list[list[TimedAction]]]) -> list[list[TimedAction]]:
    """Each rank's actions over several steps' timelines, one list per rank: ``mean_costs`` and
    ``predicted_idle_fraction`` then take each stage's mean costs over all those steps."""
    return [[a for timelines in steps for a in timelines[rank]] for rank in range(len(steps[0]))]


def measured_idle_fractions(timelines: list[list[TimedAction]]) -> tuple[list[float], float]:
    """(each rank's idle fraction, their mean) over the step's makespan."""
    start = min(a.start for timeline in timelines for a in timeline)
    makespan = max(a.end for timeline in timelines for a in timeline) - start
    per_rank = [1.0 - sum(a.end - a.start for a in timeline) / makespan for timeline in timelines]
    return per_rank, sum(per_rank) / len(per_rank)


def mean_costs(timelines: list[list[TimedAction]], num_stages: int) -> dict[str, list[float]]:
    """Each action kind's ("F", "B", "W") mean duration on each stage (0 where the kind did not run), over
    every action given: one step's, or several steps' (each rank's list holding all of them)."""
    costs = {}
    for kind in "FBW":
        costs[kind] = []
        for stage in range(num_stages):
            durations = [a.end - a.start for t in timelines for a in t if a.kind == kind and a.stage == stage]
            costs[kind].append(sum(durations) / len(durations) if durations else 0.0)
    return costs


def action_costs(timelines: list[list[TimedAction]], num_stages: int, num_microbatches: int) -> dict[str, list[float]]:
    """Each action's own duration by kind ("F", "B", "W"), stage-major (``[stage * num_microbatches +
    micro-batch]``; 0 where the kind did not run) in one step's timelines."""
    costs = {kind: [0.0] * (num_stages * num_microbatches) for kind in "FBW"}
    seen = set()
    for timeline in timelines:
        for a in timeline:
            if (a.kind, a.stage, a.microbatch) in seen:
                raise ValueError(f"timelines must hold one step, got {a.kind} of stage {a.stage}, micro-batch "
                                 f"{a.microbatch} twice (each action's own time is one step's)")
            seen.add((a.kind, a.stage, a.microbatch))
            costs[a.kind][a.stage * num_microbatches + a.microbatch] = a.end - a.start
    return costs


def predicted_idle_fraction(pipe: Pipeline, timelines: list[list[TimedAction]], message_seconds: float = 0.0,
                            each_action: bool = False) -> float:
    """The planner's idle fraction for this schedule (``replay_schedule``: its order, each action as soon as
    its rank is free and its input exists), timed with each stage's measured mean F / B / W costs over the
    actions in ``timelines`` (one step's, or several steps' with each rank's list holding all of them: the
    mean over steps is steadier where action times vary), or with ``each_action`` each action's own measured
    time in one step's ``timelines`` (the B of an unsplit schedule, which computes W too,
    counts as measured); each message between ranks takes ``message_seconds`` (0: free). With each action's
    own time, what the replay leaves out is the runtime's: its gaps between actions and message latency."""
    if each_action:
        costs = action_costs(timelines, pipe.num_stages, pipe.num_microbatches)
    else:
        costs = mean_costs(timelines, pipe.num_stages)
    replayed = replay_schedule(pipe.pp, pipe.num_microbatches, pipe.schedule, costs,
                               virtual_stages=pipe.virtual_stages, message=message_seconds)
    return idle_fraction(replayed, pipe.pp)


def plot_timeline(path: str | Path, timelines: list[list[TimedAction]], title: str = "") -> None:
    """Writes a PNG: one row per pipeline rank with its F / B / W actions in wall-clock milliseconds from
    the step's start (gaps are the bubble); each bar is labelled with its stage and micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(a.start for timeline in timelines for a in timeline)
    rows = [[(a.kind, (a.start - start) * 1e3, (a.end - start) * 1e3, f"{a.stage}.{a.microbatch}") for a in timeline]
            for timeline in timelines]
    figure, axes = plt.subplots(figsize=(13, 1.0 + 0.7 * len(timelines)))
    draw_timeline(axes, rows, xlabel="ms from the step's start (labels: stage.micro-batch)", title=title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
