"""Drop-in parallel layers. Parameters are DTensors on the layer's 1-D mesh.

Tensor parallelism (``tp_mesh``), Megatron semantics, optional sequence parallelism:
    ColumnParallelLinear(in, out, bias=True, *, tp_mesh, gather_output=False,
                         sequence_parallel=False, seq_dim=1, device=None, dtype=None)
    RowParallelLinear(in, out, bias=True, *, tp_mesh, input_is_parallel=True,
                      sequence_parallel=False, seq_dim=1, device=None, dtype=None)
    VocabParallelEmbedding(num_embeddings, embedding_dim, *, tp_mesh, sequence_parallel=False,
                           seq_dim=1, padding_idx=None, device=None, dtype=None)
    RMSNorm(dim, *, tp_mesh, sequence_parallel=False, eps=1e-6, device=None, dtype=None)
    vocab_parallel_cross_entropy(logits, target, *, tp_mesh, ignore_index=-100, reduction="mean",
                                 inplace_backward=False)

Context parallelism (attention tensors [batch, heads, seq_local, head_dim]; ``cp_mesh`` 1-D, or 2-D
``[ring, ulysses]`` for the hybrid; shard with the same ``cp_mesh`` and ``layout``):
    ring_attention(q, k, v, *, cp_mesh, causal=False, scale=None, layout="zigzag", document_ids=None)
    ulysses_attention(q, k, v, *, cp_mesh, causal=False, scale=None, layout="zigzag", document_ids=None)
    hybrid_attention(q, k, v, *, cp_mesh, causal=False, scale=None, layout="zigzag", document_ids=None)
    (document_ids [batch, seq_local]: packed documents, sharded like the tokens; negative = padding)
    shard_sequence(x, *, cp_mesh, dim, layout="zigzag") / unshard_sequence(x_local, *, cp_mesh, dim, layout="zigzag")

Expert parallelism (``ep_mesh``: its ranks see different tokens):
    MoE(dim, ffn_dim, num_experts, *, top_k=2, ep_mesh, capacity_factor=None, drop_policy="probs",
        score_func="softmax", aux_loss_coef=0.0, z_loss_coef=0.0, num_shared_experts=0, device=None, dtype=None)
    fully_shard_moe(moe, *, dp_mesh, expert_dp_mesh, **fsdp_kwargs)

Build from existing modules with the same full weights:
    ColumnParallelLinear.from_linear(linear, tp_mesh=..., **kwargs)
    RowParallelLinear.from_linear(linear, tp_mesh=..., **kwargs)
    VocabParallelEmbedding.from_embedding(embedding, tp_mesh=..., **kwargs)
    RMSNorm.from_rms_norm(norm, tp_mesh=..., sequence_parallel=False)
    MoE.from_experts(gate, w1, w3, w2, *, ep_mesh=..., shared=None, **kwargs)
"""

from torchdist_ext.parallel.context_attention import hybrid_attention, ring_attention, ulysses_attention
from torchdist_ext.parallel.cross_entropy import vocab_parallel_cross_entropy
from torchdist_ext.parallel.embedding import VocabParallelEmbedding
from torchdist_ext.parallel.linear import ColumnParallelLinear, RowParallelLinear
from torchdist_ext.parallel.moe import MoE, fully_shard_moe
from torchdist_ext.parallel.norm import RMSNorm
from torchdist_ext.parallel.sequence_sharding import shard_sequence, unshard_sequence

__all__ = [
    "ColumnParallelLinear",
    "MoE",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "fully_shard_moe",
    "hybrid_attention",
    "ring_attention",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
    "vocab_parallel_cross_entropy",
]
