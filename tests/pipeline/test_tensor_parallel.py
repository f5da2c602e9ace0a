"""Pipeline x tensor parallelism on 4 ranks (pp=2 x tp=2): stages of column / row-parallel blocks with sequence
parallelism (the ring-fused GEMMs; under zb-h1 in split mode, their weight gradients run in W) equal one
process on the whole batch: the loss, every gradient, and the weights after an optimizer step; also with every
block compiled (fullgraph=True) under zb-h1."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.parallel.test_fsdp import FFN, HIDDEN, Block
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.pipeline import Pipeline, stages_of_rank
from torchdist_ext.testing import cached_mesh

NUM_BLOCKS, BATCH, SEQ = 4, 8, 8


def reference_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)) for _ in range(NUM_BLOCKS)))


def loss_fn(out, target):
    """The mean over the batch's elements, as a sum over this rank's sequence block divided by the whole
    block count (the sequence-parallel shards' losses add up to the whole one)."""
    return (out.sin() * out * target).sum() / (out.shape[0] * SEQ * HIDDEN)


def pipeline_tp_matches(schedule: str, compiled: bool = False):
    mesh = cached_mesh((2, 2), ("pp", "tp"))
    tp, pp_rank, tp_rank = mesh["tp"], mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    reference = reference_model()
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(BATCH, SEQ, HIDDEN, generator=generator), torch.randn(BATCH, SEQ, HIDDEN,
                                                                                        generator=generator)
    loss_fn(reference(inputs), targets).backward()
    expected_loss = loss_fn(reference(inputs), targets).detach()
    (stage,) = stages_of_rank(schedule, 2, pp_rank)
    blocks = [Block(ColumnParallelLinear.from_linear(b.up, tp_mesh=tp, sequence_parallel=True),
                    RowParallelLinear.from_linear(b.down, tp_mesh=tp, sequence_parallel=True))
              for b in reference[2 * stage:2 * stage + 2]]
    if compiled:
        torch._dynamo.reset()
        for block in blocks:
            block.compile(fullgraph=True)
    pipe = Pipeline({stage: nn.Sequential(*blocks)}, pp_mesh=mesh["pp"], schedule=schedule, num_microbatches=4,
                    loss_fn=loss_fn)
    shard = lambda t: t.chunk(2, dim=1)[tp_rank]  # noqa: E731  (the sequence-parallel block)
    loss = pipe.step(shard(inputs), shard(targets))
    dist.all_reduce(loss, group=tp.get_group())  # the tp ranks' shard losses sum to the whole
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for ours, theirs in zip(blocks, reference[2 * stage:2 * stage + 2]):
        for name, p in ours.named_parameters():
            reference_grad = theirs.get_parameter(name).grad
            torch.testing.assert_close(p.grad.full_tensor(), reference_grad, rtol=1e-5, atol=1e-7)
    optimizer = torch.optim.SGD(pipe.stages[stage].parameters(), lr=0.1)
    optimizer.step()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for ours, theirs in zip(blocks, reference[2 * stage:2 * stage + 2]):
        for name, p in ours.named_parameters():
            torch.testing.assert_close(p.full_tensor(), theirs.get_parameter(name), rtol=1e-6, atol=1e-7)
    return all(getattr(m, "split_weight_grad", False) for b in blocks for m in (b.up, b.down))


@pytest.mark.parametrize("schedule, compiled", [("1f1b", False), ("zb-h1", False), ("zb-h1", True)],
                         ids=["1f1b", "zb-h1", "zb-h1-compiled"])
def test_pp2_tp2_sequence_parallel_matches_one_process(world4, schedule, compiled):
    split = world4.run(pipeline_tp_matches, schedule, compiled)
    assert split == [schedule == "zb-h1"] * 4
