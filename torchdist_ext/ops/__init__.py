"""Typed Python faces of the ``torch.ops.tdx`` ops, one module per op family.

Each wrapper is named after its op's schema. Each module registers the family's
fake implementations (for torch.compile and meta tracing; they make the C++
op's argument checks, so bad shapes fail at trace time) and autograd formulas;
every backward calls registered ops only.
"""

from torchdist_ext.ops.all_to_all import all_to_all_heads_to_seq, all_to_all_seq_to_heads
from torchdist_ext.ops.attention import (
    balanced_sequence_plan,
    context_attention_work,
    document_attention_fwd,
    lse_merge_,
    ring_attention_fwd,
)
from torchdist_ext.ops.collective_matmul import (
    all_gather_matmul,
    all_gather_scaled_mm,
    all_gather_weight_grad,
    matmul_reduce_scatter,
    scaled_mm_reduce_scatter,
)
from torchdist_ext.ops.cross_entropy import vocab_parallel_cross_entropy_fwd
from torchdist_ext.ops.fp8 import fp8_cast_amax, fp8_cast_blockwise, fp8_cast_transpose_amax
from torchdist_ext.ops.init import counter_trunc_normal_
from torchdist_ext.ops.linear_grad import linear_dgrad, linear_wgrad_
from torchdist_ext.ops.moe import moe_combine, moe_dispatch, moe_grouped_mm, moe_permute, moe_unpermute

__all__ = [
    "all_gather_matmul",
    "all_gather_scaled_mm",
    "all_gather_weight_grad",
    "all_to_all_heads_to_seq",
    "all_to_all_seq_to_heads",
    "balanced_sequence_plan",
    "context_attention_work",
    "counter_trunc_normal_",
    "document_attention_fwd",
    "fp8_cast_amax",
    "fp8_cast_blockwise",
    "fp8_cast_transpose_amax",
    "linear_dgrad",
    "linear_wgrad_",
    "lse_merge_",
    "matmul_reduce_scatter",
    "scaled_mm_reduce_scatter",
    "moe_combine",
    "moe_dispatch",
    "moe_grouped_mm",
    "moe_permute",
    "moe_unpermute",
    "ring_attention_fwd",
    "vocab_parallel_cross_entropy_fwd",
]
