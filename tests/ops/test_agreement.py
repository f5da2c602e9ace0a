"""With TORCH_DISTRIBUTED_DEBUG=DETAIL the ring and all-to-all exchanges refuse ranks that disagree.

Ranks whose tensors differ in shape (or in a dtype of the same size) but not in bytes would
otherwise exchange and reinterpret each other's data silently.
"""

import pytest
import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401


def disagreeing_exchange(op):
    """Rank 0 and rank 1 pass tensors of equal byte size but different shapes to `op`."""
    name = dist.group.WORLD.group_name
    shape = (1, 2, 4, 8) if dist.get_rank() == 0 else (1, 4, 2, 8)
    x = torch.randn(*shape)
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        if op == "ring_attention":
            torch.ops.tdx.ring_attention_fwd(x, x, x, name, False, 0.5, "contiguous")
        elif op == "matmul_reduce_scatter":
            torch.ops.tdx.matmul_reduce_scatter(x.flatten(0, 1), torch.randn(4, 8), name, 1)
        else:
            torch.ops.tdx.all_to_all_seq_to_heads(x, name, "contiguous")
    finally:
        dist.set_debug_level(previous)


def ids_on_one_rank_only():
    """Rank 0 passes document_ids to ring attention, rank 1 does not."""
    name = dist.group.WORLD.group_name
    q = torch.randn(1, 2, 4, 8)
    ids = torch.zeros(1, 4, dtype=torch.long) if dist.get_rank() == 0 else None
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        torch.ops.tdx.ring_attention_fwd(q, q, q, name, True, 0.5, "zigzag", ids)
    finally:
        dist.set_debug_level(previous)


def test_document_ids_on_one_rank_only_are_refused_under_detail(world2):
    with pytest.raises(RuntimeError, match=r"rank \d runs ring_attention_fwd with document_ids with Long \[0\], "
                                           r"rank \d runs ring_attention_fwd without document_ids"):
        world2.run(ids_on_one_rank_only)
    assert world2.alive


@pytest.mark.parametrize(
    "op, message",
    [
        ("ring_attention", r"ring_attention_fwd: the ranks of the group disagree on the k/v block they exchange: "
                           r"rank \d runs ring_attention_fwd with Float \[2, 1, 2, 4, 8\], rank \d runs "
                           r"ring_attention_fwd with Float \[2, 1, 4, 2, 8\]"),
        ("matmul_reduce_scatter", r"disagree on the partial sum they exchange: rank \d runs matmul_reduce_scatter "
                                  r"with Float \[2, 2, 4\], rank \d runs matmul_reduce_scatter with Float \[4, 1, 4\]"),
        ("all_to_all", r"disagree on the head blocks they exchange"),
    ],
)
def test_disagreeing_ranks_are_refused_under_detail(world2, op, message):
    with pytest.raises(RuntimeError, match=message):
        world2.run(disagreeing_exchange, op)
    assert world2.alive  # every rank raised: nothing hangs
