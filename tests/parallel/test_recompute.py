"""Activation recompute (torchdist_ext.parallel.recompute): full and selective give the gradients of no recompute
bit for bit, on tensor-parallel blocks with sequence parallelism (2 ranks); selective recompute issues no extra
collective (counted at dispatch), full recompute reruns them; and both compose with zero-bubble pipeline stages."""

from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from tests.parallel.test_fsdp import BATCH, HIDDEN, SEQ, Block, loss_fn, reference_model
from tests.pipeline.test_schedules import pipeline_matches_one_process
from torchdist_ext.fp8 import DelayedScaling, convert_to_fp8
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.parallel.recompute import _COMMUNICATING, recompute
from torchdist_ext.testing import cached_mesh

COMMUNICATING = {op.default for op in _COMMUNICATING}


class CountCommunication(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in COMMUNICATING:
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def gradients_and_collectives(mode: str, fp8: bool):
    tp = cached_mesh((2,), ("tp",))
    model = nn.Sequential(*(Block(ColumnParallelLinear.from_linear(b.up, tp_mesh=tp, sequence_parallel=True),
                                  RowParallelLinear.from_linear(b.down, tp_mesh=tp, sequence_parallel=True))
                            for b in reference_model()))
    if fp8:  # delayed scales reduced over the ranks: the fp8 rings (tdx::all_gather_scaled_mm, ...)
        convert_to_fp8(model, DelayedScaling(amax_history_len=4))
    for block in model:
        recompute(block, mode)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1)).chunk(2, dim=1)[tp.get_local_rank()]
    x.requires_grad_()
    with CountCommunication() as counter:
        loss_fn(model(x)).backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()] + [x.grad]
    return grads, dict(counter.calls)


def recompute_modes_agree(fp8: bool):
    results = {mode: gradients_and_collectives(mode, fp8) for mode in ("none", "selective", "full")}
    (none, none_calls), (selective, selective_calls), (full, full_calls) = results.values()
    equal = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(none, selective, full))
    return equal, none_calls, selective_calls, full_calls


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_selective_and_full_recompute_equal_no_recompute_and_selective_repeats_no_collective(world2, fp8):
    for equal, none_calls, selective_calls, full_calls in world2.run(recompute_modes_agree, fp8):
        assert equal, "recompute changed a gradient"
        assert none_calls and selective_calls == none_calls, (none_calls, selective_calls)
        assert sum(full_calls.values()) > sum(none_calls.values()), (none_calls, full_calls)


def test_selective_recompute_keeps_every_communicating_op_of_a_forward():
    """Every tdx op that takes a process group is in the list, except those that run only in a backward."""
    backward_only = {"ring_attention_bwd", "defer_weight_grad"}
    communicating = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                     if name.startswith("tdx::") and any(
                         argument.name == "group_name"
                         for argument in getattr(torch.ops.tdx, name.split("::")[1]).default._schema.arguments)}
    assert communicating - backward_only == {op.default.name().split("::")[1] for op in _COMMUNICATING
                                             if op.default.namespace == "tdx"}


def test_recompute_refuses_unknown_modes():
    with pytest.raises(ValueError, match="mode must be one of none, selective, full, got 'some'"):
        recompute(nn.Linear(2, 2), "some")
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        recompute(lambda x: x, "full")


def recompute_around_a_nested_fsdp_unit() -> str:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(model[1], mesh=cached_mesh((torch.distributed.get_world_size(),), ("dp",)))
    with pytest.raises(ValueError) as refused:
        recompute(model, "selective")
    return str(refused.value)


def test_recompute_refuses_a_module_holding_fsdp_units_of_its_own(world2):
    """Their all-gathers would run inside the checkpoint and again in its rerun (SAC finds them mismatched
    under a 1F1B pipeline)."""
    for message in world2.run(recompute_around_a_nested_fsdp_unit):
        assert message.startswith("module holds FSDP2 units of its own (1)"), message


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_composes_with_the_zero_bubble_split(world2, mode):
    world2.run(pipeline_matches_one_process, "zb-h1", 4, 1, mode)
