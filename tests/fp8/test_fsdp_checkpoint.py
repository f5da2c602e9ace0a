"""fp8 with FSDP2 over dp=2 x tp=2: training steps with fp8_step run, and a distributed checkpoint
restores every amax history and scale (and so the next step's casts)."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch import nn

from tests.parallel.test_fsdp import Block, inputs, loss_fn, reference_model
from torchdist_ext.fp8 import DelayedScaling, convert_to_fp8, fp8_modules, fp8_step
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.testing import cached_mesh


def fp8_fsdp_model(fp8_all_gather: bool = False):
    """The dp=2 x tp=2 sequence-parallel MLP of the FSDP tests in fp8, each block and the root sharded."""
    mesh = cached_mesh((2, 2), ("dp", "tp"))
    tp = mesh["tp"]
    model = nn.Sequential(*(Block(ColumnParallelLinear.from_linear(b.up, tp_mesh=tp, sequence_parallel=True),
                                  RowParallelLinear.from_linear(b.down, tp_mesh=tp, sequence_parallel=True))
                            for b in reference_model()))
    # Before FSDP2: it checks the tp shards' shapes.
    convert_to_fp8(model, DelayedScaling(amax_history_len=8), fp8_all_gather=fp8_all_gather)
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"]), mesh


def local_inputs(mesh):
    x = inputs().chunk(2, dim=0)[mesh["dp"].get_local_rank()]
    return x.chunk(2, dim=1)[mesh["tp"].get_local_rank()]  # sequence-parallel shard


def train_save_and_restore(path):
    model, mesh = fp8_fsdp_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = local_inputs(mesh)
    for scale in (1.0, 3.0):
        loss_fn(model(x * scale)).backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8_step(model)
    trained = [(m.amax_history.clone(), m.scale.clone()) for m in fp8_modules(model)]
    assert all(scale.ne(1.0).all() for _, scale in trained), "the scales moved off their start"
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    with torch.no_grad():
        expected = model(x * 2.0)

    fresh, _ = fp8_fsdp_model()
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    for (history, scale), module in zip(trained, fp8_modules(fresh)):
        assert torch.equal(module.amax_history, history) and torch.equal(module.scale, scale)
    with torch.no_grad():
        restored = fresh(x * 2.0)
    assert torch.equal(restored, expected), "the restored model casts differently"
    scales = torch.cat([m.scale for m in fp8_modules(fresh)])
    everyone = [torch.empty_like(scales) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, scales)
    return all(torch.equal(s, everyone[0]) for s in everyone)


def test_fsdp2_tp_fp8_trains_and_a_checkpoint_restores_histories_and_scales(world4, tmp_path):
    assert all(world4.run(train_save_and_restore, str(tmp_path / "ckpt")))
