"""Pipeline schedules as the planner simulates them (``csrc/planner/pipeline.h``): one step pass by pass.

    passes = simulate_schedule(4, 8, "zb-h1")     # [ScheduledPass(rank, kind, microbatch, start, end, chunk)]
    idle_fraction(passes, 4)                      # equals bubble_fraction(4, 8, schedule="zb-h1")

A rank (device) holds one or more model chunks; ``stage_of(rank, chunk, pp, schedule)`` is the pipeline stage
(the model's chunk index) that chunk is.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchdist_ext import _planner

__all__ = ["SCHEDULES", "ScheduledPass", "chunks_per_rank", "idle_fraction", "replay_schedule", "simulate_schedule",
           "stage_of"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")

# One pass of one micro-batch on one rank: ``rank``, ``kind`` ("F" forward, "B" backward, with the weight
# gradient unless the schedule splits it off, "W" weight gradient), ``microbatch``, ``start``, ``end`` and the
# rank's ``chunk`` it runs (read-only attributes).
ScheduledPass = _planner.ScheduledPass


def simulate_schedule(pp: int, num_microbatches: int, schedule: str = "1f1b", *,
                      virtual_stages: int = 1) -> list[ScheduledPass]:
    """One simulated step with unit costs (a whole stage's F = B = W = 1; B = 2 where it includes W; a chunk
    costs its share): every pass in simulated order. ``interleaved-1f1b`` runs Megatron-LM's order
    (``num_microbatches`` divisible by ``pp``); the idle fraction equals ``bubble_fraction``."""
    return list(_planner.simulate_schedule(pp, num_microbatches, schedule, virtual_stages))


def replay_schedule(pp: int, num_microbatches: int, schedule: str, costs: dict[str, Sequence[float]], *,
                    virtual_stages: int = 1, message: float = 0.0) -> list[ScheduledPass]:
    """``simulate_schedule``'s per-rank order timed again with measured costs: ``costs["F"]``, ``["B"]`` and
    ``["W"]`` hold one value for every stage, one per stage, or one per stage and micro-batch (stage-major);
    each pass starts once its rank is free and its inputs exist, an input from another rank ``message``
    later."""
    return list(_planner.replay_schedule(pp, num_microbatches, schedule, virtual_stages, list(costs["F"]),
                                         list(costs["B"]), list(costs["W"]), message))


def idle_fraction(passes: Sequence[ScheduledPass], pp: int) -> float:
    """1 - busy time / (pp x makespan) of a simulated or replayed step."""
    return _planner.idle_fraction(list(passes), pp)


def chunks_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """The model chunks each rank holds: ``virtual_stages`` under interleaved-1f1b, 2 under zb-v, else 1."""
    return _planner.chunks_per_rank(schedule, virtual_stages)


def stage_of(rank: int, chunk: int, pp: int, schedule: str) -> int:
    """The pipeline stage of ``rank``'s ``chunk``: ``chunk * pp + rank`` (round robin), or zb-v's V (``rank`` on
    the way down, ``2 pp - 1 - rank`` on the way back)."""
    return _planner.stage_of(rank, chunk, pp, schedule)
