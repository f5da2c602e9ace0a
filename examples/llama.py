"""A small Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) and its parallelisation.

``Llama`` is a plain single-process ``nn.Module`` built from ``nn.Linear``,
``nn.Embedding`` and ``nn.RMSNorm`` (with ``num_experts`` > 0 each block's FFN
is a mixture of experts written as a plain loop over the experts).
``parallelize_llama`` turns it, in place, into the tensor-parallel (optionally
sequence-parallel) model with the same weights, optionally swaps in a
context-parallel attention and the expert-parallel ``MoE``, then shards it with
FSDP2. The forward code is shared: attention reads its local head count from
the projection's output width and RoPE takes each token's global position, so
one definition serves every layout.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchdist_ext.fp8 import convert_to_fp8
from torchdist_ext.fp8.recipe import Recipe
from torchdist_ext.fp8.state import Fp8State

from torchdist_ext.parallel import (
    ColumnParallelLinear,
    MoE,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    fully_shard_moe,
    trunc_normal_,
    vocab_parallel_cross_entropy,
)
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.recompute import recompute
from torchdist_ext.parallel.regions import gather_from_region, scatter_to_region


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256  # bytes
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    ffn_dim: int = 256
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    num_experts: int = 0  # > 0: every FFN is a mixture of this many experts of width ffn_dim
    top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin ``[seq_len, head_dim / 2]`` of the rotary position embedding."""
    inverse_frequency = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inverse_frequency)
    return angles.cos().float(), angles.sin().float()


def rope_at(cos: Tensor, sin: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The tables' rows at ``positions`` ``[seq]`` (``[seq, head_dim / 2]``, every row alike) or ``[batch, seq]``
    (``[batch, 1, seq, head_dim / 2]``: per row, broadcast over the heads)."""
    if positions.dim() == 2:
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return cos[positions], sin[positions]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates channel pairs (2i, 2i+1) of ``x`` ``[batch, heads, seq, head_dim]`` by position."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None,
                     positions: Tensor | None = None) -> Tensor:
    """Causal attention of q ``[batch, heads, seq, head_dim]`` over k, v ``[batch, kv_heads, seq, head_dim]``;
    with ``document_ids`` ``[batch, seq]`` a query sees only the keys of its own document, and with
    ``positions`` ``[batch, seq]`` (rows in any order) only the keys at or before its position."""
    if document_ids is None and positions is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    seq = q.shape[2]
    if positions is None:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    else:
        mask = positions.unsqueeze(-2) <= positions.unsqueeze(-1)  # [batch, seq (query), seq (key)]
    if document_ids is not None:
        mask = mask & (document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2))
    mask = mask if mask.dim() == 3 else mask.expand(q.shape[0], seq, seq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)


class Attention(nn.Module):
    """Grouped-query causal attention; ``attend`` maps q, k, v ``[batch, heads, seq, head_dim]`` (and the
    tokens' ``document_ids`` and ``positions`` ``[batch, seq]``, when given, as keywords) to the output."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)
        self.attend: Callable[[Tensor, Tensor, Tensor], Tensor] = causal_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        # Under tensor parallelism q/k/v hold this rank's heads; under context parallelism this
        # rank's tokens, whose positions cos/sin (and documents) already follow.
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = {name: t for name, t in (("document_ids", document_ids), ("positions", positions)) if t is not None}
        out = self.attend(q, k, v, **rows)
        return self.wo(out.transpose(1, 2).flatten(-2))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtureOfExperts(nn.Module):
    """The single-process MoE FFN: softmax top-k router, SwiGLU experts, a plain loop over them.

    Tokens are routed in ``groups`` (index tensors into the flattened ``[batch * seq]`` tokens, each in the
    order one parallel rank sees its tokens; default: one group), the capacity ``ceil(c T k / E)`` and the
    kept slots (highest router weight first, ties to the lower token) per group, as ``torchdist_ext``'s
    ``MoE`` does per rank. ``auxiliary`` is the groups' mean of ``aux_loss_coef`` times the load-balancing
    loss, for the trainer to add to the loss it differentiates.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        bound_in, bound_ffn = cfg.dim ** -0.5, cfg.ffn_dim ** -0.5
        self.gate = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim).uniform_(-bound_in, bound_in))
        self.w1 = nn.Parameter(torch.empty(cfg.num_experts, cfg.ffn_dim, cfg.dim).uniform_(-bound_in, bound_in))
        self.w3 = nn.Parameter(torch.empty(cfg.num_experts, cfg.ffn_dim, cfg.dim).uniform_(-bound_in, bound_in))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim, cfg.ffn_dim).uniform_(-bound_ffn, bound_ffn))
        self.groups: list[Tensor] | None = None
        self.auxiliary = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        groups = self.groups or [torch.arange(tokens.shape[0], device=x.device)]
        out, self.auxiliary = torch.zeros_like(tokens), torch.zeros((), device=x.device)
        for group in groups:
            routed, aux = self._route_and_run(tokens[group])
            out = out.index_copy(0, group, routed)
            self.auxiliary = self.auxiliary + self.cfg.aux_loss_coef * aux / len(groups)
        return out.view(x.shape)

    def _route_and_run(self, x: Tensor) -> tuple[Tensor, Tensor]:
        cfg, (num_tokens, _) = self.cfg, x.shape
        probs = (x.float() @ self.gate.float().t()).softmax(-1)
        weights, ids = probs.topk(cfg.top_k, dim=-1)
        if cfg.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = torch.ones_like(ids, dtype=torch.bool)
        if cfg.capacity_factor is not None:
            capacity = math.ceil(cfg.capacity_factor * num_tokens * cfg.top_k / cfg.num_experts)
            for e in range(cfg.num_experts):
                slots = (ids == e).nonzero().tolist()  # (token, j), token order
                slots.sort(key=lambda s: -weights[s[0], s[1]].item())  # stable: ties keep token order
                for t, j in slots[capacity:]:
                    keep[t, j] = False
        out = torch.zeros_like(x)
        for e in range(cfg.num_experts):
            for j in range(cfg.top_k):
                rows = ((ids[:, j] == e) & keep[:, j]).nonzero().squeeze(1)
                if rows.numel():
                    h = x[rows]
                    y = (F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())) @ self.w2[e].t()
                    out = out.index_add(0, rows, (weights[rows, j].unsqueeze(1) * y).to(x.dtype))
        share = torch.zeros(cfg.num_experts, device=x.device).index_add(
            0, ids.flatten(), torch.ones(ids.numel(), device=x.device)) / ids.numel()
        return out, cfg.num_experts * (share * probs.mean(0)).sum()


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MixtureOfExperts(cfg) if cfg.num_experts else FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, document_ids, positions)
        return x + self.feed_forward(self.ffn_norm(x))


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


class Llama(nn.Module):
    """tokens ``[batch, seq]`` -> mean next-token loss against ``target`` ``[batch, seq]``.

    ``positions`` are the tokens' positions in the full sequence (default ``0..seq-1``): ``[seq]`` for RoPE
    alone (a context-parallel rank passes those of its ``shard_sequence`` shard, whose order the attention
    knows), or ``[batch, seq]`` per row, for RoPE and the attention's causal mask (a ``SequencePlan``'s shard).
    ``document_ids`` ``[batch, seq]`` (the documents packed in each row, sharded as the tokens): attention
    stays within a document.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A dict keyed by the block's index: a pipeline stage keeps its blocks under the same names.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.num_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.loss_fn = cross_entropy
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: Tensor, target: Tensor, positions: Tensor | None = None,
                document_ids: Tensor | None = None) -> Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_at(self.rope_cos, self.rope_sin, positions)
        mask_positions = positions if positions.dim() == 2 else None
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, document_ids, mask_positions)
        return self.loss_fn(self.output(self.norm(h)), target)


class LlamaStage(nn.Module):
    """One pipeline stage of ``model``: the blocks of ``layers`` (the same modules, under their names in the
    full model, so checkpoints match), with the embedding on the ``first`` stage and the final norm and
    output head on the ``last``.

    forward: tokens ``[batch, seq]`` (first stage) or the hidden states ``[batch, seq, dim]`` (sharded as
    the blocks pass them on) -> the hidden states, or the logits ``[batch, seq, vocab]`` on the last stage.
    ``positions`` ``[seq]``: the RoPE positions of the step's tokens (set before each step, as for
    ``Llama.forward``), or per row ``[batch, seq]`` as a keyword (a ``SequencePlan``'s, the pipeline's
    ``stage_inputs``, which then also mask the attention); ``document_ids`` ``[batch, seq]``: the
    micro-batch's documents (``stage_inputs`` too); ``loss_fn(logits, target)`` is the model's.
    """

    def __init__(self, model: Llama, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.cfg, self.loss_fn = model.cfg, model.loss_fn
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.positions: Tensor | None = None

    def forward(self, x: Tensor, document_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        if positions is None and self.positions is None:
            raise ValueError("LlamaStage.positions must be set to the step's RoPE positions before the forward")
        cos, sin = rope_at(self.rope_cos, self.rope_sin, self.positions if positions is None else positions)
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x, cos, sin, document_ids, positions)
        return x if self.output is None else self.output(self.norm(x))


def check_layout(cfg: LlamaConfig, tp: int) -> None:
    for name in ("num_heads", "num_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"LlamaConfig.{name}={getattr(cfg, name)} must be divisible by tp={tp}")


class ExpertParallelFeedForward(nn.Module):
    """``MoE`` on the block's tokens. With sequence parallelism the tokens arrive sharded over tp: they are
    gathered first and this rank's block of the output kept (every tp rank runs the same MoE on the same
    tokens, so the expert and router gradients need no reduction over tp)."""

    def __init__(self, moe: MoE, tp: MeshGroup, sequence_parallel: bool):
        super().__init__()
        self.moe, self.tp, self.sequence_parallel = moe, tp, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        if not self.sequence_parallel:
            return self.moe(x)
        return scatter_to_region(self.moe(gather_from_region(x, self.tp, 1)), self.tp, 1)


def apply_tp(model: Llama, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Tensor (and sequence) parallelism, in place: the embedding, every attention projection, the dense
    FFNs' linears, the norms and the output head become our tensor-parallel layers with the same weights, and
    the loss the vocab-parallel cross-entropy. With sequence parallelism the residual stream between blocks is
    sharded along the sequence over tp; the embedding reduce-scatters into it and the column projections
    all-gather out of it inside their GEMM rings."""
    check_layout(model.cfg, tp_mesh.size())
    kw = dict(tp_mesh=tp_mesh, sequence_parallel=sequence_parallel)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding.from_embedding(model.tok_embeddings, **kw)
    for block in model.layers.values():
        attention, ffn = block.attention, block.feed_forward
        for name in ("wq", "wk", "wv"):
            setattr(attention, name, ColumnParallelLinear.from_linear(getattr(attention, name), **kw))
        attention.wo = RowParallelLinear.from_linear(attention.wo, **kw)
        if not isinstance(ffn, MixtureOfExperts):  # experts are apply_ep's
            ffn.w1 = ColumnParallelLinear.from_linear(ffn.w1, **kw)
            ffn.w3 = ColumnParallelLinear.from_linear(ffn.w3, **kw)
            ffn.w2 = RowParallelLinear.from_linear(ffn.w2, **kw)
        block.attention_norm = RMSNorm.from_rms_norm(block.attention_norm, **kw)
        block.ffn_norm = RMSNorm.from_rms_norm(block.ffn_norm, **kw)
    if model.output is not None:
        model.norm = RMSNorm.from_rms_norm(model.norm, **kw)
        model.output = ColumnParallelLinear.from_linear(model.output, **kw)
    # The logits feed nothing but the loss: their gradient can take their memory.
    model.loss_fn = partial(vocab_parallel_cross_entropy, tp_mesh=tp_mesh, inplace_backward=True)


def apply_cp(model: Llama, attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> None:
    """Context parallelism: every block's attention runs ``attend`` (ring, Ulysses or hybrid attention over the
    cp mesh) on the sequence shards the caller feeds. FSDP2's mesh must then span the cp ranks too (they hold
    the same parameters and their gradients are summed)."""
    for block in model.layers.values():
        block.attention.attend = attend


def apply_ep(model: Llama, *, ep_mesh: DeviceMesh, dp_mesh: DeviceMesh, expert_dp_mesh: DeviceMesh | None,
             tp_mesh: DeviceMesh, sequence_parallel: bool, mp_policy: MixedPrecisionPolicy) -> None:
    """Expert parallelism: each block's ``MixtureOfExperts`` becomes the expert-parallel ``MoE`` over ``ep_mesh``
    (ranks of ``dp_mesh`` that see different tokens) with the same weights, its experts sharded by FSDP2 over
    ``expert_dp_mesh`` (the ranks holding the same experts) and its router over ``dp_mesh``."""
    cfg = model.cfg
    for block in model.layers.values():
        ffn = block.feed_forward
        if isinstance(ffn, MixtureOfExperts):
            moe = MoE.from_experts(ffn.gate, ffn.w1, ffn.w3, ffn.w2, ep_mesh=ep_mesh, top_k=cfg.top_k,
                                   capacity_factor=cfg.capacity_factor, aux_loss_coef=cfg.aux_loss_coef)
            fully_shard_moe(moe, dp_mesh=dp_mesh, expert_dp_mesh=expert_dp_mesh, mp_policy=mp_policy)
            block.feed_forward = ExpertParallelFeedForward(moe, MeshGroup.of(tp_mesh), sequence_parallel)


def apply_fp8(model: Llama, recipe: Recipe, *, all_gather: bool, amax_mesh: DeviceMesh | None) -> None:
    """fp8 GEMMs in every linear but the output head (which stays in the activation dtype, as
    TransformerEngine recipes keep it); before FSDP2, so that the shapes it checks are the tensor-parallel
    shards. ``all_gather``: FSDP2 gathers those weights as fp8 bytes (a delayed recipe); ``amax_mesh``: the
    ranks that reduce the amaxes (a pipeline stage's: other stages hold other linears). Call
    ``fp8_step(model)`` after each optimizer step."""
    convert_to_fp8(model, recipe, amax_reduction_mesh=amax_mesh, filter_fn=lambda name, module: name != "output",
                   fp8_all_gather=all_gather)


def apply_recompute_and_compile(model: Llama, recompute_mode: str, compile: bool) -> None:
    """Activation recompute of every block ("none", "selective": keep the communicating ops' and GEMMs'
    outputs, or "full"), then ``torch.compile(fullgraph=True)`` of every block when ``compile``.

    A block with experts is recomputed and compiled around its MoE (norms and attention, each in place, names
    unchanged): the experts and router are FSDP2 units of their own, whose hooks (all-gathers, frees) would run
    inside a checkpoint and again in its rerun, in whatever state FSDP2 is in by then (under 1F1B another
    micro-batch's), and which dynamo runs eagerly, so that a fullgraph graph cannot hold them. The MoE keeps
    its activations; its own work is native ops."""
    for index, block in list(model.layers.items()):
        if isinstance(block.feed_forward, ExpertParallelFeedForward):
            for part in (block.attention_norm, block.attention, block.ffn_norm):
                recompute(part, recompute_mode)
                if compile:
                    part.compile(fullgraph=True)
        else:
            recompute(block, recompute_mode)
            if compile:
                model.layers[index] = torch.compile(block, fullgraph=True)


def apply_fsdp(model: Llama, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """FSDP2 over ``dp_mesh`` (dp x cp), one unit per block and one for the rest, with the mixed-precision
    policy ``mp_policy`` (e.g. bf16 parameters with fp32 gradient reduction)."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def parallelize_llama(model: Llama, *, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh, sequence_parallel: bool,
                      attend: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                      compile: bool = False, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                      ep_mesh: DeviceMesh | None = None, expert_dp_mesh: DeviceMesh | None = None,
                      fp8: Recipe | None = None, fp8_all_gather: bool = False,
                      fp8_amax_mesh: DeviceMesh | None = None, recompute_mode: str = "none") -> nn.Module:
    """Every axis in the order that composes: ``apply_tp``, ``apply_cp`` (with ``attend``), ``apply_ep`` (with
    ``ep_mesh``), ``apply_fp8`` (with a recipe), ``apply_recompute_and_compile``, then ``apply_fsdp``.
    ``model`` is a ``Llama`` or a pipeline stage (``LlamaStage``, whose missing embedding or head is skipped;
    the pipeline itself is the caller's). Each function's docstring says what its axis does."""
    if ep_mesh is None and any(isinstance(b.feed_forward, MixtureOfExperts) for b in model.layers.values()):
        raise ValueError("the model has MixtureOfExperts FFNs: parallelize_llama needs their ep_mesh")
    apply_tp(model, tp_mesh, sequence_parallel)
    if attend is not None:
        apply_cp(model, attend)
    if ep_mesh is not None:
        apply_ep(model, ep_mesh=ep_mesh, dp_mesh=dp_mesh, expert_dp_mesh=expert_dp_mesh, tp_mesh=tp_mesh,
                 sequence_parallel=sequence_parallel, mp_policy=mp_policy)
    if fp8 is not None:
        apply_fp8(model, fp8, all_gather=fp8_all_gather, amax_mesh=fp8_amax_mesh)
    apply_recompute_and_compile(model, recompute_mode, compile)
    return apply_fsdp(model, dp_mesh, mp_policy)


INIT_STD = 0.02  # the projections into the residual stream's blocks; those out of them are scaled by depth


def block_parameters(index: str, block: nn.Module) -> dict[str, tuple[nn.Parameter, float | None]]:
    """A block's parameters by their name in ``Llama`` (``layers.<index>.…``), in any of its forms (plain,
    tensor-parallel, expert-parallel, compiled), each with its init std (None: ones): torchtitan's Llama
    init, the projections out of a block at 0.02 / sqrt(2 (layer + 1))."""
    depth_std = INIT_STD / (2 * (int(index) + 1)) ** 0.5
    attention, ffn = block.attention, block.feed_forward
    named = {f"attention.{name}.weight": (getattr(attention, name).weight, INIT_STD) for name in ("wq", "wk", "wv")}
    named["attention.wo.weight"] = (attention.wo.weight, depth_std)
    if isinstance(ffn, FeedForward):
        named.update({"feed_forward.w1.weight": (ffn.w1.weight, INIT_STD),
                      "feed_forward.w3.weight": (ffn.w3.weight, depth_std),
                      "feed_forward.w2.weight": (ffn.w2.weight, depth_std)})
    else:  # MixtureOfExperts, or ExpertParallelFeedForward's MoE (the same shapes)
        gate, experts = (ffn.gate, ffn) if isinstance(ffn, MixtureOfExperts) else (ffn.moe.gate, ffn.moe.experts)
        named.update({"feed_forward.gate": (gate, INIT_STD), "feed_forward.w1": (experts.w1, INIT_STD),
                      "feed_forward.w3": (experts.w3, depth_std), "feed_forward.w2": (experts.w2, depth_std)})
    named["attention_norm.weight"] = (block.attention_norm.weight, None)
    named["ffn_norm.weight"] = (block.ffn_norm.weight, None)
    return {f"layers.{index}.{name}": value for name, value in named.items()}


def init_weights(model: "Llama | LlamaStage", seed: int) -> None:
    """Initialises ``model`` in place, in whatever layout it is (parallelised, a pipeline stage, compiled):
    truncated normals keyed by each parameter's name in ``Llama`` (``torchdist_ext.parallel.trunc_normal_``),
    so that every rank's shard holds what ``Llama`` initialised whole in one process holds there; the
    embedding N(0, 1), the head N(0, 1 / dim), both cut at 3 std; norms one; the rotary tables; fp8 states
    reset. For a model built on the meta device, after ``to_empty``."""
    cfg = model.cfg
    named = {}
    for index, block in model.layers.items():
        named.update(block_parameters(index, block))
    with torch.no_grad():
        for name, (parameter, std) in named.items():
            if std is None:
                parameter.fill_(1.0)
            else:
                trunc_normal_(parameter, key=name, seed=seed, std=std)
        if model.tok_embeddings is not None:
            trunc_normal_(model.tok_embeddings.weight, key="tok_embeddings.weight", seed=seed, a=-3.0, b=3.0)
        if model.output is not None:
            model.norm.weight.fill_(1.0)
            head_std = cfg.dim ** -0.5
            trunc_normal_(model.output.weight, key="output.weight", seed=seed, std=head_std, a=-3 * head_std,
                          b=3 * head_std)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    for module in model.modules():
        if isinstance(module, Fp8State) and module.fp8_recipe is not None:
            module.reset_fp8_state()

