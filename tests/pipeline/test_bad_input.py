"""Bad pipeline input: a clear ValueError / TypeError naming the argument, raised before any collective; and a
step that raises midway, after which the pipeline refuses further steps."""

import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from torchdist_ext.pipeline import Pipeline, partition_layers, rank_actions, rank_of_stage, stages_of_rank
from torchdist_ext.testing import cached_mesh, spawn_world


@pytest.mark.parametrize("call, message", [
    (lambda: partition_layers(10, 4), "num_layers=10 must be divisible by num_stages=4"),
    (lambda: partition_layers(10, stage_sizes=[3, 3, 3]), "stage_sizes must be positive ints summing to num_layers=10"),
    (lambda: partition_layers(10, stage_sizes=[12, -2]), "stage_sizes must be positive ints"),
    (lambda: partition_layers(10), "give exactly one of num_stages and stage_sizes"),
    (lambda: partition_layers(0, 1), "num_layers must be a positive int"),
    (lambda: rank_actions("2f2b", 2, 4, 0), "schedule must be one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v"),
    (lambda: rank_actions("interleaved-1f1b", 4, 6, 0, 2), "needs num_microbatches divisible by pp=4"),
    (lambda: rank_actions("1f1b", 2, 0, 0), "num_microbatches must be a positive int, got 0"),
    (lambda: rank_actions("1f1b", 2, 4, 0, 2), "virtual_stages=2 needs schedule='interleaved-1f1b'"),
    (lambda: stages_of_rank("1f1b", 2, 2), r"rank must be in \[0, pp=2\)"),
    (lambda: rank_of_stage("zb-v", 2, 4), r"stage must be in \[0, 4\) \(zb-v, pp=2\), got 4"),
], ids=["indivisible", "sizes-sum", "sizes-negative", "neither", "no-layers", "schedule", "interleaved-m",
        "no-microbatches", "virtual-stages", "rank", "stage"])
def test_refused_before_any_process_group(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def schedules_that_differ(field: str):
    """Rank 1 builds its pipeline with another schedule or micro-batch count; returns what this rank raised."""
    mesh = cached_mesh((2,), ("pp",))
    arguments = dict(schedule="1f1b", num_microbatches=2)
    if mesh.get_local_rank() == 1:
        arguments[field] = {"schedule": "gpipe", "num_microbatches": 4}[field]
    try:
        Pipeline({mesh.get_local_rank(): nn.Linear(4, 4)}, pp_mesh=mesh, loss_fn=nn.functional.mse_loss, **arguments)
    except ValueError as error:
        return str(error)


@pytest.mark.parametrize("field", ["schedule", "num_microbatches"])
def test_ranks_whose_schedules_differ_are_refused_on_every_rank(world2, field):
    for rank, text in enumerate(world2.run(schedules_that_differ, field)):
        assert text.startswith(f"PipelineSchedule: the ranks of the group must agree on {field}: rank {rank} has ")
    assert world2.alive


def pipeline_refusals():
    mesh = cached_mesh((2,), ("pp",))
    loss = nn.functional.mse_loss
    refused = []
    for kwargs, error, message in [
        (dict(stages={1: nn.Linear(4, 4)} if mesh.get_local_rank() == 0 else {0: nn.Linear(4, 4)}), ValueError,
         "stages must map this rank's stage indices"),
        (dict(stages={mesh.get_local_rank(): "linear"}), TypeError, "must be an nn.Module"),
        (dict(loss_fn="mse"), TypeError, "loss_fn must be callable"),
        (dict(schedule="zb-x"), ValueError, "schedule must be one of"),
        (dict(fixed_shapes=1), TypeError, "fixed_shapes must be a bool, got int"),
    ]:
        arguments = dict(stages={mesh.get_local_rank(): nn.Linear(4, 4)}, pp_mesh=mesh, schedule="1f1b",
                         num_microbatches=2, loss_fn=loss) | kwargs
        with pytest.raises(error, match=message):
            Pipeline(**arguments)
        refused.append(message)
    sharded_inside = nn.Sequential(nn.Linear(4, 4))
    fully_shard(sharded_inside[0])
    with pytest.raises(ValueError, match=r"stages\[\d\] holds fully_shard-ed modules but is not itself"):
        Pipeline({mesh.get_local_rank(): sharded_inside}, pp_mesh=mesh, schedule="1f1b", num_microbatches=2,
                 loss_fn=loss)
    pipe = Pipeline({mesh.get_local_rank(): nn.Linear(4, 4)}, pp_mesh=mesh, schedule="1f1b", num_microbatches=2,
                    loss_fn=loss)
    with pytest.raises(ValueError, match=r"inputs.size\(0\) must be divisible by num_microbatches=2"):
        pipe.step(torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(TypeError, match="targets must be a Tensor"):
        pipe.step(torch.randn(4, 4), [1, 2])
    return len(refused)


def test_pipeline_refuses_bad_arguments_on_every_rank_without_hanging(world2):
    assert world2.run(pipeline_refusals) == [5, 5]


class ShrinksSecondMicrobatch(nn.Module):
    """Stage 0 whose output for the second micro-batch has another shape than the first's."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        return out if self.calls == 1 else out[:, :2]


def step_with_a_shape_change():
    mesh = cached_mesh((2,), ("pp",))
    stage = ShrinksSecondMicrobatch() if mesh.get_local_rank() == 0 else nn.Linear(4, 4)
    pipe = Pipeline({mesh.get_local_rank(): stage}, pp_mesh=mesh, schedule="1f1b", num_microbatches=2,
                    loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))


def test_a_micro_batch_of_another_shape_is_refused_by_its_sender():
    """Only each kind's first message of a step carries a header, so the sender checks the later ones: the
    run ends with the sender's ValueError (its receiver, waiting for data that never comes, is stopped)."""
    with spawn_world(2, timeout=60.0) as world:
        with pytest.raises(ValueError, match=r"stage 1's input activation of micro-batch 1 has shape \[2, 2\].*"
                                             r"every micro-batch and, with fixed_shapes=True, every step must give "
                                             r"the stages the same shapes"):
            world.run(step_with_a_shape_change)


def two_steps_of_different_batch(fixed_shapes: bool) -> tuple[float, float]:
    """A step on 8 rows, then one on 4: with fixed_shapes=False the second loss, and that of a fresh pipeline
    on the same 4 rows (the same weights: the first step only accumulated gradients)."""
    mesh = cached_mesh((2,), ("pp",))
    torch.manual_seed(0)
    stage = nn.Linear(4, 4)

    def pipeline(**kwargs):
        return Pipeline({mesh.get_local_rank(): stage}, pp_mesh=mesh, schedule="1f1b", num_microbatches=2,
                        loss_fn=nn.functional.mse_loss, **kwargs)

    pipe = pipeline(fixed_shapes=fixed_shapes)
    pipe.step(torch.randn(8, 4), torch.randn(8, 4))
    inputs, targets = torch.randn(4, 4), torch.randn(4, 4)
    return pipe.step(inputs, targets).item(), pipeline().step(inputs, targets).item()


def test_a_step_of_other_shapes_needs_fixed_shapes_false():
    """Only the first step's messages carry headers by default: a later step of other shapes is refused by
    its sender; with fixed_shapes=False every step carries them again and computes."""
    with spawn_world(2, timeout=60.0) as world:
        for second, fresh in world.run(two_steps_of_different_batch, False):
            assert second == pytest.approx(fresh, rel=1e-6)
        with pytest.raises(ValueError, match=r"stage 1's input activation of micro-batch 0 has shape \[2, 4\].*"
                                             r"with fixed_shapes=True, every step must give the stages the same"):
            world.run(two_steps_of_different_batch, True)


class FailsOnCall(nn.Module):
    """A stage whose forward raises on its ``failing``-th call."""

    def __init__(self, failing: int):
        super().__init__()
        self.linear, self.failing, self.calls = nn.Linear(4, 4), failing, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.failing:
            raise ArithmeticError(f"stage failed on micro-batch {self.calls - 1}")
        return self.linear(x)


def a_step_after_a_failed_one() -> tuple[str, str, float]:
    mesh = cached_mesh((2,), ("pp",))
    rank = mesh.get_local_rank()
    pipe = Pipeline({rank: FailsOnCall(failing=2 if rank == 0 else 1)}, pp_mesh=mesh, schedule="1f1b",
                    num_microbatches=2, loss_fn=nn.functional.mse_loss)
    failures = []
    for _ in range(2):
        try:
            pipe.step(torch.randn(4, 4), torch.randn(4, 4))
        except Exception as error:
            failures.append(f"{type(error).__name__}: {error}")
    total = torch.ones(())
    torch.distributed.all_reduce(total, group=mesh.get_group())
    return *failures, total.item()


def test_a_step_after_one_that_raised_is_refused_and_the_group_still_works():
    """Stage 0 (rank 0) raises on micro-batch 1, once it has sent micro-batch 0 and posted the receive of its
    gradient; stage 1 (rank 1) on micro-batch 0, once it has received it. The next step is refused on both
    ranks (its messages would share tags with the failed step's), and the group's collectives still run: the
    posted receives' buffers are kept, not freed under gloo's reading thread."""
    with spawn_world(2, timeout=60.0) as world:
        for rank, (first, second, total) in enumerate(world.run(a_step_after_a_failed_one)):
            assert first == f"ArithmeticError: stage failed on micro-batch {1 - rank}", first
            assert second.startswith(f"RuntimeError: an earlier step() raised ({first}): messages of that step "
                                     "may still be in flight"), second
            assert total == 2.0


class ReturnsATuple(nn.Module):
    """A stage returning (output, an auxiliary value) instead of one Tensor."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        out = self.linear(x)
        return out, out.sum()


def per_sample_loss(out, targets):
    return (out - targets).square().mean(0)  # [4]: not reduced to a scalar


def float_loss(out, targets):
    return nn.functional.mse_loss(out, targets).item()


def a_step_with_a_bad_stage_or_loss(case: str) -> tuple[str, float]:
    """A 1f1b step on 2 ranks whose stage 0 returns a tuple, or whose loss_fn returns a non-scalar or a float:
    what this rank raised, then an all-reduce over the pipeline ranks (the group still works)."""
    mesh = cached_mesh((2,), ("pp",))
    rank = mesh.get_local_rank()
    stage = ReturnsATuple() if case == "tuple" and rank == 0 else nn.Linear(4, 4)
    loss_fn = {"tuple": nn.functional.mse_loss, "vector": per_sample_loss, "float": float_loss}[case]
    pipe = Pipeline({rank: stage}, pp_mesh=mesh, schedule="1f1b", num_microbatches=2, loss_fn=loss_fn)
    try:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))
        raised = "nothing"
    except (TypeError, ValueError) as error:
        raised = f"{type(error).__name__}: {error}"
    total = torch.ones(())
    torch.distributed.all_reduce(total, group=mesh.get_group())
    return raised, total.item()


def world_size_sum() -> float:
    total = torch.ones(())
    torch.distributed.all_reduce(total)
    return total.item()


@pytest.mark.parametrize("case, failing_rank, message", [
    ("tuple", 0, r"TypeError: stages\[0\] must return a Tensor \(stage 0's output, the input of stage 1\), got a "
                 r"tuple of 2 \(Tensor, Tensor\)"),
    ("vector", 1, r"ValueError: loss_fn must return a 0-d floating-point Tensor \(the micro-batch's loss, which its "
                  r"backward pass starts from\), got a torch.float32 Tensor of shape \(4,\)"),
    ("float", 1, r"TypeError: loss_fn must return a 0-d floating-point Tensor \(the micro-batch's loss, which its "
                 r"backward pass starts from\), got float \d"),
])
def test_a_bad_stage_output_or_loss_is_refused_on_every_rank(case, failing_rank, message):
    """The failing rank raises an error naming the stage or loss_fn and what came back; its peer, which waited
    for its message, raises the same error at once (not at its timeout) from the failure header sent in that
    message's place; the world and the group stay usable."""
    with spawn_world(2, timeout=60.0) as world:
        results = world.run(a_step_with_a_bad_stage_or_loss, case)
        for rank, (raised, total) in enumerate(results):
            assert re.match(message, raised), (rank, raised)
            if rank != failing_rank:
                assert raised.endswith(f"(raised on pipeline rank {failing_rank}; rank {rank} learned of it from "
                                       f"rank {failing_rank} and ended its step too)"), raised
            assert total == 2.0
        assert world.alive and world.run(world_size_sum) == [2.0, 2.0]
