"""Typed Python faces of the ``torch.ops.tdx`` ops, one module per op family.

Each module registers the family's fake implementations (for torch.compile and
meta tracing) and autograd formulas; every backward calls registered ops only.
"""

from torchdist_ext.ops.all_to_all import all_to_all_heads_to_seq, all_to_all_seq_to_heads
from torchdist_ext.ops.attention import lse_merge_, ring_attention
from torchdist_ext.ops.collective_matmul import (
    all_gather_matmul,
    all_gather_weight_grad,
    matmul_reduce_scatter,
)
from torchdist_ext.ops.cross_entropy import vocab_parallel_cross_entropy

__all__ = [
    "all_gather_matmul",
    "all_to_all_heads_to_seq",
    "all_to_all_seq_to_heads",
    "lse_merge_",
    "ring_attention",
    "all_gather_weight_grad",
    "matmul_reduce_scatter",
    "vocab_parallel_cross_entropy",
]
