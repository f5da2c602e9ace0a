"""Every op's fake (meta) implementation makes the same argument checks as its C++ implementation.

Each case is run twice: on CPU tensors (the C++ op) and on meta tensors (the fake, what
torch.compile traces with); both must raise the same exception type with the same rule.
"""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401

tdx = torch.ops.tdx


def group():
    return dist.group.WORLD.group_name


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def ring_q_not_4d():
    return tdx.ring_attention_fwd, (randn(2, 4, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 8), group(), False, 0.5,
                                    "zigzag")


def ring_kv_length_mismatch():
    return tdx.ring_attention_fwd, (randn(1, 2, 4, 8), randn(1, 2, 6, 8), randn(1, 2, 6, 8), group(), False, 0.5,
                                    "zigzag")


def ring_heads_do_not_divide():
    return tdx.ring_attention_fwd, (randn(1, 3, 4, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 8), group(), False, 0.5,
                                    "zigzag")


def ring_bad_order():
    return tdx.ring_attention_fwd, (randn(1, 2, 4, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 8), group(), False, 0.5,
                                    "striped")


def ring_odd_zigzag():
    return tdx.ring_attention_fwd, (randn(1, 2, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8), group(), False, 0.5,
                                    "zigzag")


def ring_bwd_lse_shape():
    q = randn(1, 2, 4, 8)
    return tdx.ring_attention_bwd, (q, q, q, q, q, randn(1, 2, 3), group(), False, 0.5, "zigzag")


def ring_document_ids_float():
    q = randn(1, 2, 4, 8)
    return tdx.ring_attention_fwd, (q, q, q, group(), True, 0.5, "zigzag", randn(1, 4))


def ring_document_ids_shape():
    q = randn(1, 2, 4, 8)
    return tdx.ring_attention_fwd, (q, q, q, group(), True, 0.5, "zigzag", torch.zeros(1, 6, dtype=torch.long))


def ring_positions_with_zigzag():
    q = randn(1, 2, 4, 8)
    return tdx.ring_attention_fwd, (q, q, q, group(), True, 0.5, "zigzag", None, torch.zeros(1, 4, dtype=torch.long))


def document_attention_positions_float():
    q = randn(1, 2, 4, 8)
    return tdx.document_attention_fwd, (q, q, q, torch.zeros(1, 4, dtype=torch.long), True, 0.5, randn(1, 4))


def document_attention_ids_shape():
    q = randn(2, 2, 4, 8)
    return tdx.document_attention_fwd, (q, q, q, torch.zeros(1, 4, dtype=torch.long), True, 0.5)


def document_attention_bwd_lse_shape():
    q = randn(1, 2, 4, 8)
    return tdx.document_attention_bwd, (q, q, q, q, q, randn(1, 2, 3), torch.zeros(1, 4, dtype=torch.long), True, 0.5)


def merge_block_shape():
    return tdx.lse_merge_, (randn(2, 4, 8), randn(2, 4), randn(2, 4, 7), randn(2, 4))


def merge_accumulator_dtype():
    return tdx.lse_merge_, (randn(2, 4, 8, dtype=torch.float64), randn(2, 4), randn(2, 4, 8), randn(2, 4))


def merge_strided_block():
    return tdx.lse_merge_, (randn(2, 4, 8), randn(2, 4), randn(2, 8, 4).transpose(1, 2), randn(2, 4))


def matmul_in_features():
    return tdx.all_gather_matmul, (randn(2, 4, 8), randn(16, 7), group(), 1)


def matmul_feature_dim_sharded():
    return tdx.all_gather_matmul, (randn(2, 4, 8), randn(16, 8), group(), 2)


def matmul_dtypes():
    return tdx.all_gather_matmul, (randn(2, 4, 8), randn(16, 8, dtype=torch.float64), group(), 1)


def reduce_scatter_not_divisible():
    return tdx.matmul_reduce_scatter, (randn(2, 5, 8), randn(16, 8), group(), 1)


def weight_grad_dense_shape():
    return tdx.all_gather_weight_grad, (randn(2, 6, 8), randn(2, 4, 16), group(), 1)


def cross_entropy_target_shape():
    return tdx.vocab_parallel_cross_entropy_fwd, (randn(3, 8), torch.zeros(4, dtype=torch.long), 0, 16, -100,
                                                  group())


def cross_entropy_target_dtype():
    return tdx.vocab_parallel_cross_entropy_fwd, (randn(3, 8), torch.zeros(3, dtype=torch.int32), 0, 16, -100,
                                                  group())


def cross_entropy_shard_outside():
    return tdx.vocab_parallel_cross_entropy_fwd, (randn(3, 8), torch.zeros(3, dtype=torch.long), 12, 16, -100,
                                                  group())


def cross_entropy_bwd_lse_dtype():
    return tdx.vocab_parallel_cross_entropy_bwd, (randn(3), randn(3, 8), torch.zeros(3, dtype=torch.long),
                                                  randn(3, dtype=torch.float64), 0, -100)


def ulysses_heads_do_not_divide():
    return tdx.all_to_all_seq_to_heads, (randn(1, 3, 4, 8), group(), "contiguous")


def ulysses_odd_zigzag():
    return tdx.all_to_all_seq_to_heads, (randn(1, 2, 3, 8), group(), "zigzag")


def ulysses_sequence_does_not_divide():
    return tdx.all_to_all_heads_to_seq, (randn(1, 2, 6, 8), group(), "zigzag")


def grouped_mm_tokens_per_expert_length():
    return tdx.moe_grouped_mm, (randn(5, 8), randn(3, 4, 8), torch.tensor([2, 3]))


def unpermute_int32_positions():
    return tdx.moe_unpermute, (randn(4, 8), torch.zeros(3, 2, dtype=torch.int32), None)


CASES = [
    (ring_q_not_4d, RuntimeError, r"q, k, v must be \[batch, heads, seq, head_dim\]"),
    (ring_kv_length_mismatch, RuntimeError, "must agree in batch, local sequence and head_dim"),
    (ring_heads_do_not_divide, RuntimeError, r"q heads \(3\) must be a positive multiple of kv heads \(2\)"),
    (ring_bad_order, ValueError, "order must be 'contiguous' or 'zigzag'"),
    (ring_document_ids_float, TypeError, "document_ids must be an integer tensor"),
    (ring_document_ids_shape, RuntimeError, r"document_ids \[1, 6\] must be \[batch, seq_local\] = \[1, 4\]"),
    (ring_positions_with_zigzag, ValueError, "with positions the order must be 'contiguous'"),
    (document_attention_positions_float, TypeError, "positions must be an integer tensor"),
    (document_attention_ids_shape, RuntimeError, r"document_ids \[1, 4\] must be \[batch, seq_local\] = \[2, 4\]"),
    (document_attention_bwd_lse_shape, RuntimeError, r"lse .* must be \[batch, q heads, seq\]"),
    (ring_odd_zigzag, RuntimeError, "the zigzag order needs an even local sequence"),
    (ring_bwd_lse_shape, RuntimeError, r"must be \[batch, q heads, seq\]"),
    (merge_block_shape, RuntimeError, "block_out .* and block_lse .* must match out"),
    (merge_accumulator_dtype, TypeError, "out, lse and block_lse must be"),
    (merge_strided_block, RuntimeError, "block_out and block_lse must be contiguous"),
    (matmul_in_features, RuntimeError, r"x.size\(-1\)=8 must equal weight.size\(1\)=7"),
    (matmul_feature_dim_sharded, RuntimeError, "the sharded dim must not be the feature"),
    (matmul_dtypes, RuntimeError, "x and weight must have the same dtype"),
    (reduce_scatter_not_divisible, RuntimeError, r"x.size\(1\)=5 must be divisible by the group size 2"),
    (weight_grad_dense_shape, RuntimeError, r"dense.size\(1\)=6 must be 8"),
    (cross_entropy_target_shape, RuntimeError, "must equal logits shape without its last dim"),
    (cross_entropy_target_dtype, TypeError, "target must be int64"),
    (cross_entropy_shard_outside, RuntimeError, r"must lie inside \[0, vocab_size=16\)"),
    (cross_entropy_bwd_lse_dtype, TypeError, "lse must be"),
    (ulysses_heads_do_not_divide, RuntimeError, r"heads \(3\) must be divisible by the group size 2"),
    (ulysses_odd_zigzag, RuntimeError, "the zigzag order needs an even local sequence"),
    (ulysses_sequence_does_not_divide, RuntimeError, r"seq \(6\) must be divisible by 4"),
    (grouped_mm_tokens_per_expert_length, RuntimeError, r"tokens_per_expert must be a host int64 \[experts=3\]"),
    (unpermute_int32_positions, TypeError, "positions must be int64, got"),
]


def real_and_fake_raise(case, error, message):
    import re

    op, args = case()
    outcomes = []
    for device in ("cpu", "meta"):
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        try:
            op(*moved)
        except Exception as raised:  # noqa: BLE001 - the type is what is checked
            outcomes.append((device, type(raised).__name__, bool(re.search(message, str(raised)))))
            continue
        outcomes.append((device, "no error", False))
    return outcomes


@pytest.mark.parametrize("case, error, message", CASES, ids=[c[0].__name__ for c in CASES])
def test_fake_checks_what_the_op_checks(world2, case, error, message):
    for outcomes in world2.run(real_and_fake_raise, case, error, message):
        assert outcomes == [("cpu", error.__name__, True), ("meta", error.__name__, True)], outcomes
