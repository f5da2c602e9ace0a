"""The pipeline's message plan is valid for NCCL's in-order matching on every schedule (p = 2, 3, 4, 8; m = 1,
2, 3, p, p + 1, 2p, 2p + 1, 4p): under a rendezvous model of one FIFO stream per rank (a send finishes only
while its receive is posted too), every message is delivered to its own receive, batched per action boundary
or one op at a time; the model finds the deadlocks and mismatches of just-in-time posting (so it is not
vacuous); and the runtime posts exactly the plan, in order."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchdist_ext.pipeline import Pipeline, num_stages, partition_layers, stages_of_rank
from torchdist_ext.pipeline.messages import PostedOp, _messages, deadlocks, message_plan
from torchdist_ext.pipeline.schedule import every_rank_actions
from torchdist_ext.testing import cached_mesh

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", 1),
             ("zb-v", 1)]


def microbatch_counts(schedule: str, pp: int) -> list[int]:
    counts = [1, 2, 3, pp, pp + 1, 2 * pp, 2 * pp + 1, 4 * pp]
    return [m for m in counts if schedule != "interleaved-1f1b" or m % pp == 0]


@pytest.mark.parametrize("schedule, virtual_stages", SCHEDULES, ids=[f"{s}-v{v}" for s, v in SCHEDULES])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_plan_delivers_every_message_to_its_receive(schedule, virtual_stages, pp):
    for m, headers in [(m, headers) for m in microbatch_counts(schedule, pp) for headers in (True, False)]:
        plans = message_plan(schedule, pp, m, virtual_stages, headers)
        assert deadlocks(plans, batched=True) == [], (schedule, pp, m, headers)
        assert deadlocks(plans, batched=False) == [], (schedule, pp, m, headers)
        found, _ = _messages(schedule, pp, m, virtual_stages)
        actions = every_rank_actions(schedule, pp, m, virtual_stages)
        assert len(found) == sum(len(plan) for plan in plans) // 2
        for message, made, read in found:
            sends = [op for op in plans[message.src] if op.is_send and op.message == message]
            receives = [op for op in plans[message.dst] if not op.is_send and op.message == message]
            assert len(sends) == len(receives) == 1
            assert made + 1 <= sends[0].boundary <= len(actions[message.src])  # after the action that makes it
            assert receives[0].boundary <= read  # before the action that reads it
            assert sends[0].with_header == receives[0].with_header == (headers and message.microbatch == min(
                other.microbatch for other, _, _ in found if other[1:3] == message[1:3]))  # each kind's first
        for plan in plans:
            assert [op.boundary for op in plan] == sorted(op.boundary for op in plan)


def just_in_time_plans(schedule: str, pp: int, m: int, virtual_stages: int = 1) -> list[list[PostedOp]]:
    """Each send right after the action that makes it, each receive right before the action that reads it."""
    found, _ = _messages(schedule, pp, m, virtual_stages)
    plans = []
    for rank in range(pp):
        ops = ([PostedOp(made + 1, True, False, msg) for msg, made, _ in found if msg.src == rank]
               + [PostedOp(read, False, False, msg) for msg, _, read in found if msg.dst == rank])
        plans.append(sorted(ops, key=lambda op: (op.boundary, not op.is_send)))
    return plans


def test_the_model_finds_what_just_in_time_posting_does_wrong():
    stuck = deadlocks(just_in_time_plans("1f1b", 4, 8), batched=False)
    assert stuck and all(line.endswith("stuck") for line in stuck)
    assert deadlocks(just_in_time_plans("1f1b", 4, 8), batched=True) == []  # torch's pairing rescues 1F1B
    assert deadlocks(just_in_time_plans("interleaved-1f1b", 4, 8, 2), batched=True)  # but not interleaving
    mismatched = deadlocks(just_in_time_plans("zb-v", 4, 8), batched=True)
    assert any(" meets receive " in line for line in mismatched)  # zb-v: two messages swapped on one link


def posts_the_plan(schedule: str, num_microbatches: int) -> bool:
    """Two steps with dist.isend / dist.irecv recorded: the messages go out in the order of the plan with
    headers (each right before its data), then of the one without (the shapes are known), and both compute."""
    mesh = cached_mesh((dist.get_world_size(),), ("pp",))
    pp, rank = mesh.size(), mesh.get_local_rank()
    torch.manual_seed(0)
    layers = partition_layers(8, num_stages(schedule, pp))
    mine = {s: nn.Sequential(*(nn.Linear(8, 8) for _ in layers[s])) for s in stages_of_rank(schedule, pp, rank)}
    pipe = Pipeline(mine, pp_mesh=mesh["pp"], schedule=schedule, num_microbatches=num_microbatches,
                    loss_fn=lambda out, target: (out - target).square().mean())
    posted = []
    isend, irecv = dist.isend, dist.irecv

    def recording(op, is_send):
        def post(tensor, group, tag, **peer):
            posted.append((is_send, peer.get("group_dst", peer.get("group_src")), tag))  # headers: even tags
            return op(tensor, group=group, tag=tag, **peer)
        return post

    dist.isend, dist.irecv = recording(isend, True), recording(irecv, False)
    try:
        for headers in (True, False):  # the first step sends the headers; the second knows the shapes
            posted.clear()
            loss = pipe.step(torch.randn(2 * num_microbatches, 8), torch.randn(2 * num_microbatches, 8))
            expected = []
            for op in message_plan(schedule, pp, num_microbatches, headers=headers)[rank]:
                m = op.message
                tag = 2 * ((m.direction * pipe.num_stages + m.stage) * num_microbatches + m.microbatch)
                peer = m.dst if op.is_send else m.src
                expected += [(op.is_send, peer, t) for t in [tag] * op.with_header + [tag + 1]]
            assert posted == expected, (headers, posted, expected)
            assert torch.isfinite(loss)
    finally:
        dist.isend, dist.irecv = isend, irecv
    return True


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_the_runtime_posts_the_plan(world_pool, schedule):
    assert world_pool.get(4).run(posts_the_plan, schedule, 6) == [True] * 4
