"""Pipeline schedules as per-rank action lists, taken from the planner's simulator (``csrc/planner``), so the
order the planner prices is the order that runs.

    SCHEDULES                          gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v
    num_stages(schedule, pp, v)        pipeline stages of the model: pp; pp * v (interleaved); 2 pp (zb-v)
    stages_of_rank(schedule, pp, rank, v)   the stages rank holds, in chunk order
    rank_of_stage(schedule, pp, stage, v)   the rank holding a stage
    rank_actions(schedule, pp, m, rank, v)  [Action(kind, stage, microbatch)] in the order rank runs them
    every_rank_timeline(schedule, pp, m, v) every rank's actions with their simulated start and end

Placement: one stage per rank (gpipe, 1f1b, zb-h1); chunk c of rank d is stage ``c * pp + d`` (interleaved,
Megatron's); rank d holds stage d on the way down and stage ``2 pp - 1 - d`` on the way back (zb-v's V).
Actions: ``F`` forward, ``B`` backward (with the weight gradient, except in zb-h1 / zb-v where it is only the
input gradient) and ``W`` the weight gradient (zb-h1 / zb-v). Each rank runs its simulated passes in the
order of their simulated start times.
"""

from typing import NamedTuple

from torchdist_ext.planner.schedule import SCHEDULES, chunks_per_rank, simulate_schedule, stage_of

__all__ = ["SCHEDULES", "Action", "every_rank_actions", "every_rank_timeline", "num_stages", "rank_actions",
           "rank_of_stage", "splits_weight_grad", "stages_of_rank"]


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    stage: int
    microbatch: int


def _check(schedule: str, pp: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a positive int, got {pp!r}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive int, got {virtual_stages!r}")
    if schedule != "interleaved-1f1b" and virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved-1f1b' (zb-v always holds "
                         f"two chunks per rank), got {schedule!r}")


def num_stages(schedule: str, pp: int, virtual_stages: int = 1) -> int:
    """The number of pipeline stages the model is split into."""
    _check(schedule, pp, virtual_stages)
    return pp * chunks_per_rank(schedule, virtual_stages)


def splits_weight_grad(schedule: str) -> bool:
    """Whether the schedule runs weight gradients (W) apart from input gradients (B)."""
    return schedule in ("zb-h1", "zb-v")


def stages_of_rank(schedule: str, pp: int, rank: int, virtual_stages: int = 1) -> list[int]:
    """The stages ``rank`` holds, chunk 0 first."""
    _check(schedule, pp, virtual_stages)
    if not 0 <= rank < pp:
        raise ValueError(f"rank must be in [0, pp={pp}), got {rank}")
    return [stage_of(rank, c, pp, schedule) for c in range(chunks_per_rank(schedule, virtual_stages))]


def rank_of_stage(schedule: str, pp: int, stage: int, virtual_stages: int = 1) -> int:
    """The rank holding ``stage``."""
    stages = num_stages(schedule, pp, virtual_stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) ({schedule}, pp={pp}), got {stage!r}")
    if schedule == "zb-v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def rank_actions(schedule: str, pp: int, num_microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """The actions ``rank`` runs in one step, in order (the planner's simulated timeline)."""
    return every_rank_actions(schedule, pp, num_microbatches, virtual_stages)[rank]


def every_rank_actions(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """``rank_actions`` of every rank (index: rank), from one simulation."""
    return [[action for action, _, _ in passes]
            for passes in every_rank_timeline(schedule, pp, num_microbatches, virtual_stages)]


def every_rank_timeline(schedule: str, pp: int, num_microbatches: int,
                        virtual_stages: int = 1) -> list[list[tuple[Action, float, float]]]:
    """Every rank's actions in order with their simulated (start, end): the planner's unit times (F 1; B 2,
    or B 1 and W 1 under a weight-gradient split)."""
    _check(schedule, pp, virtual_stages)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    if schedule == "interleaved-1f1b" and num_microbatches % pp:
        raise ValueError(f"schedule 'interleaved-1f1b' needs num_microbatches divisible by pp={pp} (Megatron's "
                         f"order walks micro-batches in groups of pp), got {num_microbatches}")
    timeline = simulate_schedule(pp, num_microbatches, schedule, virtual_stages=virtual_stages)
    passes: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    for p in sorted(timeline, key=lambda p: p.start):  # stable: each rank's passes keep their order
        passes[p.rank].append((Action(p.kind, stage_of(p.rank, p.chunk, pp, schedule), p.microbatch), p.start, p.end))
    return passes
