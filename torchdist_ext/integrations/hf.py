"""Hugging Face Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3: one set of module names) on our layers:
tensor, sequence and context parallelism and FSDP2, with the single-process model's loss.

    parallelize_hf_model(model, tp_mesh=mesh["tp"], dp_mesh=mesh["dp"], cp_mesh=mesh["cp"],
                         sequence_parallel=True)
    loss = model(**shard_hf_batch(batch, cp_mesh=mesh["cp"])).loss   # == the single-process loss

``transformers`` is imported only to register the attention function. Design: docs/architecture.md.
"""

import sys
import types
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from torchdist_ext import ops
from torchdist_ext.parallel import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    hybrid_attention,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    vocab_parallel_cross_entropy,
)
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.regions import reduce_from_region
from torchdist_ext.parallel.sequence_sharding import check_order, context_parallel_groups

__all__ = ["ATTENTION_NAME", "CP_METHODS", "MODEL_TYPES", "document_ids_from", "parallelize_hf_model",
           "shard_hf_batch"]

ATTENTION_NAME = "torchdist_ext"
CP_METHODS = {"ring": ring_attention, "ulysses": ulysses_attention, "hybrid": hybrid_attention}
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
IGNORE_INDEX = -100
_BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def document_ids_from(position_ids: Tensor, attention_mask: Tensor | None, batch: int) -> Tensor:
    """``[batch, seq]`` int64 document ids: a position that is not its predecessor + 1 starts a new
    document (HF's packed-sequence rule); tokens where ``attention_mask`` is 0 get -1 (padding)."""
    position_ids = position_ids.expand(batch, -1)
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    ids = starts.long().cumsum(-1)
    return ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -1)


def shard_hf_batch(batch: dict, *, cp_mesh: DeviceMesh, order: str = "zigzag") -> dict:
    """This rank's part of the batch a user would pass to the single-process model.

    ``batch``: ``input_ids`` ``[batch, seq]``, optional ``labels`` (unshifted, HF's convention, -100
    ignored), ``attention_mask`` (2-D padding mask) and ``position_ids``. Returns ``input_ids``,
    ``position_ids`` (global), ``document_ids`` (padding and packed documents; None when every row is
    one document without padding), and with labels ``labels`` / ``shift_labels`` (shifted over the
    whole sequence before sharding) and ``num_items_in_batch`` (the global count of target tokens):
    all sharded along the sequence like ``shard_sequence(x, cp_mesh=cp_mesh, dim=1, order=order)``;
    and ``cp_order``, which the model checks against its own.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of tensors (a dict, a tokenizer's BatchEncoding), got "
                        f"{type(batch).__name__}")
    unknown = sorted(set(batch) - set(_BATCH_KEYS))
    if unknown:
        raise ValueError(f"batch has keys {unknown} that shard_hf_batch does not know how to shard; it takes "
                         f"{list(_BATCH_KEYS)}")
    check_order(order)
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"batch['input_ids'] must be a tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [batch, seq], got shape {tuple(input_ids.shape)}")
    size, seq = input_ids.shape
    for key in ("labels", "attention_mask", "position_ids"):
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"batch[{key!r}] must be a tensor, got {type(value).__name__}")
        allowed = ((size, seq), (1, seq)) if key == "position_ids" else ((size, seq),)
        if tuple(value.shape) not in allowed:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; it must be [batch, seq] = "
                             f"{[size, seq]} like input_ids")
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device)[None]
    position_ids = position_ids.expand(size, -1)

    def shard(x: Tensor) -> Tensor:
        return shard_sequence(x.contiguous(), cp_mesh=cp_mesh, dim=1, order=order)

    document_ids = document_ids_from(position_ids, batch.get("attention_mask"), size)
    local = {
        "input_ids": shard(input_ids),
        "position_ids": shard(position_ids),
        # One document per row and no padding: plain causal attention, one block call over the batch.
        "document_ids": None if bool((document_ids == 0).all()) else shard(document_ids),
        "cp_order": order,
    }
    labels = batch.get("labels")
    if labels is not None:
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        local["labels"] = local["shift_labels"] = shard(shifted)
        local["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return local


# ---- the attention registered with transformers ----

def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
               scaling: float | None = None, is_causal: bool | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF's attention-function signature: q ``[batch, heads, seq, head_dim]``, k/v at kv heads; returns
    ``([batch, seq, heads, head_dim], None)``. Causal, over ``document_ids`` when the inputs hook set them."""
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
        out = CP_METHODS[method](query, key, value, cp_mesh=cp_mesh, causal=True, scale=scale, order=order,
                                 document_ids=document_ids)
    elif document_ids is not None:
        out, _ = ops.document_attention_fwd(query, key, value, document_ids, True, scale)
    else:
        grouped = True if key.shape[1] != query.shape[1] else False
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=grouped)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


# ---- the model's inputs ----

def _inputs_hook(cp_mesh: DeviceMesh | None, cp_order: str):
    """A forward pre-hook of the decoder (``model.model``): global positions, document ids, no HF mask."""

    def hook(decoder: nn.Module, args: tuple, kwargs: dict):
        kwargs = {**dict(zip(("input_ids", "attention_mask", "position_ids"), args)), **kwargs}
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True is not supported by a parallelize_hf_model model")
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("a parallelize_hf_model model trains without a KV cache; pass no cache")
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"attention_mask must be the 2-D [batch, seq] padding mask, got shape {tuple(mask.shape)}")
        order = kwargs.pop("cp_order", None)
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs.get("inputs_embeds")
        if cp_mesh is not None:
            if order is None or kwargs.get("position_ids") is None:
                raise ValueError("under context parallelism the model takes this rank's part of the batch from "
                                 "shard_hf_batch(batch, cp_mesh=...) (its global position_ids and cp_order)")
            if order != cp_order:
                raise ValueError(f"the batch was sharded with shard_hf_batch(order={order!r}) but the model was "
                                 f"parallelised with cp_order={cp_order!r}; use the same order")
            if mask is not None:
                raise ValueError("under context parallelism pass the attention_mask to shard_hf_batch, which turns "
                                 "it into document_ids, not to the model")
        elif reference is not None:  # (neither input: HF's own check raises)
            position_ids = kwargs.get("position_ids")
            packed = position_ids is not None
            if position_ids is None:
                position_ids = torch.arange(reference.shape[1], device=reference.device)[None]
                kwargs["position_ids"] = position_ids
            if kwargs.get("document_ids") is None and (packed or mask is not None):
                kwargs["document_ids"] = document_ids_from(position_ids, mask, reference.shape[0])
            elif mask is not None:
                kwargs["document_ids"] = kwargs["document_ids"].masked_fill(mask == 0, -1)
        kwargs["attention_mask"] = None
        kwargs["use_cache"] = False
        return (), kwargs

    return hook


def _sequence_parallel_attention_forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None,
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
    out, _ = _attention(self, query, key, value, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                        scaling=self.scaling, sliding_window=_sliding_window(self), **kwargs)
    return self.o_proj(out.reshape(batch, seq, -1)), None


def _sliding_window(attn: nn.Module) -> int | None:
    """The window HF's forward passes the attention function: the module's (Qwen2: None on full-attention
    layers), else the config's (Mistral)."""
    return getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))


def _gradient_times(x: Tensor, factor: int) -> Tensor:
    """``x`` in the forward (exactly); its gradient multiplied by ``factor`` in the backward."""
    return x if factor == 1 else x + (x - x.detach()) * (factor - 1)


# ---- the loss ----

class ParallelCausalLMLoss:
    """HF's ``loss_function(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
    shift_labels=None, **kwargs)`` on vocab-sharded logits (over ``tp``) and sequence-sharded tokens
    (over the context-parallel groups): ``sum of token losses / number of target tokens``, identical
    on every rank."""

    def __init__(self, tp: MeshGroup | None, tp_mesh: DeviceMesh | None, cp_groups: list[MeshGroup]):
        self.tp, self.tp_mesh, self.cp_groups = tp, tp_mesh, cp_groups

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int | None = None,
                 num_items_in_batch: Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: Tensor | None = None, **kwargs) -> Tensor:
        if shift_labels is None:
            if self.cp_groups:
                raise ValueError("under context parallelism the labels are shifted before sharding: pass the batch "
                                 "through shard_hf_batch")
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        elif self.cp_groups and num_items_in_batch is None:
            raise ValueError("under context parallelism the loss needs the global num_items_in_batch (shard_hf_batch "
                             "gives it)")
        shift_labels = shift_labels.to(logits.device)
        logits = logits.float()
        if self.tp is not None:
            total = vocab_parallel_cross_entropy(logits, shift_labels, tp_mesh=self.tp_mesh,
                                                 ignore_index=ignore_index, reduction="sum")
        else:
            total = F.cross_entropy(logits.flatten(0, -2), shift_labels.flatten(), ignore_index=ignore_index,
                                    reduction="sum")
        for group in self.cp_groups:
            # Every cp rank's tokens give a partial gradient of the same parameters; FSDP averages over
            # dp x cp, so the gradient is scaled by the cp size to make that a sum over cp.
            total = reduce_from_region(_gradient_times(total, group.size), group)
        count = (shift_labels != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
        if isinstance(count, Tensor):
            count = count.to(total.device)
        return total / count


# ---- the conversion ----

def _refuse_generate(*args, **kwargs):
    raise ValueError("generate is not supported on a tensor- or context-parallel parallelize_hf_model model (its "
                     "logits are vocab- and sequence-sharded, and it runs without a KV cache); generate with the "
                     "single-process model")


def _decoder_parts(model: nn.Module):
    decoder = getattr(model, "model", None)
    missing = [name for name, owner, attr in (("model.model", model, "model"), ("model.lm_head", model, "lm_head"),
                                                ("model.config", model, "config"))
               if getattr(owner, attr, None) is None]
    if not missing:
        missing = [f"model.model.{attr}" for attr in ("embed_tokens", "layers", "norm")
                   if getattr(decoder, attr, None) is None]
    if missing:
        raise TypeError(f"parallelize_hf_model takes a Llama-family causal LM (LlamaForCausalLM, "
                        f"Qwen2ForCausalLM, ...); {type(model).__name__} has no {', '.join(missing)}")
    return decoder


def _check_config(config, decoder: nn.Module, tp_size: int) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.model_type={model_type!r} is not one parallelize_hf_model knows (its norms, "
                         f"attention and MLP must be Llama's); supported: {sorted(MODEL_TYPES)}")
    windowed = [i for i, layer in enumerate(decoder.layers) if _sliding_window(layer.self_attn) is not None]
    if windowed:
        raise ValueError(f"sliding-window attention (layers {windowed}, window "
                         f"{_sliding_window(decoder.layers[windowed[0]].self_attn)}) is not supported; set "
                         "config.sliding_window = None")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"config.attention_dropout={dropout} is not supported; set it to 0.0")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("config.use_sliding_window=True is not supported (the attention is full causal)")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, name)
        if value % tp_size:
            raise ValueError(f"config.{name}={value} must be divisible by the size of tp_mesh ({tp_size})")


def _fsdp_mesh(dp_mesh: DeviceMesh | None, cp_mesh: DeviceMesh | None) -> DeviceMesh | None:
    if dp_mesh is None or cp_mesh is None:
        mesh = dp_mesh if dp_mesh is not None else cp_mesh
        return mesh if mesh is None or mesh.ndim == 1 else mesh._flatten()
    names = (*dp_mesh.mesh_dim_names, *cp_mesh.mesh_dim_names)
    root = dp_mesh._get_root_mesh()
    if root is not cp_mesh._get_root_mesh() or not _in_order(root.mesh_dim_names, names):
        raise ValueError(f"dp_mesh {dp_mesh.mesh_dim_names} and cp_mesh {cp_mesh.mesh_dim_names} must be dims of one "
                         f"init_device_mesh mesh, dp before cp (got the mesh dims {root.mesh_dim_names})")
    return root[names]._flatten("_".join(names))


def _in_order(all_names, names) -> bool:
    positions = [all_names.index(name) if name in all_names else -1 for name in names]
    return -1 not in positions and positions == sorted(positions)


def _convert_layers(decoder: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    sp = {"sequence_parallel": sequence_parallel}
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), tp_mesh=tp_mesh, **sp))
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp_mesh=tp_mesh, **sp)
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, ColumnParallelLinear.from_linear(getattr(mlp, name), tp_mesh=tp_mesh, **sp))
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp_mesh=tp_mesh, **sp)
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, RMSNorm.from_rms_norm(getattr(layer, name), tp_mesh=tp_mesh, **sp))
        for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms: each rank normalises its own heads,
            if getattr(attn, name, None) is not None:  # so their weight gradients are summed over tp
                setattr(attn, name, RMSNorm.from_rms_norm(getattr(attn, name), tp_mesh=tp_mesh,
                                                          sequence_parallel=True))
        if sequence_parallel:
            attn.forward = types.MethodType(_sequence_parallel_attention_forward, attn)


def parallelize_hf_model(model: nn.Module, *, tp_mesh: DeviceMesh | None = None, dp_mesh: DeviceMesh | None = None,
                         cp_mesh: DeviceMesh | None = None, sequence_parallel: bool = False,
                         cp_method: str = "ring", cp_order: str = "zigzag") -> nn.Module:
    """Parallelises a Hugging Face Llama-family causal LM in place; returns it.

    - tensor parallelism: q/k/v and gate/up become ``ColumnParallelLinear``, o/down ``RowParallelLinear``, the
      embedding ``VocabParallelEmbedding``, the LM head a ``ColumnParallelLinear`` whose logits stay
      vocab-sharded (``logits`` is this rank's ``[batch, seq, vocab / tp]`` slice), the norms our ``RMSNorm``.
      Tied embeddings stay tied (one parameter, sharded by vocab rows for both uses).
    - sequence parallelism: the residual stream is sharded along the sequence between the blocks; the
      column-parallel projections all-gather it inside their GEMM ring and the row-parallel ones
      reduce-scatter. The attention modules get a forward that takes the head count and sequence length
      from the projections' outputs.
    - positions and masks: the model's inputs pass through a hook that supplies global ``position_ids``
      and turns the 2-D padding ``attention_mask`` and packed ``position_ids`` into per-token
      ``document_ids`` (``document_ids_from``). The attention is ours, registered with transformers'
      ``AttentionInterface`` as ``ATTENTION_NAME``: SDPA or document attention on one rank, ring / Ulysses /
      hybrid attention over ``cp_mesh``.
    - the loss: HF's ``loss_function`` on the vocab-parallel cross-entropy, normalised by the global number of
      target tokens, summed over the context-parallel ranks.
    - FSDP2: every decoder layer and then the whole model are ``fully_shard``-ed over ``dp_mesh`` x ``cp_mesh``
      when either is given.

    Args:
        model: a Llama-family causal LM (``config.model_type`` in ``MODEL_TYPES``), the same (same weights) on
            every rank, not parallelised before.
        tp_mesh: 1-D DeviceMesh of tensor parallelism (None: none); the config's attention heads, kv heads,
            intermediate size and vocabulary size divisible by its size.
        dp_mesh: 1-D DeviceMesh of data parallelism (None: none).
        cp_mesh: DeviceMesh of context parallelism (None: none): 1-D for ``cp_method`` "ring" or "ulysses",
            2-D ``[ring, ulysses]`` for "hybrid". Feed the model ``shard_hf_batch(batch, cp_mesh=cp_mesh,
            order=cp_order)``.
        sequence_parallel: shard the residual stream along the sequence over ``tp_mesh`` (needs ``tp_mesh``).
        cp_method: "ring", "ulysses" or "hybrid" (the keys of ``CP_METHODS``).
        cp_order: how the sequence is cut over the cp ranks: "zigzag" or "contiguous".

    All meshes are slices of one ``init_device_mesh`` mesh, dp before cp. Refused with a clear error instead of
    ignored: model types other than ``MODEL_TYPES`` (e.g. Gemma, whose norms scale by 1 + weight), 4-D
    attention masks, attention dropout > 0, ``output_attentions``, sliding-window or soft-capped attention, KV
    caches, ``generate`` on a tensor- or context-parallel model, CP batches that did not come from
    ``shard_hf_batch`` or were cut in another order.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, "_tdx_parallelized", False):
        raise ValueError("this model was already parallelised by parallelize_hf_model; build a new one from the "
                         "single-process model")
    decoder = _decoder_parts(model)
    for name, mesh in (("tp_mesh", tp_mesh), ("dp_mesh", dp_mesh), ("cp_mesh", cp_mesh)):
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{name} must be a DeviceMesh or None, got {type(mesh).__name__}")
    if cp_method not in CP_METHODS:
        raise ValueError(f"cp_method must be one of {sorted(CP_METHODS)}, got {cp_method!r}")
    check_order(cp_order)
    if sequence_parallel and tp_mesh is None:
        raise ValueError("sequence_parallel=True needs a tp_mesh")
    cp_groups = []
    if cp_mesh is not None:
        ring, ulysses = context_parallel_groups(cp_mesh)
        if (cp_method == "hybrid") != (ulysses is not None):
            raise ValueError(f"cp_method={cp_method!r} takes a {'2-D [ring, ulysses]' if cp_method == 'hybrid' else '1-D'} "
                             f"cp_mesh, got a {cp_mesh.ndim}-D mesh")
        cp_groups = [ring] if ulysses is None else [ring, ulysses]
    tp = MeshGroup.of(tp_mesh) if tp_mesh is not None else None
    _check_config(model.config, decoder, tp.size if tp is not None else 1)
    fsdp_mesh = _fsdp_mesh(dp_mesh, cp_mesh)  # (checked before anything changes)

    if tp is not None:
        tied = model.lm_head.weight is decoder.embed_tokens.weight
        _convert_layers(decoder, tp_mesh, sequence_parallel)
        decoder.norm = RMSNorm.from_rms_norm(decoder.norm, tp_mesh=tp_mesh, sequence_parallel=sequence_parallel)
        decoder.embed_tokens = VocabParallelEmbedding.from_embedding(decoder.embed_tokens, tp_mesh=tp_mesh,
                                                                     sequence_parallel=sequence_parallel)
        model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, tp_mesh=tp_mesh,
                                                         sequence_parallel=sequence_parallel)
        if tied:  # one parameter, vocab rows sharded alike in both layers
            model.lm_head.weight = decoder.embed_tokens.weight

    context = None if cp_mesh is None else (cp_mesh, cp_method, cp_order)
    for layer in decoder.layers:
        layer.self_attn._tdx_context_parallel = context
    _register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    decoder.register_forward_pre_hook(_inputs_hook(cp_mesh, cp_order), with_kwargs=True)
    model.loss_function = ParallelCausalLMLoss(tp, tp_mesh, cp_groups)

    model._tdx_parallelized = True
    if tp is not None or cp_mesh is not None:
        model.generate = _refuse_generate
    if fsdp_mesh is not None:
        for layer in decoder.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model
