"""Bad arguments and inputs raise ValueError / TypeError naming the argument, the value and the rule; nothing hangs."""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext.parallel import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    hybrid_attention,
    ring_attention,
    ulysses_attention,
    unshard_sequence,
    vocab_parallel_cross_entropy,
)
from torchdist_ext.testing import cached_mesh
from torch.distributed.device_mesh import DeviceMesh


def tp():
    return cached_mesh((dist.get_world_size(),), ("tp",))


def out_features_not_divisible():
    ColumnParallelLinear(16, 31, tp_mesh=tp())


def in_features_not_divisible():
    RowParallelLinear(31, 16, tp_mesh=tp())


def vocab_not_divisible():
    VocabParallelEmbedding(31, 8, tp_mesh=tp())


def embedding_with_max_norm():
    VocabParallelEmbedding.from_embedding(torch.nn.Embedding(32, 8, max_norm=1.0), tp_mesh=tp())


def padding_idx_out_of_range():
    VocabParallelEmbedding(32, 8, tp_mesh=tp(), padding_idx=32)


def mesh_not_1d():
    ColumnParallelLinear(16, 16, tp_mesh=cached_mesh((1, dist.get_world_size()), ("dp", "tp")))


def mesh_not_a_mesh():
    RowParallelLinear(16, 16, tp_mesh=dist.group.WORLD)


def nonpositive_features():
    ColumnParallelLinear(0, 16, tp_mesh=tp())


def sequence_not_divisible_row():
    RowParallelLinear(16, 8, tp_mesh=tp(), sequence_parallel=True)(torch.randn(2, 3, 8))


def sequence_not_divisible_embedding():
    VocabParallelEmbedding(32, 8, tp_mesh=tp(), sequence_parallel=True)(torch.zeros(2, 5, dtype=torch.long))


def seq_dim_is_feature_dim():
    ColumnParallelLinear(8, 16, tp_mesh=tp(), sequence_parallel=True, seq_dim=2)(torch.randn(2, 4, 8))


def last_dim_mismatch_column():
    ColumnParallelLinear(8, 16, tp_mesh=tp())(torch.randn(2, 4, 7))


def last_dim_mismatch_row():
    RowParallelLinear(16, 8, tp_mesh=tp())(torch.randn(2, 4, 16))  # expects in/tp = 8


def mixed_dtypes():
    ColumnParallelLinear(8, 16, tp_mesh=tp())(torch.randn(2, 4, 8, dtype=torch.float64))


def norm_dtype():
    RMSNorm(8, tp_mesh=tp())(torch.randn(2, 8, dtype=torch.bfloat16))


def embedding_float_ids():
    VocabParallelEmbedding(32, 8, tp_mesh=tp())(torch.zeros(2, 4))


def loss_target_shape():
    vocab_parallel_cross_entropy(torch.randn(2, 4, 8), torch.zeros(2, 5, dtype=torch.long), tp_mesh=tp())


def loss_target_dtype():
    vocab_parallel_cross_entropy(torch.randn(2, 4, 8), torch.zeros(2, 4, dtype=torch.int32), tp_mesh=tp())


def loss_reduction():
    vocab_parallel_cross_entropy(torch.randn(2, 4, 8), torch.zeros(2, 4, dtype=torch.long), tp_mesh=tp(),
                                 reduction="avg")


def integer_dtype_linear():
    ColumnParallelLinear(8, 16, tp_mesh=tp(), dtype=torch.int64)


def embedding_id_out_of_range():
    VocabParallelEmbedding(32, 8, tp_mesh=tp())(torch.tensor([[3, 32], [0, -1]]))


def unshard_odd_zigzag():
    unshard_sequence(torch.randn(2, 3, 4), cp_mesh=tp(), dim=1)


def unshard_a_list():
    unshard_sequence([torch.randn(2, 4)], cp_mesh=tp(), dim=1)


def attention_without_heads():
    q = torch.randn(1, 0, 4, 8)
    ring_attention(q, q, q, cp_mesh=tp())


def hybrid_on_a_1d_mesh():
    q = torch.randn(1, 2, 4, 8)
    hybrid_attention(q, q, q, cp_mesh=tp())


def hybrid_on_a_3d_mesh():
    q = torch.randn(1, 2, 4, 8)
    hybrid_attention(q, q, q, cp_mesh=cached_mesh((1, 1, dist.get_world_size()), ("a", "b", "c")))


CASES = [
    (out_features_not_divisible, ValueError, "out_features=31 must be divisible by the tensor-parallel size 2"),
    (in_features_not_divisible, ValueError, "in_features=31 must be divisible by the tensor-parallel size 2"),
    (vocab_not_divisible, ValueError, "num_embeddings=31 must be divisible by the tensor-parallel size 2"),
    (embedding_with_max_norm, ValueError, "embedding.max_norm=1.0 is not supported by VocabParallelEmbedding"),
    (padding_idx_out_of_range, ValueError, r"padding_idx must be an int in \[-num_embeddings, num_embeddings\) = "
     r"\[-32, 32\), got 32"),
    (mesh_not_1d, ValueError, r"tp_mesh must be a 1-D DeviceMesh .* got a 2-D mesh of shape \(1, 2\)"),
    (mesh_not_a_mesh, TypeError, "tp_mesh must be a torch.distributed DeviceMesh, got ProcessGroup"),
    (nonpositive_features, ValueError, "in_features must be a positive int, got 0"),
    (sequence_not_divisible_row, ValueError, r"input.size\(1\)=3 must be divisible by the tensor-parallel size 2"),
    (sequence_not_divisible_embedding, ValueError, r"input.size\(1\)=5 must be divisible by the tensor-parallel size"),
    (seq_dim_is_feature_dim, ValueError, "seq_dim=2 must name one of its dims before the last"),
    (last_dim_mismatch_column, ValueError, r"input has shape \(2, 4, 7\); its last dim must be 8 \(in_features\)"),
    (last_dim_mismatch_row, ValueError, r"its last dim must be 8 \(in_features / tp = 16 / 2\)"),
    (mixed_dtypes, TypeError, "input has dtype torch.float64 but the layer's parameters are torch.float32"),
    (norm_dtype, TypeError, "input has dtype torch.bfloat16"),
    (embedding_float_ids, TypeError, "input must be an int64 or int32 tensor of token ids, got torch.float32"),
    (loss_target_shape, ValueError, r"target has shape \(2, 5\); it must be logits' shape without the vocab dim"),
    (loss_target_dtype, TypeError, "target must be an int64 tensor, got torch.int32"),
    (loss_reduction, ValueError, "reduction must be one of .* got 'avg'"),
    (integer_dtype_linear, TypeError, "dtype must be a floating-point dtype .* got torch.int64"),
    (embedding_id_out_of_range, ValueError,
     r"input ids must lie in \[0, num_embeddings=32\); input \(flattened\)\[1\] = 32"),
    (unshard_odd_zigzag, ValueError, r"x_local.size\(1\)=3 must be divisible by 2: with the zigzag order"),
    (unshard_a_list, TypeError, "x_local must be a torch.Tensor, got list"),
    (attention_without_heads, ValueError, "it needs at least one head and head_dim >= 1"),
    (hybrid_on_a_1d_mesh, ValueError, r"hybrid_attention takes a 2-D cp_mesh \[ring, ulysses\]"),
    (hybrid_on_a_3d_mesh, ValueError, "cp_mesh must be a 1-D or a 2-D"),
]


@pytest.mark.parametrize("fn, error, message", CASES, ids=[case[0].__name__ for case in CASES])
def test_clear_error_on_every_rank(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
    assert world2.alive


def out_of_range_ids_without_index_checks():
    """Index checks off: an id outside the vocabulary gives a NaN row (on every rank), never zeros."""
    embedding = VocabParallelEmbedding(32, 8, tp_mesh=tp())
    previous = torchdist_ext.set_index_checks(False)
    try:
        rows = embedding(torch.tensor([[3, 32], [0, -1]]))
    finally:
        torchdist_ext.set_index_checks(previous)
    assert rows[0, 1].isnan().all() and rows[1, 1].isnan().all()
    assert torch.equal(rows[0, 0], embedding.weight.full_tensor()[3])
    return True


def test_out_of_range_ids_give_nan_rows_without_index_checks(world2):
    assert all(world2.run(out_of_range_ids_without_index_checks))


def bad_id_on_one_rank():
    """Only rank 1's ids (which should be replicated) hold an id outside the vocabulary."""
    embedding = VocabParallelEmbedding(32, 8, tp_mesh=tp())
    ids = torch.tensor([[3, 40 if dist.get_rank() == 1 else 4]])
    try:
        embedding(ids)
    except ValueError as error:
        return str(error)


def float_ids_on_one_rank():
    embedding = VocabParallelEmbedding(32, 8, tp_mesh=tp())
    try:
        embedding(torch.zeros(1, 2, dtype=torch.long if dist.get_rank() == 0 else torch.float32))
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def test_float_ids_on_one_rank_stop_every_rank(world2):
    rank0, rank1 = world2.run(float_ids_on_one_rank)
    assert rank1 == "TypeError: input must be an int64 or int32 tensor of token ids, got torch.float32"
    assert rank0 == ("TypeError: VocabParallelEmbedding: rank 1 of the group refused its input, so every rank "
                     "stops: input must be an int64 or int32 tensor of token ids, got torch.float32")


def test_a_bad_id_on_one_rank_stops_every_rank(world2):
    rank0, rank1 = world2.run(bad_id_on_one_rank)
    assert rank1.startswith("input ids must lie in [0, num_embeddings=32); input (flattened)[1] = 40")
    assert rank0 == f"VocabParallelEmbedding: rank 1 of the group refused its input, so every rank stops: {rank1}"


def context_attention_that_disagrees(function: str, field: str) -> str:
    """Rank 0 (and in the hybrid, every even rank) passes another ``field`` than its Ulysses peer."""
    first = dist.get_rank() % 2 == 0
    value = {"causal": first, "scale": 0.5 if first else 0.25,
             "document_ids": torch.zeros(1, 4, dtype=torch.long) if first else None}[field]
    q = torch.randn(1, 4, 4, 8)
    if function == "ulysses":
        call = lambda: ulysses_attention(q, q, q, cp_mesh=tp(), **{field: value})  # noqa: E731
    else:
        mesh = cached_mesh((2, 2), ("ring", "ulysses"))
        call = lambda: hybrid_attention(q, q, q, cp_mesh=mesh, **{field: value})  # noqa: E731
    try:
        call()
    except ValueError as error:
        return str(error)


@pytest.mark.parametrize("field, values", [("causal", ("True", "False")), ("scale", ("0.5", "0.25")),
                                           ("document_ids", ("torch.int64 (1, 4)", "None"))])
def test_ulysses_ranks_that_disagree_are_refused(world2, field, values):
    for rank, text in enumerate(world2.run(context_attention_that_disagrees, "ulysses", field)):
        mine, theirs = values if rank == 0 else values[::-1]
        assert text.startswith(f"ulysses_attention: the ranks of the group must agree on {field}: rank {rank} has "
                               f"{mine}, rank {1 - rank} has {theirs}"), text


def test_hybrid_ulysses_ranks_that_disagree_are_refused(world4):
    for text in world4.run(context_attention_that_disagrees, "hybrid", "causal"):
        assert text.startswith("hybrid_attention: the ranks of the group must agree on causal"), text


def refused_on_one_rank(function: str) -> str:
    """The last rank passes a v that its k does not match (ring) or, in the hybrid, another causal than its
    Ulysses peer (only the last Ulysses group disagrees); returns what this rank raised."""
    last = dist.get_rank() == dist.get_world_size() - 1
    q = torch.randn(1, 4, 4, 8)
    try:
        if function == "ring":
            ring_attention(q, q, q[..., :4] if last else q, cp_mesh=tp())
        else:
            hybrid_attention(q, q, q, cp_mesh=cached_mesh((2, 2), ("ring", "ulysses")), causal=not last)
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "ran"


def test_a_ring_attention_input_refused_on_one_rank_stops_every_rank(world2):
    """Before the fix the wrapper's checks raised on rank 1 alone and rank 0 waited in the ring."""
    rank0, rank1 = world2.run(refused_on_one_rank, "ring")
    assert rank1 == "ValueError: k (1, 4, 4, 8) and v (1, 4, 4, 4) must have the same shape", rank1
    assert rank0 == f"ValueError: ring_attention: rank 1 of the group refused its input, so every rank stops: " \
                    f"{rank1.removeprefix('ValueError: ')}", rank0


def test_a_hybrid_ulysses_group_that_disagrees_stops_the_other_groups(world4):
    """Ranks 2 and 3 (one Ulysses group) disagree on causal; ranks 0 and 1 agree with each other and, before
    the fix, waited in the ring for ranks 2 and 3. Now every rank raises."""
    texts = world4.run(refused_on_one_rank, "hybrid")
    for text in texts[2:]:
        assert text.startswith("ValueError: hybrid_attention: the ranks of the group must agree on causal"), text
    for text in texts[:2]:
        assert text.startswith("ValueError: hybrid_attention: rank 1 of the group refused its input, so every rank "
                               "stops: hybrid_attention: the ranks of the group must agree on causal"), text


def empty_local_sequence():
    """No tokens on any rank: an empty output and empty gradients, not a crash of the block kernel."""
    q = torch.randn(1, 2, 0, 8, requires_grad=True)
    out = ring_attention(q, q, q, cp_mesh=tp(), causal=True)
    out.sum().backward()
    return out.shape == (1, 2, 0, 8) and q.grad.shape == q.shape


def test_ring_attention_on_an_empty_sequence(world2):
    assert all(world2.run(empty_local_sequence))


def layer_on_a_mesh_without_this_rank():
    mesh = DeviceMesh("cpu", torch.tensor([0]))  # every rank builds it; only rank 0 is in it
    if dist.get_rank() == 0:
        RowParallelLinear(16, 16, tp_mesh=mesh)
        return "built"
    with pytest.raises(ValueError, match=r"tp_mesh .* does not include this process \(global rank 1\)"):
        RowParallelLinear(16, 16, tp_mesh=mesh)
    return "refused"


def test_a_layer_refuses_a_mesh_without_its_rank(world2):
    assert world2.run(layer_on_a_mesh_without_this_rank) == ["built", "refused"]
