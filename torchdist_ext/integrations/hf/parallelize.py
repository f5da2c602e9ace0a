"""``parallelize_hf_model``: a Hugging Face Llama-family causal LM (dense or MoE) on our layers, in place."""

import copy
import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from torchdist_ext.fp8 import convert_to_fp8
from torchdist_ext.fp8.recipe import CurrentScaling, DelayedScaling, Recipe
from torchdist_ext.fp8.state import Fp8State
from torchdist_ext.integrations.hf.attention import (
    ATTENTION_NAME,
    CP_METHODS,
    register_attention,
    sequence_parallel_attention_forward,
    sliding_window,
)
from torchdist_ext.integrations.hf.batch import check_hf_order, document_ids_from
from torchdist_ext.integrations.hf.loss import ParallelCausalLMLoss
from torchdist_ext.integrations.hf.moe import MOE_MODEL_TYPES, HFMoEBlock, is_moe_block, moe_from_hf_block
from torchdist_ext.integrations.hf.pipeline import (
    HFPipeline,
    refuse_forward,
    split_into_stages,
)
from torchdist_ext.parallel import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from torchdist_ext.parallel.dims import ParallelMeshes
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.sequence_sharding import context_parallel_groups
from torchdist_ext.pipeline import SCHEDULES, num_stages

__all__ = ["MODEL_TYPES", "parallelize_hf_model"]

MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"}) | MOE_MODEL_TYPES
# Each decoder layer's linears: (module path in the layer, whether tensor parallelism splits its output
# features (column-parallel) or its input features (row-parallel)).
_LAYER_LINEARS = (("self_attn.q_proj", "out"), ("self_attn.k_proj", "out"), ("self_attn.v_proj", "out"),
                  ("self_attn.o_proj", "in"), ("mlp.gate_proj", "out"), ("mlp.up_proj", "out"),
                  ("mlp.down_proj", "in"))


def _inputs_hook(cp_mesh: DeviceMesh | None, cp_order: str):
    """A forward pre-hook of the decoder (``model.model``): global positions, document ids, no HF mask."""

    def hook(decoder: nn.Module, args: tuple, kwargs: dict):
        kwargs = {**dict(zip(("input_ids", "attention_mask", "position_ids"), args)), **kwargs}
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True is not supported by a parallelize_hf_model model")
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("a parallelize_hf_model model runs without a KV cache, but got past_key_values; pass "
                             "use_cache=False (to generate too)")
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
            if (order == "balanced") != (kwargs.get("cp_positions") is not None):
                raise ValueError("cp_positions come with shard_hf_batch(order='balanced') and only with it: pass the "
                                 "model the whole dict shard_hf_batch returns")
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


def _refuse_generate(*args, **kwargs):
    raise ValueError("generate is not supported on a tensor- or context-parallel parallelize_hf_model model (its "
                     "logits are vocab- and sequence-sharded, and it runs without a KV cache); generate with the "
                     "single-process model")


def _refuse_save_pretrained(*args, **kwargs):
    raise ValueError("save_pretrained would gather nothing and write a directory without weights from a "
                     "parallelize_hf_model model; call torchdist_ext.integrations.hf.save_hf_checkpoint(model, path) "
                     "on every rank instead")


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
    windowed = [i for i, layer in enumerate(decoder.layers) if sliding_window(layer.self_attn) is not None]
    if windowed:
        raise ValueError(f"sliding-window attention (layers {windowed}, window "
                         f"{sliding_window(decoder.layers[windowed[0]].self_attn)}) is not supported; set "
                         "config.sliding_window = None")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"config.attention_dropout={dropout} is not supported; set it to 0.0")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("config.use_sliding_window=True is not supported (the attention is full causal)")
    dense_mlps = any(not is_moe_block(layer.mlp) for layer in decoder.layers)  # (experts are not split over tp)
    for name in ("num_attention_heads", "num_key_value_heads", *(("intermediate_size",) if dense_mlps else ()),
                 "vocab_size"):
        value = getattr(config, name)
        if value % tp_size:
            raise ValueError(f"config.{name}={value} must be divisible by the size of tp_mesh ({tp_size})")


def _check_moe(config, decoder: nn.Module, meshes: ParallelMeshes | None, *, fp8, pp_mesh, compile: bool) -> None:
    """An MoE model's blocks become our ``MoE`` over ``meshes.ep``; what that does not cover yet is refused."""
    if config.model_type in ("deepseek_v3", "deepseek_v2"):
        raise ValueError(f"config.model_type={config.model_type!r}: its multi-head latent attention (low-rank q and "
                         "kv projections, a decoupled RoPE key) is not supported by parallelize_hf_model; its MoE "
                         "layers are: torchdist_ext.parallel.MoE(score_func='sigmoid', n_group=..., topk_group=..., "
                         "routed_scaling_factor=..., score_correction_bias=True) equals DeepseekV3MoE")
    if config.model_type not in MOE_MODEL_TYPES:
        if meshes is not None and meshes.dims.ep > 1:
            raise ValueError(f"meshes has ep={meshes.dims.ep}, but config.model_type={config.model_type!r} has dense "
                             f"FFNs: expert parallelism needs an MoE model ({sorted(MOE_MODEL_TYPES)})")
        return
    unknown = [i for i, layer in enumerate(decoder.layers)
               if hasattr(layer.mlp, "experts") and not is_moe_block(layer.mlp)]
    if unknown:
        raise ValueError(f"model.model.layers[{unknown[0]}].mlp ({type(decoder.layers[unknown[0]].mlp).__name__}) holds "
                         "experts in a layout parallelize_hf_model does not know (it reads experts.gate_up_proj "
                         "[E, 2 ffn, hidden] and experts.down_proj, as transformers 5 stores them)")
    if meshes is None:
        raise ValueError(f"config.model_type={config.model_type!r} is an MoE model: pass meshes=ParallelDims(..., "
                         f"ep=...).build_meshes(device) (ep=1 too), whose ep and expert_fsdp meshes its experts use")
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError(f"config.router_jitter_noise={config.router_jitter_noise} (Mixtral's training-time noise on "
                         "the router's input) is not supported; set it to 0.0")
    if getattr(config, "output_router_logits", False):
        raise ValueError("config.output_router_logits=True (HF's load-balancing loss over every layer's router "
                         "logits) is not supported yet; set it to False")
    for name, given in (("fp8", fp8 is not None), ("a pp_mesh", pp_mesh is not None), ("compile=True", compile)):
        if given:
            raise ValueError(f"{name} is not supported with an MoE model ({config.model_type}) yet")


def _check_fp8(recipe, all_gather: bool, decoder: nn.Module, tp_size: int, fsdp: bool) -> None:
    """Every decoder-layer linear runs its GEMM in fp8, or the call is refused (before anything changes): the
    recipe's type, fp8_all_gather's needs, and the fp8 GEMM's rule that this rank's features are multiples of
    16 (the LM head stays in the activation dtype)."""
    if recipe is not None and not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise TypeError(f"fp8 must be a DelayedScaling or CurrentScaling recipe or None, got {type(recipe).__name__}")
    if not isinstance(all_gather, bool):
        raise TypeError(f"fp8_all_gather must be a bool, got {all_gather!r}")
    if all_gather and (recipe is None or not fsdp):
        raise ValueError(f"fp8_all_gather=True needs an fp8 recipe and FSDP2 (a dp_mesh or cp_mesh); got "
                         f"fp8={recipe!r} and {'a' if fsdp else 'no'} dp or cp mesh")
    if all_gather and not (isinstance(recipe, DelayedScaling) and recipe.reduce_amax):
        raise ValueError(f"fp8_all_gather=True needs DelayedScaling(reduce_amax=True): every FSDP rank casts its "
                         f"shard with the same scale, known before the gather; got {recipe}")
    converted = [name for name, module in decoder.named_modules() if isinstance(module, Fp8State)]
    if converted:
        raise ValueError(f"the model already has fp8 modules ({converted[0]}, ...), which tensor parallelism would "
                         "replace by linears in the activation dtype; pass the recipe as parallelize_hf_model("
                         "..., fp8=recipe) to the single-process model instead")
    if recipe is None:
        return
    for index, layer in enumerate(decoder.layers):
        for path, split in _LAYER_LINEARS:
            linear = layer.get_submodule(path)
            out_features, in_features = linear.out_features, linear.in_features
            local = (out_features // tp_size, in_features) if split == "out" else (out_features, in_features // tp_size)
            if any(features % 16 for features in local):
                raise ValueError(f"fp8: model.layers.{index}.{path} would run an fp8 GEMM of [out, in] = "
                                 f"{list(local)} features on each rank (its [{out_features}, {in_features}] split "
                                 f"over tp = {tp_size}); fp8 GEMMs need multiples of 16")


def _check_one_mesh(**meshes: DeviceMesh | None) -> None:
    """The meshes given are dims of one ``init_device_mesh`` mesh, each dim in at most one of them: a rank's
    groups then partition the world as the layout says (separate meshes would overlap or leave the
    product of the sizes unchecked, and FSDP2 or the pipeline would fail later or wait forever)."""
    given = {name: mesh for name, mesh in meshes.items() if mesh is not None}
    if len(given) < 2:
        return
    roots = {id(mesh._get_root_mesh()) for mesh in given.values()}
    dims = {name: mesh.mesh_dim_names or () for name, mesh in given.items()}
    flat = [dim for names in dims.values() for dim in names]
    if len(roots) > 1 or len(flat) != len(set(flat)) or not all(dims.values()):
        listed = ", ".join(f"{name} {dims[name]}" for name in given)
        raise ValueError(f"{listed} must be distinct named dims of one init_device_mesh mesh (slice them from it, "
                         "e.g. mesh['tp'], mesh['dp'])")


def _check_pipeline(model: nn.Module, pp_mesh, schedule: str, num_microbatches, virtual_stages: int, fp8,
                    compile: bool, amax_mesh: DeviceMesh | None) -> None:
    if not isinstance(pp_mesh, DeviceMesh) or pp_mesh.ndim != 1:
        raise TypeError(f"pp_mesh must be a 1-D DeviceMesh or None, got {pp_mesh!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int with a pp_mesh, got {num_microbatches!r}")
    stages = num_stages(schedule, pp_mesh.size(), virtual_stages)
    layers = len(model.model.layers)
    if layers % stages:
        raise ValueError(f"config.num_hidden_layers={layers} must be divisible by the pipeline's {stages} stages "
                         f"({schedule}, pp={pp_mesh.size()}, virtual_stages={virtual_stages})")
    if model.lm_head.weight is model.model.embed_tokens.weight:
        raise ValueError("tie_word_embeddings=True is not supported with a pp_mesh: the embedding (first stage) and "
                         "the LM head (last stage) would share one weight across pipeline ranks")
    if isinstance(fp8, DelayedScaling) and compile:
        raise ValueError("compile=True with fp8=DelayedScaling(...) and a pp_mesh is not supported: a compiled "
                         "layer saves its amax history for the backward, and the next micro-batch's forward updates "
                         "it first (autograd refuses); use compile=False or CurrentScaling")
    if isinstance(fp8, DelayedScaling) and fp8.reduce_amax and amax_mesh is None:
        raise ValueError(f"fp8={fp8} reduces its amaxes over the ranks that hold the same stage, and pp_mesh is its "
                         "mesh's only dim: pass DelayedScaling(reduce_amax=False) (or CurrentScaling)")


def _amax_mesh(pp_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ranks that reduce fp8 amaxes together: every rank without pipelining (None: the default group),
    else those of the other dims of ``pp_mesh``'s mesh (the ranks holding the same stages: the same fp8
    modules), None when there are none."""
    if pp_mesh is None:
        return None
    root = pp_mesh._get_root_mesh()
    others = tuple(name for name in root.mesh_dim_names if name not in pp_mesh.mesh_dim_names)
    if not others:
        return None
    return root[others[0]] if len(others) == 1 else root[others]._flatten("_".join(others))


def _from_parallel_meshes(meshes: ParallelMeshes, cp_method: str, **given) -> dict:
    """The mesh arguments of a ``ParallelMeshes`` (the other mesh arguments left None): tp, cp with the method
    its cp_ulysses sets, pp, FSDP2's mesh (HSDP's 2-D with dp_replicate), the loss's dp x cp ranks and the fp8
    amaxes' stage ranks."""
    if not isinstance(meshes, ParallelMeshes):
        raise TypeError(f"meshes must be a ParallelMeshes (ParallelDims.build_meshes) or None, got "
                        f"{type(meshes).__name__}")
    passed = sorted(name for name, value in given.items() if value is not None)
    if passed:
        raise ValueError(f"meshes= gives every mesh; {passed} must be left None with it")
    dims = meshes.dims
    method = dims.cp_method
    if dims.cp > 1 and cp_method not in ("ring", method):
        raise ValueError(f"cp_method={cp_method!r}, but meshes' cp={dims.cp} with cp_ulysses={dims.cp_ulysses} "
                         f"is {method!r}; leave cp_method out")
    data = dims.dp * dims.cp > 1
    return {"tp_mesh": meshes.tp if dims.tp > 1 else None, "cp_mesh": meshes.cp,
            "cp_method": method if dims.cp > 1 else cp_method, "pp_mesh": meshes.pp if dims.pp > 1 else None,
            "fsdp_mesh": meshes.fsdp if data else None, "batch_mesh": meshes.batch if data else None,
            "amax_mesh": meshes.stage if dims.pp > 1 else None}


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


def _own_config(model: nn.Module) -> None:
    """Gives ``model`` a config object of its own: models built from one config (``from_config``, or one
    ``config`` passed to several constructors) share it, and parallelising sets the attention implementation
    on it, which must not change the others."""
    shared = model.config
    own = copy.deepcopy(shared)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = own


def _convert_layers(decoder: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    sp = {"sequence_parallel": sequence_parallel}
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), tp_mesh=tp_mesh, **sp))
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp_mesh=tp_mesh, **sp)
        if not isinstance(mlp, HFMoEBlock):  # an MoE runs on every tp rank's tokens, not split
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
            attn.forward = types.MethodType(sequence_parallel_attention_forward, attn)


def parallelize_hf_model(model: nn.Module, *, tp_mesh: DeviceMesh | None = None, dp_mesh: DeviceMesh | None = None,
                         cp_mesh: DeviceMesh | None = None, sequence_parallel: bool = False,
                         cp_method: str = "ring", cp_order: str = "zigzag", compile: bool = False,
                         fp8: Recipe | None = None, fp8_all_gather: bool = False, pp_mesh: DeviceMesh | None = None,
                         pp_schedule: str = "1f1b", num_microbatches: int | None = None,
                         virtual_stages: int = 1, meshes: ParallelMeshes | None = None) -> nn.Module:
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
      hybrid attention over ``cp_mesh``. The model gets a copy of its config, so that models sharing the
      config object keep their own attention.
    - the loss (``.loss``): the single-process model's loss over the whole batch of every data- and
      context-parallel rank (HF's ``loss_function`` on the vocab-parallel cross-entropy, summed over the ranks
      and divided by the global number of target tokens: ``ParallelCausalLMLoss``), the same on every rank;
      after ``backward`` and FSDP2's reduce-scatter every gradient is the single-process gradient. With
      gradient accumulation pass ``num_items_in_batch=global_num_items(model, window)`` to each forward.
    - fp8: with a recipe every decoder-layer linear runs its GEMMs in fp8 (``convert_to_fp8`` after tensor
      parallelism and before FSDP2, the amaxes reduced over the default group; call
      ``torchdist_ext.fp8.fp8_step(model)`` after each optimizer step); the LM head stays in the activation
      dtype. ``fp8_all_gather``: FSDP2 gathers those weights as fp8 bytes (a delayed recipe). With a
      ``pp_mesh`` the amaxes are reduced over the mesh's other dims (the ranks holding the same stages).
    - FSDP2: every decoder layer and then the whole model are ``fully_shard``-ed over ``dp_mesh`` x ``cp_mesh``
      when either is given.
    - pipeline parallelism (``pp_mesh``): the decoder layers are split into ``num_stages(pp_schedule, pp,
      virtual_stages)`` equal stages (``HFStage``: the embedding on the first, the final norm and LM head on
      the last); this rank keeps only its stages' modules (each the FSDP2 root of its layers) and trains with
      ``loss = model.pipeline.step(batch)`` (``HFPipeline``: forward and backward of ``num_microbatches``
      micro-batches by ``pp_schedule``, any of ``SCHEDULES``), the whole batch's loss as above.
    - MoE models (``MOE_MODEL_TYPES``: Mixtral, Qwen2-MoE, Qwen3-MoE; with ``meshes``): each sparse block
      becomes our ``MoE`` over ``meshes.ep`` (carved out of the data- and context-parallel ranks) with the
      block's weights and routing (``moe_from_hf_block``), run by every tp rank on the same tokens (gathered
      over tp with sequence parallelism), its experts sharded by FSDP2 over ``meshes.expert_fsdp``. Not yet:
      ``output_router_logits`` (HF's auxiliary loss), fp8, pipelines, compile; refused.
    - ``compile``: each decoder layer's forward compiled with ``fullgraph=True`` (FSDP2's hooks, the
      embedding, final norm, head and loss stay eager). The whole model compiles as one graph only without
      FSDP2 (tp and sequence parallelism alone): ``torch.compile(model, fullgraph=True)``.

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
        cp_order: how the sequence is cut over the cp ranks: "zigzag", "contiguous" or "balanced" (each batch
            by the plan of its documents: ``balanced_sequence_plan``).
        compile: compile each decoder layer (fullgraph).
        fp8: a ``torchdist_ext.fp8`` recipe (``DelayedScaling`` or ``CurrentScaling``) or None; each rank's
            share of every decoder-layer linear must have multiples of 16 features.
        fp8_all_gather: with FSDP2 and a ``DelayedScaling(reduce_amax=True)`` recipe, gather fp8 weights.
        pp_mesh: 1-D DeviceMesh of pipeline parallelism (None: none), a dim of the same mesh.
        pp_schedule: one of ``torchdist_ext.pipeline.SCHEDULES``.
        num_microbatches: micro-batches per step (with ``pp_mesh``; the batch rows divisible by it).
        virtual_stages: stages per rank for "interleaved-1f1b".
        meshes: every mesh at once, from ``ParallelDims(...).build_meshes(...)`` (then tp_mesh, dp_mesh, cp_mesh
            and pp_mesh stay None): its tp, cp (the method its cp_ulysses sets), pp, and FSDP2 over its
            ``fsdp`` mesh, HSDP's 2-D one with dp_replicate > 1; an MoE model's experts over its ``ep`` mesh
            (ep > 1 only for an MoE model).

    All meshes are slices of one ``init_device_mesh`` mesh, dp before cp. Refused with a clear error instead of
    ignored: model types other than ``MODEL_TYPES`` (e.g. Gemma, whose norms scale by 1 + weight), 4-D
    attention masks, attention dropout > 0, ``output_attentions``, sliding-window or soft-capped attention, KV
    caches, ``generate`` on a tensor- or context-parallel model (a data-parallel one generates without a KV
    cache, all ranks in step), ``save_pretrained`` (use ``save_hf_checkpoint``), CP batches that did not come
    from ``shard_hf_batch`` or were cut in another order.
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
    _check_moe(model.config, decoder, meshes if isinstance(meshes, ParallelMeshes) else None, fp8=fp8,
               pp_mesh=pp_mesh, compile=compile)
    if meshes is not None:
        derived = _from_parallel_meshes(meshes, cp_method, tp_mesh=tp_mesh, dp_mesh=dp_mesh, cp_mesh=cp_mesh,
                                        pp_mesh=pp_mesh)
        tp_mesh, cp_mesh, pp_mesh, cp_method = (derived[k] for k in ("tp_mesh", "cp_mesh", "pp_mesh", "cp_method"))
    else:
        _check_one_mesh(tp_mesh=tp_mesh, dp_mesh=dp_mesh, cp_mesh=cp_mesh, pp_mesh=pp_mesh)
    if pp_mesh is None and (num_microbatches is not None or pp_schedule != "1f1b" or virtual_stages != 1):
        raise ValueError(f"num_microbatches={num_microbatches!r}, pp_schedule={pp_schedule!r} and virtual_stages="
                         f"{virtual_stages!r} configure pipeline parallelism, which needs a pp_mesh")
    if cp_method not in CP_METHODS:
        raise ValueError(f"cp_method must be one of {sorted(CP_METHODS)}, got {cp_method!r}")
    check_hf_order(cp_order, "cp_order")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {compile!r}")
    if sequence_parallel and tp_mesh is None:
        raise ValueError("sequence_parallel=True needs a tp_mesh")
    if cp_mesh is not None:
        _, ulysses = context_parallel_groups(cp_mesh)
        if (cp_method == "hybrid") != (ulysses is not None):
            raise ValueError(f"cp_method={cp_method!r} takes a {'2-D [ring, ulysses]' if cp_method == 'hybrid' else '1-D'} "
                             f"cp_mesh, got a {cp_mesh.ndim}-D mesh")
    tp = MeshGroup.of(tp_mesh) if tp_mesh is not None else None
    _check_config(model.config, decoder, tp.size if tp is not None else 1)
    if meshes is not None:
        fsdp_mesh, batch_mesh, amax_mesh = derived["fsdp_mesh"], derived["batch_mesh"], derived["amax_mesh"]
    else:
        fsdp_mesh = batch_mesh = _fsdp_mesh(dp_mesh, cp_mesh)  # (checked before anything changes)
        amax_mesh = _amax_mesh(pp_mesh)
    _check_fp8(fp8, fp8_all_gather, decoder, tp.size if tp is not None else 1, fsdp_mesh is not None)
    if pp_mesh is not None:
        _check_pipeline(model, pp_mesh, pp_schedule, num_microbatches, virtual_stages, fp8, compile, amax_mesh)

    _own_config(model)
    moe_layers = [layer for layer in decoder.layers if is_moe_block(layer.mlp)]
    for layer in moe_layers:
        layer.mlp = HFMoEBlock(moe_from_hf_block(layer.mlp, model.config, ep_mesh=meshes.ep), tp_mesh,
                               sequence_parallel)
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
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    decoder.register_forward_pre_hook(_inputs_hook(cp_mesh, cp_order), with_kwargs=True)
    data_group = None if batch_mesh is None else MeshGroup.of(batch_mesh, "dp_mesh")
    model.loss_function = ParallelCausalLMLoss(tp, tp_mesh, data_group, context_parallel=cp_mesh is not None)

    model._tdx_parallelized = True
    model.save_pretrained = _refuse_save_pretrained
    if tp is not None or cp_mesh is not None:
        model.generate = _refuse_generate
    else:  # without a KV cache; under FSDP2 HF's generate keeps the ranks in step (synced_gpus)
        model.generation_config.use_cache = False
        model._is_fsdp_managed_module = fsdp_mesh is not None  # (read by HF generate: synced_gpus)
    if fp8 is not None:
        convert_to_fp8(decoder.layers, fp8, amax_reduction_mesh=amax_mesh, fp8_all_gather=fp8_all_gather)
    stages = None
    if pp_mesh is not None:
        stages = split_into_stages(model, pp_mesh, pp_schedule, virtual_stages)
        model.forward = refuse_forward
    layers = list(decoder.layers.values() if stages is not None else decoder.layers)  # (this rank's)
    if fsdp_mesh is not None:
        for layer in moe_layers:  # each expert's gradient already sums its ep group's tokens: summed over the rest
            experts = fully_shard(layer.mlp.moe.experts, mesh=meshes.expert_fsdp)
            experts.set_gradient_divide_factor(1.0)
            experts.set_force_sum_reduction_for_comms(True)
        for layer in layers:
            fully_shard(layer, mesh=fsdp_mesh)
        roots = list(stages.values()) if stages is not None else [model]
        for root in roots:
            fully_shard(root, mesh=fsdp_mesh)
        for unit in (*layers, *roots):  # each rank's gradient is its part of the whole batch's: summed
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    if compile:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, fullgraph=True)
    if stages is not None:
        model.pipeline = HFPipeline(stages, pp_mesh=pp_mesh, schedule=pp_schedule, num_microbatches=num_microbatches,
                                    virtual_stages=virtual_stages, tp=tp, tp_mesh=tp_mesh, data_group=data_group,
                                    cp_mesh=cp_mesh, cp_order=cp_order)
    return model
