"""TP layers inside FSDP2: fully_shard over dp of a (dp=2 x tp=2) mesh on 4 ranks.

The reference is the same two-block model in one process on the whole batch.
Checked: the loss, every gradient (full_tensor()), the weights after an
optimizer step, gradient accumulation over two micro-batches, and FSDP2's mixed
precision (bf16 compute and all-gathers, fp32 gradient reduction and master weights).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from torchdist_ext.parallel import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.testing import cached_mesh, gather_replicated, shard_replicated

BATCH, SEQ, HIDDEN, FFN = 4, 8, 16, 32


class Block(nn.Module):
    """x + W2 gelu(W1 x): the reference, or its tensor-parallel twin."""

    def __init__(self, up: nn.Module, down: nn.Module):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


def reference_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)) for _ in range(2)))


def parallel_model(reference, tp_mesh, dp_mesh, sequence_parallel,
                   mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> nn.Sequential:
    blocks = [
        Block(
            ColumnParallelLinear.from_linear(block.up, tp_mesh=tp_mesh, sequence_parallel=sequence_parallel),
            RowParallelLinear.from_linear(block.down, tp_mesh=tp_mesh, sequence_parallel=sequence_parallel),
        )
        for block in reference
    ]
    model = nn.Sequential(*blocks)
    for block in model:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def inputs():
    return torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))


def loss_fn(y):
    return (y.sin() * y).mean()


class ParallelRun:
    """The 4-rank side: this rank's data slice, the TP shard in, the full output back."""

    def __init__(self, sequence_parallel, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()):
        mesh = cached_mesh((2, 2), ("dp", "tp"))
        self.tp_mesh = mesh["tp"]
        self.dp_rank = mesh["dp"].get_local_rank()
        self.sp = sequence_parallel
        self.reference = reference_model()
        self.model = parallel_model(self.reference, mesh["tp"], mesh["dp"], sequence_parallel, mp_policy)

    def loss(self, x_dp):
        x = shard_replicated(x_dp, mesh=self.tp_mesh, dim=1) if self.sp else x_dp
        y = self.model(x)
        return loss_fn(gather_replicated(y, mesh=self.tp_mesh, dim=1) if self.sp else y)

    def local_batch(self, x):
        return x.chunk(2, dim=0)[self.dp_rank]


def full_grads(model):
    return [p.grad.full_tensor() for p in model.parameters()]


def check_loss_grads_and_step(sequence_parallel):
    run = ParallelRun(sequence_parallel)
    x = inputs()
    expected = loss_fn(run.reference(x))
    expected.backward()
    actual = run.loss(run.local_batch(x))
    actual.backward()
    global_loss = actual.detach().clone()
    dist.all_reduce(global_loss, group=cached_mesh((2, 2), ("dp", "tp"))["dp"].get_group())
    assert_close_to_scale(global_loss / 2, expected, what="loss")
    for grad, ref in zip(full_grads(run.model), [p.grad for p in run.reference.parameters()]):
        assert_close_to_scale(grad, ref, what="grad")

    ref_opt = torch.optim.AdamW(run.reference.parameters(), lr=1e-2)
    par_opt = torch.optim.AdamW(run.model.parameters(), lr=1e-2)
    ref_opt.step()
    par_opt.step()
    for p, ref in zip(run.model.parameters(), run.reference.parameters()):
        assert_close_to_scale(p.full_tensor(), ref, what="weight after step")
    return True


def check_gradient_accumulation(sequence_parallel):
    run = ParallelRun(sequence_parallel)
    x = inputs()
    loss_fn(run.reference(x)).backward()
    local = run.local_batch(x)
    for index, micro in enumerate(local.chunk(2, dim=0)):
        run.model.set_requires_gradient_sync(index == 1)
        (run.loss(micro) / 2).backward()
    for grad, ref in zip(full_grads(run.model), [p.grad for p in run.reference.parameters()]):
        assert_close_to_scale(grad, ref, what="accumulated grad")
    return True


def check_mixed_precision(sequence_parallel):
    """bf16 parameters in forward/backward, fp32 gradient reduction: the loss is bf16, the
    gradients and the sharded master weights stay fp32; all within bf16 tolerance of fp32."""
    run = ParallelRun(sequence_parallel, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = inputs()
    expected = loss_fn(run.reference(x))
    expected.backward()
    actual = run.loss(run.local_batch(x))
    actual.backward()
    assert actual.dtype == torch.bfloat16
    global_loss = actual.detach().float()
    dist.all_reduce(global_loss, group=cached_mesh((2, 2), ("dp", "tp"))["dp"].get_group())
    assert_close_to_scale(global_loss / 2, expected, torch.bfloat16, "loss")
    reference_grads = [p.grad for p in run.reference.parameters()]
    for p, grad, ref in zip(run.model.parameters(), full_grads(run.model), reference_grads):
        assert p.dtype == grad.dtype == torch.float32
        assert_close_to_scale(grad, ref, torch.bfloat16, "grad")
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_loss_gradients_and_optimizer_step_match_one_process(world4, sequence_parallel):
    assert all(world4.run(check_loss_grads_and_step, sequence_parallel))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_gradient_accumulation_matches_one_big_batch(world4, sequence_parallel):
    assert all(world4.run(check_gradient_accumulation, sequence_parallel))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_mixed_precision_bf16_params_fp32_reduce(world4, sequence_parallel):
    assert all(world4.run(check_mixed_precision, sequence_parallel))
