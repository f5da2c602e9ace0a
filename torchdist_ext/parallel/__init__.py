"""Drop-in parallel layers. Parameters are DTensors on the layer's 1-D mesh; activations are plain tensors.

- Tensor parallelism (``tp_mesh``, Megatron semantics, optional sequence parallelism): ``ColumnParallelLinear``,
  ``RowParallelLinear``, ``VocabParallelEmbedding``, ``RMSNorm``, ``vocab_parallel_cross_entropy``.
- Context parallelism (``cp_mesh``; the sequence cut in ``order`` "zigzag" or "contiguous"):
  ``ring_attention``, ``ulysses_attention``, ``hybrid_attention``, ``shard_sequence``, ``unshard_sequence``;
  packed documents balanced over the ranks: ``balanced_sequence_plan`` (a ``SequencePlan``).
- Expert parallelism (``ep_mesh``): ``MoE``, ``fully_shard_moe``.
- Activation recompute: ``recompute(module, mode)``, ``mode`` in ``RECOMPUTE_MODES``.
- The axes of a run and their meshes, built once: ``ParallelDims``, ``ParallelMeshes``.
- Initialisation of sharded parameters that equals the whole model's: ``trunc_normal_``.

Example: ``ColumnParallelLinear.from_linear(linear, tp_mesh=tp_mesh)``. Signatures: docs/api.md.
"""

from torchdist_ext.parallel.context_attention import hybrid_attention, ring_attention, ulysses_attention
from torchdist_ext.parallel.cross_entropy import vocab_parallel_cross_entropy
from torchdist_ext.parallel.dims import ParallelDims, ParallelMeshes
from torchdist_ext.parallel.embedding import VocabParallelEmbedding
from torchdist_ext.parallel.init import trunc_normal_
from torchdist_ext.parallel.linear import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.parallel.moe import MoE, fully_shard_moe
from torchdist_ext.parallel.norm import RMSNorm
from torchdist_ext.parallel.recompute import RECOMPUTE_MODES, recompute
from torchdist_ext.parallel.sequence_plan import SequencePlan, balanced_sequence_plan
from torchdist_ext.parallel.sequence_sharding import shard_sequence, unshard_sequence

__all__ = [
    "RECOMPUTE_MODES",
    "ColumnParallelLinear",
    "MoE",
    "ParallelDims",
    "ParallelMeshes",
    "RMSNorm",
    "RowParallelLinear",
    "SequencePlan",
    "VocabParallelEmbedding",
    "balanced_sequence_plan",
    "fully_shard_moe",
    "hybrid_attention",
    "recompute",
    "ring_attention",
    "shard_sequence",
    "trunc_normal_",
    "ulysses_attention",
    "unshard_sequence",
    "vocab_parallel_cross_entropy",
]
