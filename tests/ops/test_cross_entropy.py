"""tdx::vocab_parallel_cross_entropy against F.cross_entropy on the full vocabulary."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchdist_ext
from torchdist_ext.cpu_isa import use_cpu_isa
from torchdist_ext.ops import vocab_parallel_cross_entropy_fwd
from torchdist_ext.testing import cached_mesh, shard_replicated

IGNORE = -100
# Against F.cross_entropy in float64. fp32: the kernels' bound for a 64-token vocabulary
# (tests/cpp/error_bounds.h: sumexp within ~60 u relative, each gradient element within
# (8 + |x - lse|) u of g e^(x - lse), plus the lse's error through e^(x - lse)) stays below
# 1e-5 relative (~170 u). 16-bit: the logits' and loss's own rounding (2^-8, 2^-11) dominates.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def problem(vocab, dtype, shape=(3, 5), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=gen, dtype=torch.float64)).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target[0, 1] = IGNORE
    target.view(-1)[-1] = vocab - 1  # a target in the last shard
    return logits, target


def shard_args(logits):
    n, r = dist.get_world_size(), dist.get_rank()
    vocab_local = logits.shape[-1] // n
    return logits.chunk(n, dim=-1)[r].contiguous(), r * vocab_local


def check_against_full_vocab(vocab, dtype, isa):
    with use_cpu_isa(isa):
        return _check_against_full_vocab(vocab, dtype)


def _check_against_full_vocab(vocab, dtype):
    logits_full, target = problem(vocab, dtype)
    local, start = shard_args(logits_full)
    local.requires_grad_(True)
    loss, lse = vocab_parallel_cross_entropy_fwd(local, target, start, vocab, IGNORE, dist.group.WORLD.group_name)
    upstream = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape).to(dtype)
    loss.backward(upstream)

    reference = logits_full.double().requires_grad_(True)
    ref_loss = F.cross_entropy(reference.flatten(0, -2), target.flatten(), ignore_index=IGNORE, reduction="none")
    ref_loss.view(loss.shape).backward(upstream.double())
    tol = TOLERANCE[dtype]
    assert loss.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(loss.double(), ref_loss.view(loss.shape).detach(), atol=tol * 10, rtol=tol)
    kept = target != IGNORE
    torch.testing.assert_close(lse.double()[kept], reference.detach().logsumexp(-1)[kept], atol=tol * 10, rtol=tol)
    ref_grad = reference.grad.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()]
    torch.testing.assert_close(local.grad.double(), ref_grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_matches_full_vocab_cross_entropy(world, dtype, cpu_isa, request):
    request.getfixturevalue(world).run(check_against_full_vocab, 64, dtype, cpu_isa)


def check_masked_and_nan_logits(isa):
    """-inf (masked) logits count for nothing, even when they fill rank 0's whole shard and
    more than one kernel block (2048 columns); a NaN logit makes its row's loss and gradient NaN.
    An ignored row has loss 0 and gradient exactly 0 even when its logits are all -inf or hold
    a NaN (where F.cross_entropy's gradient is NaN): an ignored row never poisons the weights."""
    vocab = 8192
    gen = torch.Generator().manual_seed(0)
    logits_full = 3 * torch.randn(5, vocab, generator=gen)
    logits_full[0, :5000] = float("-inf")
    logits_full[1, 300] = float("nan")
    logits_full[3] = float("-inf")
    logits_full[4, 7000] = float("nan")
    target = torch.tensor([6000, 7, vocab - 1, IGNORE, IGNORE])
    local, start = shard_args(logits_full)
    local.requires_grad_(True)
    with use_cpu_isa(isa):
        loss, _ = vocab_parallel_cross_entropy_fwd(local, target, start, vocab, IGNORE, dist.group.WORLD.group_name)
        loss.sum().backward()
    reference = logits_full[:3].double().requires_grad_(True)
    ref_loss = F.cross_entropy(reference, target[:3], ignore_index=IGNORE, reduction="none")
    ref_loss.sum().backward()
    torch.testing.assert_close(loss[:3].double(), ref_loss.detach(), atol=1e-5, rtol=1e-5, equal_nan=True)
    ref_grad = reference.grad.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()]
    torch.testing.assert_close(local.grad[:3].double(), ref_grad, atol=1e-6, rtol=1e-5, equal_nan=True)
    assert loss[1].isnan() and loss[0].isfinite()
    assert loss[3:].eq(0).all() and local.grad[3:].eq(0).all()
    return True


def test_masked_and_nan_logits(world2, cpu_isa):
    assert world2.run(check_masked_and_nan_logits, cpu_isa) == [True, True]


def sharded_loss(logits_full, target):
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    local = shard_replicated(logits_full, mesh=mesh, dim=-1)
    start = mesh.get_local_rank() * local.shape[-1]
    name = mesh.get_group().group_name
    loss, _ = vocab_parallel_cross_entropy_fwd(local, target, start, logits_full.shape[-1], IGNORE, name)
    return loss


def run_gradcheck():
    logits, target = problem(8, torch.float64, shape=(2, 3))
    assert torch.autograd.gradcheck(sharded_loss, (logits.requires_grad_(True), target))
    return True


def test_gradcheck_fp64(world2):
    assert world2.run(run_gradcheck) == [True, True]


def run_opcheck():
    name = dist.group.WORLD.group_name
    for requires_grad in (False, True):
        logits_full, target = problem(16, torch.float32)
        local, start = shard_args(logits_full)
        local.requires_grad_(requires_grad)
        for inplace_backward in (False, True):
            torch.library.opcheck(
                torch.ops.tdx.vocab_parallel_cross_entropy_fwd, (local, target, start, 16, IGNORE, name, inplace_backward)
            )
        _, lse = vocab_parallel_cross_entropy_fwd(local.detach(), target, start, 16, IGNORE, name)
        torch.library.opcheck(
            torch.ops.tdx.vocab_parallel_cross_entropy_bwd,
            (torch.ones(target.shape), local.detach(), target, lse, start, IGNORE),
        )
        torch.library.opcheck(
            torch.ops.tdx.vocab_parallel_cross_entropy_bwd_,
            (torch.ones(target.shape), local.detach().clone(), target, lse, start, IGNORE),
        )
    return True


def test_opcheck(world2):
    assert world2.run(run_opcheck) == [True, True]


def run_compiled(inplace_backward):
    logits_full, target = problem(16, torch.float32)
    local, start = shard_args(logits_full)
    name = dist.group.WORLD.group_name

    def mean_loss(x):
        loss, _ = vocab_parallel_cross_entropy_fwd(x * 2.0, target, start, 16, IGNORE, name, inplace_backward)
        return loss.sum() / (target != IGNORE).sum()

    eager_x = local.clone().requires_grad_(True)
    eager = mean_loss(eager_x)
    eager.backward()
    compiled_x = local.clone().requires_grad_(True)
    compiled = torch.compile(mean_loss, fullgraph=True)(compiled_x)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)
    return True


@pytest.mark.parametrize("inplace_backward", [False, True], ids=["out_of_place", "inplace_backward"])
def test_compile_fullgraph(world2, inplace_backward):
    assert world2.run(run_compiled, inplace_backward) == [True, True]


def check_inplace_backward(dtype):
    """The gradient written over the logits: the LM head's gradients match the out-of-place
    backward exactly, and the logits buffer ends up holding its own gradient."""
    logits_full, target = problem(64, dtype)
    local, start = shard_args(logits_full)
    name = dist.group.WORLD.group_name
    results = {}
    for inplace in (False, True):
        hidden = torch.linspace(-1, 1, 3 * 5 * 8).view(3, 5, 8).to(dtype).requires_grad_(True)
        head = torch.linspace(-2, 2, local.shape[-1] * 8).view(local.shape[-1], 8).to(dtype).requires_grad_(True)
        logits = hidden @ head.t() + local  # the LM head's output, used by nothing else
        loss, _ = vocab_parallel_cross_entropy_fwd(logits, target, start, 64, IGNORE, name, inplace)
        upstream = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape).to(dtype)
        saved = logits.detach()
        loss.backward(upstream)
        results[inplace] = (hidden.grad, head.grad, saved.clone())
    logits = results[False][2]  # untouched by the out-of-place backward
    _, lse = vocab_parallel_cross_entropy_fwd(logits, target, start, 64, IGNORE, name)
    grad_logits = torch.ops.tdx.vocab_parallel_cross_entropy_bwd(upstream, logits, target, lse, start, IGNORE)
    torch.testing.assert_close(results[True][0], results[False][0], atol=0, rtol=0)
    torch.testing.assert_close(results[True][1], results[False][1], atol=0, rtol=0)
    torch.testing.assert_close(results[True][2], grad_logits, atol=0, rtol=0)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward(world2, dtype):
    assert world2.run(check_inplace_backward, dtype) == [True, True]


def inplace_backward_with_another_consumer():
    logits_full, target = problem(16, torch.float32)
    local, start = shard_args(logits_full)
    logits = (local * 1.0).requires_grad_(True) * 2.0
    penalty = logits.square().sum()  # saves logits for its backward, which runs after the loss's
    loss, _ = vocab_parallel_cross_entropy_fwd(logits, target, start, 16, IGNORE, dist.group.WORLD.group_name, True)
    (penalty + loss.sum()).backward()


def test_inplace_backward_fails_loudly_when_logits_are_needed_again(world2):
    with pytest.raises(Exception, match="modified by an inplace operation"):
        world2.run(inplace_backward_with_another_consumer)


def out_of_range_target():
    logits_full, target = problem(16, torch.float32)
    local, start = shard_args(logits_full)
    target[0, 0] = 16
    vocab_parallel_cross_entropy_fwd(local, target, start, 16, IGNORE, dist.group.WORLD.group_name)


def mismatched_target_shape():
    logits_full, target = problem(16, torch.float32)
    local, start = shard_args(logits_full)
    vocab_parallel_cross_entropy_fwd(local, target[:, :2], start, 16, IGNORE, dist.group.WORLD.group_name)


def shard_outside_vocab():
    logits_full, target = problem(16, torch.float32)
    local, _ = shard_args(logits_full)
    vocab_parallel_cross_entropy_fwd(local, target, 12, 16, IGNORE, dist.group.WORLD.group_name)


@pytest.mark.parametrize(
    "fn, error, message",
    [
        (out_of_range_target, ValueError,
         r"every target must lie in \[0, vocab_size=16\) or equal ignore_index=-100; target \(flattened\) \[0\] = 16"),
        (mismatched_target_shape, RuntimeError, "must equal logits shape without its last dim"),
        (shard_outside_vocab, RuntimeError, r"must lie inside \[0, vocab_size=16\)"),
    ],
)
def test_bad_input(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)


def out_of_range_targets_without_checks():
    """Index checks off: a bad target's row gets a NaN loss and gradient on every rank; the others are exact."""
    logits_full, target = problem(16, torch.float32)
    target[0, 0], target[1, 2] = 16, -3
    local, start = shard_args(logits_full)
    local.requires_grad_(True)
    previous = torchdist_ext.set_index_checks(False)
    try:
        loss, lse = vocab_parallel_cross_entropy_fwd(local, target, start, 16, IGNORE, dist.group.WORLD.group_name)
    finally:
        torchdist_ext.set_index_checks(previous)
    loss.sum().backward()
    bad = torch.zeros_like(target, dtype=torch.bool)
    bad[0, 0] = bad[1, 2] = True
    assert loss[bad].isnan().all() and lse[bad].isnan().all() and local.grad[bad].isnan().all()
    assert loss[~bad].isfinite().all() and local.grad[~bad].isfinite().all()
    good_target = target.masked_fill(bad, IGNORE)
    expected = F.cross_entropy(logits_full.flatten(0, -2), good_target.flatten(), ignore_index=IGNORE,
                               reduction="none").view(loss.shape)
    torch.testing.assert_close(loss[~bad], expected[~bad], atol=1e-5, rtol=1e-5)
    return True


def test_out_of_range_targets_give_nan_rows_without_index_checks(world2):
    assert world2.run(out_of_range_targets_without_checks) == [True, True]
