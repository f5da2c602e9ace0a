"""Pipeline schedules as per-rank action lists from the planner's simulator, so the order the planner prices
is the order that runs.

    stages_of_rank("zb-v", pp=4, rank=0)        # [0, 7]: zb-v's V places two chunks on each rank
    rank_actions("zb-h1", pp=4, num_microbatches=8, rank=1)   # [Action("F", 1, 0), ...] in run order

Placement: ``torchdist_ext.planner.stage_of``. Each rank runs its simulated passes in the order of their
simulated start times.
"""

from typing import NamedTuple

from torchdist_ext.planner.schedule import SCHEDULES, chunks_per_rank, simulate_schedule, stage_of

__all__ = ["SCHEDULES", "Action", "every_rank_actions", "every_rank_timeline", "num_stages", "rank_actions",
           "rank_of_stage", "splits_weight_grad", "stages_of_rank"]


class Action(NamedTuple):
    """One action of a rank's step.

    Args:
        kind: "F" forward, "B" backward (with W unless the schedule splits it off) or "W" weight gradient.
        stage: the pipeline stage (model chunk) it runs.
        microbatch: the micro-batch it runs on.
    """

    kind: str
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
