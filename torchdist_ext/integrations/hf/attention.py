"""Our attention as HF attention function: SDPA or document attention on one rank, ring / Ulysses / hybrid
attention over a context-parallel mesh; and the attention forward that sequence parallelism needs."""

import sys

import torch.nn.functional as F
from torch import Tensor, nn

from torchdist_ext import ops
from torchdist_ext.parallel import hybrid_attention, ring_attention, ulysses_attention

__all__ = ["ATTENTION_NAME", "CP_METHODS", "register_attention", "sequence_parallel_attention_forward",
           "sliding_window"]

ATTENTION_NAME = "torchdist_ext"
CP_METHODS = {"ring": ring_attention, "ulysses": ulysses_attention, "hybrid": hybrid_attention}


def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF's attention-function signature: q ``[batch, heads, seq, head_dim]``, k/v at kv heads; returns
    ``([batch, seq, heads, head_dim], None)``. Causal, over ``document_ids`` when the inputs hook set them (and
    by ``cp_positions`` under the "balanced" cp order)."""
    if attention_mask is not None:
        raise ValueError(
            f"torchdist_ext attention got a prepared mask of shape {tuple(attention_mask.shape)}; pass the 2-D "
            "padding attention_mask or packed position_ids to the model instead (4-D masks are not supported)"
        )
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported; set config.attention_dropout = 0.0")
    if is_causal is False:
        raise ValueError("torchdist_ext attention is causal; is_causal=False is not supported")
    for name in ("sliding_window", "softcap", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}={kwargs[name]!r} is not supported by torchdist_ext attention")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported by torchdist_ext attention")
    document_ids = kwargs.get("document_ids")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    context = getattr(module, "_tdx_context_parallel", None)
    if context is not None:
        cp_mesh, method, order = context
        positions = kwargs.get("cp_positions")
        if (order == "balanced") != (positions is not None):
            raise ValueError(f"the model's cp_order is {order!r}, but cp_positions were "
                             f"{'not ' if positions is None else ''}given: feed it shard_hf_batch(batch, "
                             f"cp_mesh=..., order={order!r})")
        order = None if order == "balanced" else order
        out = CP_METHODS[method](query, key, value, cp_mesh=cp_mesh, causal=True, scale=scale, order=order,
                                 document_ids=document_ids, positions=positions)
    elif document_ids is not None:
        out, _ = ops.document_attention_fwd(query, key, value, document_ids, True, scale)
    else:
        grouped = True if key.shape[1] != query.shape[1] else False
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=grouped)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Registers ``attention`` with transformers' ``AttentionInterface`` as ``ATTENTION_NAME``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attention)


def sequence_parallel_attention_forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None,
                                        cache=None, **kwargs):
    """The Llama-family attention forward with the shapes taken from the projections' outputs: under
    sequence parallelism the input is ``[batch, seq / tp, hidden]`` and the projections (which gather the
    sequence inside their GEMM ring) return ``[batch, seq, heads / tp * head_dim]``. Qwen3's per-head
    q/k norms run where its own forward runs them (before the transpose)."""
    query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    batch, seq = query.shape[:2]
    query, key, value = (t.view(batch, seq, -1, self.head_dim) for t in (query, key, value))
    if getattr(self, "q_norm", None) is not None:
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    cos, sin = position_embeddings
    query, key = sys.modules[type(self).__module__].apply_rotary_pos_emb(query, key, cos, sin)
    out, _ = attention(self, query, key, value, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                       scaling=self.scaling, sliding_window=sliding_window(self), **kwargs)
    return self.o_proj(out.reshape(batch, seq, -1)), None


def sliding_window(attn: nn.Module) -> int | None:
    """The window of an HF attention module: its own (Qwen2: None on full-attention layers; Qwen2-MoE sets one
    only on its sliding layers, the config's ``layer_types`` naming them), else the config's (Mistral)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    if getattr(attn.config, "layer_types", None) is not None:
        return None
    return getattr(attn.config, "sliding_window", None)
