"""The order in which every pipeline rank posts a step's point-to-point messages, free of deadlock under NCCL's
in-order matching: ``message_plan`` gives each rank its list of posts, ``deadlocks`` checks plans against a
model of NCCL's streams.

    plans = message_plan("1f1b", pp=4, num_microbatches=8)   # plans[rank]: [PostedOp(boundary, is_send, ...)]
    assert not deadlocks(plans)

Why just-in-time posting deadlocks and why this order does not: docs/architecture.md, "Pipeline parallelism".
"""

from bisect import bisect_left
from typing import NamedTuple

from torchdist_ext.pipeline.schedule import every_rank_timeline, num_stages, rank_of_stage

__all__ = ["FORWARD", "BACKWARD", "Message", "PostedOp", "deadlocks", "message_plan"]

FORWARD, BACKWARD = 0, 1


class Message(NamedTuple):
    """One activation (FORWARD) or input gradient (BACKWARD) that travels between two pipeline ranks.

    Args:
        sent_at: the planner's simulated end of the action that makes it: the first key of the global order.
        direction: ``FORWARD`` or ``BACKWARD``.
        stage: the stage that receives it.
        microbatch: its micro-batch.
        src: the pipeline rank that sends it.
        dst: the pipeline rank that receives it.
    """

    sent_at: float
    direction: int
    stage: int
    microbatch: int
    src: int
    dst: int


class PostedOp(NamedTuple):
    """One send or receive in a rank's plan (``message_plan``).

    Args:
        boundary: posted right before the rank's action at this position (``len(actions)``: after the last).
        is_send: a send (else a receive).
        with_header: the first message of its (direction, stage) in the step: preceded by a header with its
            shape and dtype.
        message: the message sent or received.
    """

    boundary: int
    is_send: bool
    with_header: bool
    message: Message


def _messages(schedule: str, pp: int, num_microbatches: int, virtual_stages: int):
    """Every cross-rank message of a step with the position of the action that sends it on its sender and
    of the action that reads it on its receiver, and each rank's simulated action end times."""
    timeline = every_rank_timeline(schedule, pp, num_microbatches, virtual_stages)
    stages = num_stages(schedule, pp, virtual_stages)
    position = {(a.kind, a.stage, a.microbatch): i for passes in timeline for i, (a, _, _) in enumerate(passes)}
    found = []
    for rank, passes in enumerate(timeline):
        for i, (action, _, end) in enumerate(passes):
            if action.kind == "F" and action.stage < stages - 1:
                direction, to_stage, reader = FORWARD, action.stage + 1, "F"
            elif action.kind == "B" and action.stage > 0:
                direction, to_stage, reader = BACKWARD, action.stage - 1, "B"
            else:
                continue
            dst = rank_of_stage(schedule, pp, to_stage, virtual_stages)
            if dst != rank:  # a handover between stages of one rank (zb-v's turn) stays in memory
                message = Message(end, direction, to_stage, action.microbatch, rank, dst)
                found.append((message, i, position[(reader, to_stage, action.microbatch)]))
    ends = [[end for _, _, end in passes] for passes in timeline]
    return found, ends


def message_plan(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1,
                 headers: bool = True) -> list[list[PostedOp]]:
    """Every rank's messages (index: pipeline rank), in the order it posts them, each with the action
    boundary at which it is posted (non-decreasing along the list).

    The order is one global order for every rank: by the time the planner's simulation sends the messages, ties
    broken by (direction, receiving stage, micro-batch). The sender posts a message right after the action that
    makes it, or later if a message ordered before it is still to be posted there; the receiver posts it one
    action ahead of the action that reads it, or earlier where the simulation sends it earlier. ``headers``: the
    first message of each (direction, stage) carries a header, whose receive is posted as late as the order
    allows (the host waits for the header before it posts the data's receive); without (a step whose shapes
    the receivers know), every receive is posted like the later ones."""
    found, ends = _messages(schedule, pp, num_microbatches, virtual_stages)
    plans = []
    for rank in range(pp):
        # (message, lowest boundary, highest boundary, is_send) of this rank's ops, in the global order
        ops = sorted([(m, made + 1, len(ends[rank]), True) for m, made, _ in found if m.src == rank]
                     + [(m, 0, read, False) for m, _, read in found if m.dst == rank])
        earliest, latest = [], [0] * len(ops)
        for _, low, _, _ in ops:
            earliest.append(max(low, earliest[-1] if earliest else 0))
        bound = len(ends[rank])
        for j in range(len(ops) - 1, -1, -1):
            bound = latest[j] = min(ops[j][2], bound)
        plan, kinds = [], set()
        for j, (m, _, read, is_send) in enumerate(ops):
            with_header = headers and (m.direction, m.stage) not in kinds
            kinds.add((m.direction, m.stage))
            if is_send:
                boundary = earliest[j]
            elif with_header:  # the host waits for the header where it posts the receive: as late as it can
                boundary = latest[j]
            else:  # by the simulated send or one action ahead of its reader, whichever comes first
                at_send = min(bisect_left(ends[rank], m.sent_at) + 1, len(ends[rank]))
                boundary = min(latest[j], max(earliest[j], min(at_send, read - 1)))
            boundary = max(boundary, plan[-1].boundary if plan else 0)
            plan.append(PostedOp(boundary, is_send, with_header, m))
        plans.append(plan)
    return plans


def deadlocks(plans: list[list[PostedOp]], batched: bool = True) -> list[str]:
    """What stays stuck when every rank posts ``plans`` (``message_plan``'s layout) on one FIFO stream with
    NCCL's rendezvous: the k-th send from A to B meets the k-th receive on B from A, and a message is delivered
    only while both its ops are at the head of their streams (``batched``: the ops a rank posts at one
    boundary form one batch that leaves the stream when all of them are delivered, and whose ops are
    delivered in any order). Returns the stuck ops and the pairs NCCL would match although they are two
    different messages; empty when every message is delivered to its own receive.

    It models the ops' order only, not the headers (each posted right before its data on both ranks), the host's
    waits for them, or whether a receive is posted before its reader: the tests check those separately."""
    partner = {}
    for rank, plan in enumerate(plans):
        counts: dict[tuple, int] = {}
        for j, op in enumerate(plan):
            peer = op.message.dst if op.is_send else op.message.src
            channel = (rank, peer) if op.is_send else (peer, rank)
            k = counts[(channel, op.is_send)] = counts.get((channel, op.is_send), -1) + 1
            partner[(rank, j)] = (channel, op.is_send, k)
    by_match: dict[tuple, dict[bool, tuple]] = {}
    for key, (channel, is_send, k) in partner.items():
        by_match.setdefault((channel, k), {})[is_send] = key
    message = {(rank, j): op.message for rank, plan in enumerate(plans) for j, op in enumerate(plan)}
    wrong = [f"send {message[pair[True]]} meets receive {message[pair[False]]}" for pair in by_match.values()
             if len(pair) == 2 and message[pair[True]] != message[pair[False]]]
    queues = []
    for rank, plan in enumerate(plans):
        batches: list[list[int]] = []
        for j, op in enumerate(plan):
            if batched and batches and plan[batches[-1][0]].boundary == op.boundary:
                batches[-1].append(j)
            else:
                batches.append([j])
        queues.append(batches)
    done: set = set()
    heads = [0] * len(plans)
    progress = True
    while progress:
        progress = False
        running = {(rank, j) for rank, q in enumerate(queues) if heads[rank] < len(q) for j in q[heads[rank]]}
        for key in running - done:
            channel, is_send, k = partner[key]
            other = by_match[(channel, k)].get(not is_send)
            if other in running:
                done.update((key, other))
                progress = True
        for rank, q in enumerate(queues):
            while heads[rank] < len(q) and all((rank, j) in done for j in q[heads[rank]]):
                heads[rank] += 1
                progress = True
    return wrong + [f"rank {rank}: {'send' if plans[rank][j].is_send else 'receive'} {plans[rank][j].message} "
                    f"stuck" for rank, q in enumerate(queues) for batch in q[heads[rank]:] for j in batch
                    if (rank, j) not in done]
