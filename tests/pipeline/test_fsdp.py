"""Pipeline x FSDP2 on 4 ranks (pp=2 x dp=2): each stage sharded over its data-parallel pair accumulates over
the micro-batches and reduce-scatters once, after its last B (1f1b) or W (zb-h1); the loss, every gradient and
the weights after an optimizer step equal one process on the whole batch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from torchdist_ext.pipeline import Pipeline, stages_of_rank
from torchdist_ext.testing import cached_mesh

NUM_LAYERS, DIM, BATCH = 4, 16, 16


def reference_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(NUM_LAYERS)))


def pipeline_fsdp_matches(schedule: str):
    mesh = cached_mesh((2, 2), ("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    reference = reference_model()
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, DIM, generator=generator)
    nn.functional.mse_loss(reference(inputs), targets).backward()
    expected_loss = nn.functional.mse_loss(reference(inputs), targets).detach()
    (stage,) = stages_of_rank(schedule, 2, pp_rank)
    ours = reference_model()[2 * stage:2 * stage + 2]
    theirs = reference[2 * stage:2 * stage + 2]
    for layer in ours:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(ours, mesh=mesh["dp"])
    pipe = Pipeline({stage: ours}, pp_mesh=mesh["pp"], schedule=schedule, num_microbatches=4,
                    loss_fn=nn.functional.mse_loss)
    loss = pipe.step(inputs.chunk(2)[dp_rank], targets.chunk(2)[dp_rank])
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.optim.SGD(ours.parameters(), lr=0.1).step()
    torch.optim.SGD(theirs.parameters(), lr=0.1).step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-7)
    return [a.kind for a in pipe.timeline].count("W")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp2_dp2_fsdp_matches_one_process(world4, schedule):
    weight_passes = world4.run(pipeline_fsdp_matches, schedule)
    assert weight_passes == [4 if schedule == "zb-h1" else 0] * 4
