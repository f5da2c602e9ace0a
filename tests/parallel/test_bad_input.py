"""Bad arguments and inputs raise ValueError / TypeError naming the argument, the value and the rule; nothing hangs."""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401
from torchdist_ext.parallel import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from torchdist_ext.testing import cached_mesh


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
]


@pytest.mark.parametrize("fn, error, message", CASES, ids=[case[0].__name__ for case in CASES])
def test_clear_error_on_every_rank(world2, fn, error, message):
    with pytest.raises(error, match=message):
        world2.run(fn)
    assert world2.alive
