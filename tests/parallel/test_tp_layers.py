"""Tensor-parallel layers against single-process nn.Linear / nn.Embedding / F.cross_entropy.

Every rank builds the same full reference modules and inputs (fixed seeds), the
parallel layers are made from them with from_linear / from_embedding, and the
forward output, the input gradient and every parameter gradient (full_tensor())
are compared with the single-process results.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchdist_ext  # noqa: F401
from tests.numerics import assert_close_to_scale
from torchdist_ext.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from torchdist_ext.testing import cached_mesh, gather_replicated, shard_replicated

BATCH, SEQ, HIDDEN, FFN, VOCAB = 2, 8, 16, 32, 64


def tp_mesh():
    return cached_mesh((dist.get_world_size(),), ("tp",))


def seeded(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def into_region(x_full, sequence_parallel, mesh, seq_dim=1):
    return shard_replicated(x_full, mesh=mesh, dim=seq_dim) if sequence_parallel else x_full


def out_of_region(y, sequence_parallel, mesh, seq_dim=1):
    return gather_replicated(y, mesh=mesh, dim=seq_dim) if sequence_parallel else y


def check_mlp(sequence_parallel, bias, dtype, shape=(BATCH, SEQ, HIDDEN), seq_dim=1):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(HIDDEN, FFN, bias=bias), nn.GELU(), nn.Linear(FFN, HIDDEN, bias=bias))
    reference = reference.to(dtype)
    mesh = tp_mesh()
    sp = dict(sequence_parallel=sequence_parallel, seq_dim=seq_dim)
    parallel = nn.Sequential(
        ColumnParallelLinear.from_linear(reference[0], tp_mesh=mesh, **sp),
        nn.GELU(),
        RowParallelLinear.from_linear(reference[2], tp_mesh=mesh, **sp),
    )
    x_ref = seeded(1, *shape, dtype=dtype).requires_grad_(True)
    x_par = x_ref.detach().clone().requires_grad_(True)
    upstream = seeded(2, *shape, dtype=dtype)

    # The reference runs in fp32 on the same (possibly bf16-rounded) values.
    expected = reference.float()(x_ref.float())
    expected.backward(upstream.float())
    actual = out_of_region(parallel(into_region(x_par, sequence_parallel, mesh, seq_dim)), sequence_parallel, mesh,
                           seq_dim)
    actual.backward(upstream)

    assert actual.dtype == dtype
    assert_close_to_scale(actual, expected, dtype, "output")
    assert_close_to_scale(x_par.grad, x_ref.grad, dtype, "input grad")
    for (name, p_par), p_ref in zip(parallel.named_parameters(), reference.parameters()):
        assert_close_to_scale(p_par.grad.full_tensor(), p_ref.grad, dtype, f"{name} grad")
    return True


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_mlp_fp32(world, sequence_parallel, bias, request):
    assert all(request.getfixturevalue(world).run(check_mlp, sequence_parallel, bias, torch.float32))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_mlp_bf16(world2, sequence_parallel):
    assert all(world2.run(check_mlp, sequence_parallel, True, torch.bfloat16))


# Megatron's [seq, batch, hidden], a negative seq_dim, flattened tokens, and an extra leading dim.
SEQUENCE_SHAPES = {
    "SBH-dim0": ((SEQ, BATCH, HIDDEN), 0),
    "BSH-dim-2": ((BATCH, SEQ, HIDDEN), -2),
    "SH-dim0": ((SEQ, HIDDEN), 0),
    "BXSH-dim2": ((BATCH, 3, SEQ, HIDDEN), 2),
}


@pytest.mark.parametrize("shape_name", list(SEQUENCE_SHAPES))
def test_mlp_sequence_dim_shapes(world2, shape_name):
    shape, seq_dim = SEQUENCE_SHAPES[shape_name]
    assert all(world2.run(check_mlp, True, True, torch.float32, shape, seq_dim))


def check_unfused_entries_and_exits(bias):
    """gather_output on the column layer and a full (not parallel) input to the row layer."""
    torch.manual_seed(0)
    first, second = nn.Linear(HIDDEN, FFN, bias=bias), nn.Linear(FFN, HIDDEN, bias=bias)
    mesh = tp_mesh()
    column = ColumnParallelLinear.from_linear(first, tp_mesh=mesh, gather_output=True)
    row = RowParallelLinear.from_linear(second, tp_mesh=mesh, input_is_parallel=False)
    x_ref = seeded(1, BATCH, SEQ, HIDDEN).requires_grad_(True)
    x_par = x_ref.detach().clone().requires_grad_(True)
    expected = second(torch.tanh(first(x_ref)))
    actual = row(torch.tanh(column(x_par)))
    upstream = seeded(2, BATCH, SEQ, HIDDEN)
    expected.backward(upstream)
    actual.backward(upstream)
    assert_close_to_scale(actual, expected, what="output")
    assert_close_to_scale(x_par.grad, x_ref.grad, what="input grad")
    for p_par, p_ref in zip([*column.parameters(), *row.parameters()], [*first.parameters(), *second.parameters()]):
        assert_close_to_scale(p_par.grad.full_tensor(), p_ref.grad, what="param grad")
    return True


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gather_output_and_full_row_input(world4, bias):
    assert all(world4.run(check_unfused_entries_and_exits, bias))


def check_embedding_and_loss(sequence_parallel, dtype):
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, HIDDEN).to(dtype)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    mesh = tp_mesh()
    par_embedding = VocabParallelEmbedding.from_embedding(embedding, tp_mesh=mesh, sequence_parallel=sequence_parallel)
    par_head = ColumnParallelLinear.from_linear(head, tp_mesh=mesh, sequence_parallel=sequence_parallel)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target[0, :3] = -100

    expected = F.cross_entropy(head.float()(torch.sin(embedding.float()(ids))).flatten(0, 1), target.flatten())
    expected.backward()
    hidden = torch.sin(par_embedding(ids))
    assert hidden.shape == (BATCH, SEQ // mesh.size() if sequence_parallel else SEQ, HIDDEN)
    actual = vocab_parallel_cross_entropy(par_head(hidden), target, tp_mesh=mesh)
    actual.backward()

    assert_close_to_scale(actual, expected, dtype, "loss")
    assert_close_to_scale(par_embedding.weight.grad.full_tensor(), embedding.weight.grad, dtype, "embedding grad")
    assert_close_to_scale(par_head.weight.grad.full_tensor(), head.weight.grad, dtype, "head grad")
    return True


@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_embedding_head_and_loss_fp32(world, sequence_parallel, request):
    assert all(request.getfixturevalue(world).run(check_embedding_and_loss, sequence_parallel, torch.float32))


def test_embedding_head_and_loss_bf16(world2):
    assert all(world2.run(check_embedding_and_loss, True, torch.bfloat16))


def check_embedding_padding_idx(padding_idx):
    """nn.Embedding's padding row: zero output row from a fresh layer, no gradient, on whichever rank holds it."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx)
    mesh = tp_mesh()
    parallel = VocabParallelEmbedding.from_embedding(embedding, tp_mesh=mesh)
    fresh = VocabParallelEmbedding(VOCAB, HIDDEN, tp_mesh=mesh, padding_idx=padding_idx)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    padding_row = embedding.padding_idx  # non-negative
    ids[:, :2] = padding_row
    upstream = seeded(4, BATCH, SEQ, HIDDEN)
    embedding(ids).backward(upstream)
    actual = parallel(ids)
    actual.backward(upstream)
    assert_close_to_scale(actual, embedding(ids), what="output")
    grad = parallel.weight.grad.full_tensor()
    assert_close_to_scale(grad, embedding.weight.grad, what="weight grad")
    assert grad[padding_row].abs().max() == 0
    assert fresh.weight.full_tensor()[padding_row].abs().max() == 0
    assert fresh(ids)[:, :2].abs().max() == 0
    return True


# The padding row in the first rank's rows, and in the last rank's (given as a negative index).
@pytest.mark.parametrize("padding_idx", [0, -1], ids=["first-shard", "last-shard-negative"])
def test_embedding_padding_idx(world2, padding_idx):
    assert all(world2.run(check_embedding_padding_idx, padding_idx))


def check_loss_reductions():
    mesh = tp_mesh()
    logits_full = seeded(4, BATCH, SEQ, VOCAB)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    target[1, 2] = 7  # a custom ignore_index below
    local = logits_full.chunk(mesh.size(), dim=-1)[mesh.get_local_rank()]
    for reduction in ("mean", "sum", "none"):
        expected = F.cross_entropy(logits_full.transpose(1, 2), target, ignore_index=7, reduction=reduction)
        actual = vocab_parallel_cross_entropy(local, target, tp_mesh=mesh, ignore_index=7, reduction=reduction)
        assert_close_to_scale(actual, expected, what=reduction)
    return True


def test_loss_reductions_and_ignore_index(world2):
    assert all(world2.run(check_loss_reductions))
