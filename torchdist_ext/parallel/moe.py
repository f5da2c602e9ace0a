"""Mixture of experts over an expert-parallel mesh (``MoE``: router, capacity, token exchange, grouped expert
GEMMs) and its FSDP2 sharding (``fully_shard_moe``).

    moe = MoE(dim, ffn_dim, num_experts=64, top_k=2, ep_mesh=mesh["ep"], aux_loss_coef=0.01)
    out = moe(x)                                       # x [..., dim] -> [..., dim]
    fully_shard_moe(moe, dp_mesh=dp_mesh, expert_dp_mesh=expert_dp_mesh)

Design (the ep ranks, one message per rank, capacity against Megatron's and GShard's): docs/architecture.md.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from torchdist_ext import ops
from torchdist_ext.agreement import collective_device, check_agreement
from torchdist_ext.parallel.input_checks import check_features, check_floating_dtype, check_floating_input
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.parameters import distribute_parameter

__all__ = ["GroupedExperts", "MoE", "fully_shard_moe"]

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
AUX_LOSSES = ("switch", "sequence")


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on ``out``; in backward also sends gradient 1 into ``loss`` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out, loss):
        ctx.loss_shape = loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_ones(ctx.loss_shape, dtype=torch.float32)


class _ScaleGradient(torch.autograd.Function):
    """Identity in forward; scales the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _positive_int(arg: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{arg} must be a positive int, got {value!r}")


def _check_configuration(ep_size: int, *, dim, ffn_dim, num_experts, top_k, capacity_factor, drop_policy,
                         score_func, norm_topk_prob, routed_scaling_factor, n_group, topk_group,
                         score_correction_bias, aux_loss, aux_loss_coef, z_loss_coef, num_shared_experts,
                         shared_expert_gate, dtype) -> None:
    """Raises ValueError / TypeError for an MoE argument out of its documented range."""
    for arg, value in (("dim", dim), ("ffn_dim", ffn_dim), ("num_experts", num_experts)):
        _positive_int(arg, value)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or
                                        not isinstance(capacity_factor, (int, float)) or
                                        not capacity_factor > 0 or not math.isfinite(capacity_factor)):
        raise ValueError(f"capacity_factor must be None (dropless) or a positive number, got {capacity_factor!r}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    for arg, value in (("norm_topk_prob", norm_topk_prob), ("score_correction_bias", score_correction_bias),
                       ("shared_expert_gate", shared_expert_gate)):
        if not isinstance(value, bool) and not (arg == "norm_topk_prob" and value is None):
            raise TypeError(f"{arg} must be a bool{' or None' if arg == 'norm_topk_prob' else ''}, got {value!r}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a number, got {routed_scaling_factor!r}")
    if not routed_scaling_factor > 0 or not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor must be a positive number, got {routed_scaling_factor!r}")
    _positive_int("n_group", n_group)
    if num_experts % n_group or (n_group > 1 and num_experts // n_group < 2):
        raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} into groups of at least 2 "
                         f"experts (a group scores by its top two)")
    if not isinstance(topk_group, int) or isinstance(topk_group, bool) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k={top_k} must not exceed the experts of topk_group={topk_group} groups of "
                         f"{num_experts // n_group}")
    if shared_expert_gate and not num_shared_experts:
        raise ValueError("shared_expert_gate=True needs shared experts (num_shared_experts >= 1)")
    for arg, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{arg} must be a number >= 0, got {value!r}")
    if aux_loss is not None and aux_loss not in AUX_LOSSES:
        raise ValueError(f"aux_loss must be one of {AUX_LOSSES} or None, got {aux_loss!r}")
    if aux_loss is None and aux_loss_coef:
        raise ValueError(f"aux_loss=None computes no load-balancing loss, but aux_loss_coef={aux_loss_coef!r}; "
                         "pass aux_loss_coef=0 or an aux_loss")
    if not isinstance(num_shared_experts, int) or isinstance(num_shared_experts, bool) or num_shared_experts < 0:
        raise ValueError(f"num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
    check_floating_dtype(dtype)
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel size {ep_size}")


class GroupedExperts(nn.Module):
    """The experts this rank holds, as stacked weights ``w1``, ``w3`` ``[E, ffn, dim]``, ``w2`` ``[E, dim, ffn]``
    (DTensors ``Shard(0)`` on the ep mesh; a module of its own, so that FSDP2 can shard it over the ranks that
    hold the same experts and gather it around its forward).

    ``forward(rows, offsets, per_expert, capacity)``: ``rows [A, dim]`` expert-major (``tdx::moe_permute``'s
    order) -> each row through its expert's SwiGLU. Dropless (``capacity=-1``): expert e's rows end at
    ``offsets[e]``, ``per_expert[e]`` of them (host), out ``[A, dim]``; with a capacity, ``capacity`` rows each,
    out ``[experts, capacity, dim]``.

    ``gradient_scale`` multiplies the weights' gradients (``fully_shard_moe`` sets it).

    Args:
        w1: Parameter ``[E, ffn, dim]``, a DTensor ``Shard(0)`` on the ep mesh: each expert's gate projection
            (the one inside ``silu``).
        w3: Parameter like ``w1``: each expert's up projection.
        w2: Parameter ``[E, dim, ffn]``, a DTensor ``Shard(0)`` on the ep mesh: each expert's down projection.
    """

    def __init__(self, w1: nn.Parameter, w3: nn.Parameter, w2: nn.Parameter):
        super().__init__()
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.gradient_scale = 1.0

    def forward(self, rows: Tensor, offsets: Tensor, per_expert: Tensor, capacity: int) -> Tensor:
        w1, w3, w2 = (w.to_local() for w in (self.w1, self.w3, self.w2))
        if self.gradient_scale != 1.0:
            w1, w3, w2 = (_ScaleGradient.apply(w, self.gradient_scale) for w in (w1, w3, w2))
        if capacity < 0:
            hidden = F.silu(_grouped_mm(rows, w1, offsets, per_expert)) * _grouped_mm(rows, w3, offsets, per_expert)
            return _grouped_mm(hidden, w2, offsets, per_expert)
        batch = rows.view(w1.shape[0], capacity, rows.shape[1])
        hidden = F.silu(torch.bmm(batch, w1.transpose(1, 2))) * torch.bmm(batch, w3.transpose(1, 2))
        return torch.bmm(hidden, w2.transpose(1, 2))


class MoE(nn.Module):
    """SwiGLU experts ``w2(silu(w1 x) * w3 x)`` split over ``ep_mesh``, behind a top-k router.

    Each rank routes its own tokens (the router runs in fp32) and sends every token once to each rank holding one
    of its chosen experts; that rank runs its local experts on the received rows sorted expert-major (one
    grouped GEMM per projection), and each token's expert outputs come back weighted by the router in fp32 and
    summed in rank order: the same result run to run.

    Args:
        dim: the model width (the input's last dim).
        ffn_dim: each expert's hidden width.
        num_experts: E, divisible by the size of ``ep_mesh``.
        top_k: k, experts per token, in [1, E].
        ep_mesh: 1-D DeviceMesh of the expert-parallel group (its ranks see different tokens).
        capacity_factor: None: dropless (one small count tensor goes to the host per layer). A positive ``c``:
            each (source rank, expert) pair keeps at most ``C = ceil(c * T * k / E)`` of its slots, T the most
            tokens any ep rank holds (one all-reduce of one number per call; under torch.compile the local
            count, which must then be equal on the ep ranks), with static shapes in the exchange. A dropped slot
            contributes 0 (the residual stream carries the token); the kept slots keep their weights (no
            renormalisation).
        drop_policy: which slots a capacity keeps: "probs" the highest router weights, "position" the earliest
            tokens; ties go to the lower token index.
        score_func: "softmax": softmax over the E experts (Mixtral, Qwen-MoE); "sigmoid" (DeepSeek-V3):
            independent sigmoid scores. Top-k picks the k highest scores (plus the correction bias, in the
            groups allowed); a token's weights are its k scores, normalised as ``norm_topk_prob`` says, times
            ``routed_scaling_factor``.
        norm_topk_prob: whether the k weights are divided by their sum. None: softmax normalises when k > 1
            (k = 1 keeps the probability, as Switch does), sigmoid always. Mixtral normalises; Qwen2-MoE's and
            Qwen3-MoE's configs say (``norm_topk_prob``, default False); DeepSeek-V3's is True.
        routed_scaling_factor: multiplies the routed experts' weights (DeepSeek-V3: 2.5), after normalising.
        n_group, topk_group: group-limited routing (DeepSeek-V3, node-limited: 8 groups, 4 kept): the E experts
            in ``n_group`` groups of consecutive experts, each scored by the sum of its two highest scores
            (with the bias), and a token's top-k taken among the experts of its ``topk_group`` best groups.
        score_correction_bias: a per-expert bias ``e_score_correction_bias`` (fp32 buffer, saved with the model)
            added to the scores for choosing the experts, not for weighting them: DeepSeek-V3's auxiliary-loss-free
            balancing, which ``update_correction_bias`` moves after each step.
        aux_loss: the load-balancing loss ``E * sum_e f_e P_e``: f_e the share of the top-k slots (before
            dropping) that chose e, P_e the mean of e's routing probability (softmax probabilities; sigmoid
            scores divided by their sum over E). "switch" (Switch Transformer): over all of this rank's tokens;
            "sequence" (DeepSeek-V3's complementary sequence-wise loss, section 2.1.2): over each sequence
            (dim -2 of the input ``[..., seq, dim]``) on its own, averaged over the sequences; None: none
            (``last_aux_loss`` stays None).
        aux_loss_coef: its weight (>= 0; 0 with ``aux_loss=None``).
        z_loss_coef: weight (>= 0) of the router z-loss ``mean(logsumexp(logits)^2)``.
        num_shared_experts: S: a dense SwiGLU of width ``S * ffn_dim`` on every token, added (0: none).
        shared_expert_gate: the shared experts' output scaled by ``sigmoid(x . shared_gate)``, a token's own
            gate (Qwen2-MoE's ``shared_expert_gate``; parameter ``shared_gate [1, dim]``).
        device: where the parameters are created ("meta": left uninitialised).
        dtype: the parameters' floating dtype.

    Both auxiliary losses are computed on this rank's tokens and add their gradient in backward without
    appearing in the user's loss; ``last_aux_loss``, ``last_z_loss`` (unweighted) and ``last_tokens_per_expert``
    (this rank's kept slots per expert) hold the last forward's values, detached.

    Shapes: input ``[..., dim]`` (any leading dims) -> output of the same shape.
    Parameters: ``experts.w1``, ``experts.w3`` ``[E, ffn_dim, dim]`` and ``experts.w2`` ``[E, dim, ffn_dim]``
    DTensors ``Shard(0)`` on ``ep_mesh`` (rank r holds experts r*E/ep .. (r+1)*E/ep - 1); ``gate`` ``[E, dim]``
    and the shared experts' ``shared_w1``, ``shared_w3`` ``[S*ffn, dim]``, ``shared_w2`` ``[dim, S*ffn]`` plain
    parameters, equal on the ranks of ``ep_mesh``. With FSDP2, shard ``experts`` over the ranks that hold the
    same experts and the rest over the whole data-parallel mesh (``fully_shard_moe``).
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, *, top_k: int = 2, ep_mesh: DeviceMesh,
                 capacity_factor: float | None = None, drop_policy: str = "probs", score_func: str = "softmax",
                 norm_topk_prob: bool | None = None, routed_scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int = 1, score_correction_bias: bool = False, aux_loss: str | None = "switch",
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, num_shared_experts: int = 0,
                 shared_expert_gate: bool = False, device=None, dtype=None):
        super().__init__()
        self.ep = MeshGroup.of(ep_mesh, "ep_mesh")
        configuration = dict(dim=dim, ffn_dim=ffn_dim, num_experts=num_experts, top_k=top_k,
                             capacity_factor=capacity_factor, drop_policy=drop_policy, score_func=score_func,
                             norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                             n_group=n_group, topk_group=topk_group, score_correction_bias=score_correction_bias,
                             aux_loss=aux_loss, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef,
                             num_shared_experts=num_shared_experts, shared_expert_gate=shared_expert_gate,
                             dtype=dtype)
        # Every ep rank refuses, or none does: the ranks then exchange the weights' first draw.
        check_agreement(self.ep.mesh.get_group(), "MoE", configuration,
                        lambda: _check_configuration(self.ep.size, **configuration))
        self.dim, self.ffn_dim, self.num_experts, self.top_k = dim, ffn_dim, num_experts, top_k
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.drop_policy, self.score_func = drop_policy, score_func
        self.norm_topk_prob = (score_func == "sigmoid" or top_k > 1) if norm_topk_prob is None else norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group, self.topk_group = n_group, topk_group
        self.aux_loss, self.aux_loss_coef, self.z_loss_coef = aux_loss, float(aux_loss_coef), float(z_loss_coef)
        self.num_shared_experts = num_shared_experts
        factory = dict(device=device, dtype=dtype)

        def linear_weights(experts: int, out_features: int, in_features: int) -> Tensor:
            """Weights drawn as nn.Linear draws them (uniform, bound 1/sqrt(in)), one matrix per expert."""
            weight = torch.empty(experts, out_features, in_features, **factory)
            if not weight.is_meta:
                bound = 1 / math.sqrt(in_features)
                nn.init.uniform_(weight, -bound, bound)
            return weight

        # Every rank starts from ep rank 0's draw, as one process would.
        self.gate = nn.Parameter(self._from_first_rank(linear_weights(1, num_experts, dim)[0]))
        self.experts = GroupedExperts(*(distribute_parameter(linear_weights(num_experts, *shape), self.ep, Shard(0),
                                                             src_data_rank=0)
                                        for shape in ((ffn_dim, dim), (ffn_dim, dim), (dim, ffn_dim))))
        if num_shared_experts:
            width = num_shared_experts * ffn_dim
            self.shared_w1 = nn.Parameter(self._from_first_rank(linear_weights(1, width, dim)[0]))
            self.shared_w3 = nn.Parameter(self._from_first_rank(linear_weights(1, width, dim)[0]))
            self.shared_w2 = nn.Parameter(self._from_first_rank(linear_weights(1, dim, width)[0]))
        self.shared_gate = (nn.Parameter(self._from_first_rank(linear_weights(1, 1, dim)[0]))
                            if shared_expert_gate else None)
        # The bias and the routed load since the last update_correction_bias (not saved).
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if score_correction_bias else None)
        self.register_buffer("routed_load", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if score_correction_bias else None, persistent=False)
        self.last_aux_loss: Tensor | None = None
        self.last_z_loss: Tensor | None = None
        self.last_tokens_per_expert: Tensor | None = None

    def _from_first_rank(self, tensor: Tensor) -> Tensor:
        if not tensor.is_meta and self.ep.size > 1:
            dist.broadcast(tensor, group=self.ep.mesh.get_group(), group_src=0)
        return tensor

    @classmethod
    def from_experts(cls, gate: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, *, ep_mesh: DeviceMesh,
                     shared: tuple[Tensor, Tensor, Tensor] | None = None, shared_gate: Tensor | None = None,
                     correction_bias: Tensor | None = None, **kwargs) -> "MoE":
        """The layer holding the full weights of a single-process MoE (every rank passes the same tensors):
        ``gate [E, dim]``, ``w1``/``w3 [E, ffn, dim]``, ``w2 [E, dim, ffn]``, ``shared`` =
        ``(w1 [S*ffn, dim], w3 [S*ffn, dim], w2 [dim, S*ffn])`` for ``num_shared_experts = S``, its
        ``shared_gate [1, dim]`` (``shared_expert_gate=True``) and the ``correction_bias [E]``
        (``score_correction_bias=True``)."""
        if not (isinstance(gate, Tensor) and gate.dim() == 2):
            raise ValueError(f"gate must be an [E, dim] tensor, got {getattr(gate, 'shape', type(gate))}")
        num_experts, dim = gate.shape
        if not (w1.dim() == 3 and w1.shape[0] == num_experts and w1.shape[2] == dim and w3.shape == w1.shape
                and w2.shape == (num_experts, dim, w1.shape[1])):
            raise ValueError(
                f"w1, w3 must be [E={num_experts}, ffn, dim={dim}] and w2 [E, dim, ffn]; got {tuple(w1.shape)}, "
                f"{tuple(w3.shape)}, {tuple(w2.shape)}"
            )
        ffn_dim = w1.shape[1]
        num_shared = 0
        if shared is not None:
            if len(shared) != 3 or shared[0].shape[0] % ffn_dim:
                raise ValueError(f"shared must be (w1, w3, w2) with w1 [S*{ffn_dim}, {dim}]")
            num_shared = shared[0].shape[0] // ffn_dim
        if shared_gate is not None and (shared is None or tuple(shared_gate.shape) != (1, dim)):
            raise ValueError(f"shared_gate must be a [1, dim={dim}] tensor beside shared experts, got "
                             f"{tuple(shared_gate.shape)}{'' if shared is not None else ' without shared experts'}")
        if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
            raise ValueError(f"correction_bias must be a [E={num_experts}] tensor, got {tuple(correction_bias.shape)}")
        layer = cls(dim, ffn_dim, num_experts, ep_mesh=ep_mesh, num_shared_experts=num_shared, device="meta",
                    dtype=gate.dtype, shared_expert_gate=shared_gate is not None,
                    score_correction_bias=correction_bias is not None, **kwargs)
        layer.gate = nn.Parameter(gate.detach().clone())
        layer.experts = GroupedExperts(*(distribute_parameter(full.detach(), layer.ep, Shard(0), src_data_rank=None)
                                         for full in (w1, w3, w2)))
        if shared is not None:
            for name, full in zip(("shared_w1", "shared_w3", "shared_w2"), shared):
                setattr(layer, name, nn.Parameter(full.detach().clone()))
        if shared_gate is not None:
            layer.shared_gate = nn.Parameter(shared_gate.detach().clone())
        if correction_bias is not None:
            layer.e_score_correction_bias = correction_bias.detach().to(torch.float32).clone()
            layer.routed_load = torch.zeros(num_experts, dtype=torch.float32, device=correction_bias.device)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        def validate():
            check_floating_input(x, "input", self.gate.dtype)
            check_features(x, "input", self.dim, "dim")
            if self.aux_loss == "sequence" and x.dim() < 3:
                raise ValueError(f"aux_loss='sequence' balances each sequence: the input must be [..., seq, dim], "
                                 f"got shape {tuple(x.shape)}")

        # every ep rank learns of one rank's bad input before the exchanges
        check_agreement(self.ep.name, "MoE.forward",
                        lambda: {"input dtype": x.dtype, "input features": x.shape[-1]}, validate)
        tokens = x.reshape(-1, self.dim)
        capacity = -1 if self.capacity_factor is None else self._capacity(tokens)
        expert_ids, weights, auxiliary = self._route(tokens, capacity, x.shape[-2] if x.dim() >= 3 else 1)
        out = self._experts(tokens, expert_ids, weights, auxiliary, x.shape[:-1], capacity)  # [..., dim], not a view
        if self.num_shared_experts:
            shared = F.linear(F.silu(F.linear(x, self.shared_w1)) * F.linear(x, self.shared_w3), self.shared_w2)
            if self.shared_gate is not None:
                shared = F.linear(x, self.shared_gate).sigmoid() * shared
            out = out + shared
        return out

    def _route(self, tokens: Tensor, capacity: int, seq_len: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """(expert_ids [T, k] int64, -1 where dropped; weights [T, k] in the accumulator type; the weighted
        auxiliary losses when they have a gradient to add, else None). ``tokens`` are sequences of
        ``seq_len``."""
        logits = F.linear(tokens.float(), self.gate.float())  # NaN here: moe_dispatch refuses it on every rank
        if self.score_func == "softmax":
            scores = logits.softmax(-1)
            distribution = scores
        else:
            scores = logits.sigmoid()
            distribution = scores / scores.sum(-1, keepdim=True)
        top_ids = self._choose(scores.detach())
        weights = scores.gather(1, top_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        if self.routed_load is not None and torch.is_grad_enabled():  # training forwards
            self.routed_load.scatter_add_(0, top_ids.flatten(), torch.ones(top_ids.numel(), device=top_ids.device))
        auxiliary = self._losses(logits, distribution, top_ids, seq_len)
        kept = top_ids if capacity < 0 else self._drop_over_capacity(top_ids, weights, capacity)
        self.last_tokens_per_expert = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=kept.device)
        self.last_tokens_per_expert.scatter_add_(0, torch.where(kept >= 0, kept, self.num_experts).flatten(),
                                                 torch.ones_like(kept).flatten())
        self.last_tokens_per_expert = self.last_tokens_per_expert[: self.num_experts]
        acc = torch.float64 if tokens.dtype == torch.float64 else torch.float32
        return kept, weights.to(acc), auxiliary

    def _choose(self, scores: Tensor) -> Tensor:
        """Each token's top-k experts ``[T, k]`` by ``scores [T, E]`` plus the correction bias, among the experts
        of its ``topk_group`` best groups (each scored by its two best) when ``n_group > 1``."""
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view_as(choice)
        return choice.topk(self.top_k, dim=-1).indices

    def _apply(self, fn, recurse=True):
        """``to``, ``cuda``, ``to_empty``... move the correction bias and the running load but keep them fp32 (a
        count in 16 bits stops at 256), and a bias that had no storage (meta) starts at 0."""
        kept = {name: getattr(self, name) for name in ("e_score_correction_bias", "routed_load")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if after is None:
                continue
            if before.is_meta:
                setattr(self, name, torch.zeros_like(after, dtype=torch.float32))
            elif after.dtype != torch.float32:
                setattr(self, name, before.to(device=after.device))
        return self

    @torch.no_grad()
    def update_correction_bias(self, rate: float, *, group: dist.ProcessGroup) -> Tensor:
        """DeepSeek-V3's auxiliary-loss-free balancing (section 2.1.2): after a step, each expert's
        ``e_score_correction_bias`` moves by ``rate * sign(mean load - its load)``, the loads being the routed
        (token, expert) slots of every forward with autograd since the last update (micro-batches included),
        summed over ``group``: every rank that routes tokens with these experts, data-parallel and
        expert-parallel ranks alike (with FSDP2, ``fully_shard_moe``'s ``dp_mesh``), so that every replica's
        bias moves alike. A forward rerun by activation recompute counts again (with every forward rerun alike,
        the signs are unchanged). Collective over ``group``; returns the summed loads ``[E]``."""

        def validate():
            if self.e_score_correction_bias is None:
                raise ValueError("update_correction_bias needs score_correction_bias=True")
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 or not math.isfinite(rate):
                raise ValueError(f"rate must be a positive number, got {rate!r}")

        check_agreement(group, "MoE.update_correction_bias", lambda: {"rate": repr(rate)}, validate)
        load = self.routed_load.to(collective_device(group), copy=True)
        dist.all_reduce(load, group=group)
        load = load.to(self.routed_load.device)
        self.e_score_correction_bias += rate * torch.sign(load.mean() - load).to(self.e_score_correction_bias.device)
        self.routed_load.zero_()
        return load

    def _losses(self, logits: Tensor, distribution: Tensor, top_ids: Tensor, seq_len: int) -> Tensor | None:
        """Records the load-balancing and z losses of this rank's tokens (sequences of ``seq_len``); returns their
        weighted sum when it has a gradient to add (a coefficient > 0 and autograd on)."""
        z = logits.logsumexp(-1).square().mean()
        aux = None if self.aux_loss is None else self._balance_loss(distribution, top_ids, seq_len)
        self.last_aux_loss, self.last_z_loss = None if aux is None else aux.detach(), z.detach()
        if not (self.aux_loss_coef or self.z_loss_coef) or not logits.requires_grad:
            return None
        return self.z_loss_coef * z if aux is None else self.aux_loss_coef * aux + self.z_loss_coef * z

    def _balance_loss(self, distribution: Tensor, top_ids: Tensor, seq_len: int) -> Tensor:
        """``E * sum_e f_e P_e`` over this rank's tokens ("switch"), or over each sequence of ``seq_len`` tokens
        and averaged ("sequence")."""
        rows = 1 if self.aux_loss == "switch" else top_ids.shape[0] // seq_len
        per_row = top_ids.shape[0] // max(1, rows)
        slots = torch.zeros(rows, self.num_experts, dtype=torch.float32, device=top_ids.device)
        slots.scatter_add_(1, top_ids.reshape(rows, -1), torch.ones(rows, per_row * self.top_k, device=top_ids.device))
        share = slots / max(1, per_row * self.top_k)
        probability = distribution.reshape(rows, per_row, self.num_experts).mean(1)
        return self.num_experts * (share * probability).sum(-1).mean()

    def _capacity(self, tokens: Tensor) -> int:
        """C = ceil(c * T * k / E) for ``tokens [T_local, dim]``, T the most tokens any ep rank holds (one
        all-reduce of one number over the ep group, on the host for a group with a CPU backend, so that ranks
        holding different token counts agree on the exchange's sizes). Under torch.compile T is this rank's
        count: the ranks must hold equal counts (moe_dispatch's agreement check refuses others while it runs)."""
        num_tokens = tokens.shape[0]
        if self.ep.size > 1 and not torch.compiler.is_compiling():
            group = self.ep.mesh.get_group()
            most = torch.tensor([num_tokens], dtype=torch.int64,
                                device="cpu" if collective_device(group) == "cpu" else tokens.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
            num_tokens = int(most.item())
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def _drop_over_capacity(self, top_ids: Tensor, weights: Tensor, capacity: int) -> Tensor:
        """top_ids with the slots past each expert's ``capacity`` set to -1 (the documented rule)."""
        num_tokens, k = top_ids.shape
        experts = top_ids.flatten()
        order = torch.arange(experts.numel(), device=experts.device)  # token-major: lower token first
        if self.drop_policy == "probs":
            order = torch.sort(-weights.flatten(), stable=True).indices
        order = order[torch.sort(experts[order], stable=True).indices]  # expert-major, policy order inside
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=experts.device)
        counts.scatter_add_(0, experts, torch.ones_like(experts))
        starts = counts.cumsum(0) - counts
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device) - starts[experts[order]]
        return torch.where(rank < capacity, experts, -1).view(num_tokens, k)

    def _experts(self, tokens: Tensor, expert_ids: Tensor, weights: Tensor, auxiliary: Tensor | None,
                 token_shape: torch.Size, capacity: int) -> Tensor:
        n, local = self.ep.size, self.num_experts // self.ep.size
        dropless = capacity < 0
        rows_per_rank = -1 if dropless else capacity * local
        rows, row_ids, row_weights, counts = ops.moe_dispatch(tokens, expert_ids, weights, self.num_experts,
                                                              rows_per_rank, self.ep.name)
        per_expert = counts[1, :, 1:].sum(0) if dropless else counts.new_empty(0)
        expert_capacity = -1 if dropless else n * capacity  # each source sends an expert at most `capacity`
        sorted_rows, positions, offsets = ops.moe_permute(rows, row_ids, per_expert, local, expert_capacity)
        expert_out = self.experts(sorted_rows, offsets, per_expert, expert_capacity)
        out_rows = ops.moe_unpermute(expert_out, positions, row_weights)
        if auxiliary is not None:  # its gradient joins whenever the expert outputs' does
            out_rows = _AddAuxiliaryLoss.apply(out_rows, auxiliary)
        out, _ = ops.moe_combine(out_rows, None, expert_ids.view(*token_shape, self.top_k), counts, self.num_experts,
                                 rows_per_rank, self.ep.name)
        return out

    def extra_repr(self) -> str:
        capacity = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return (f"dim={self.dim}, ffn_dim={self.ffn_dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"ep={self.ep.size}, {capacity}, score_func={self.score_func}, norm_topk_prob={self.norm_topk_prob}"
                f"{f', routed_scaling_factor={self.routed_scaling_factor:g}' if self.routed_scaling_factor != 1 else ''}"
                f"{f', n_group={self.n_group}, topk_group={self.topk_group}' if self.n_group > 1 else ''}"
                f"{', score_correction_bias' if self.e_score_correction_bias is not None else ''}, "
                f"num_shared_experts={self.num_shared_experts}"
                f"{', shared_expert_gate' if self.shared_gate is not None else ''}")


def _grouped_mm(rows: Tensor, weight: Tensor, offsets: Tensor, per_expert: Tensor) -> Tensor:
    """``rows`` (expert-major, expert e's rows ending at ``offsets[e]``, ``per_expert[e]`` of them on the host)
    times each expert's ``weight[e].T``: ``torch._grouped_mm`` on a GPU in 16-bit with 16-byte aligned widths,
    else ``tdx::moe_grouped_mm`` (one GEMM per expert; torch._grouped_mm does not trace on the CPU)."""
    aligned = all((size * rows.element_size()) % 16 == 0 for size in (weight.shape[1], weight.shape[2]))
    if rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float16) and aligned and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    return ops.moe_grouped_mm(rows, weight, per_expert)


def fully_shard_moe(moe: MoE, *, dp_mesh: DeviceMesh, expert_dp_mesh: DeviceMesh, **fsdp_kwargs) -> MoE:
    """FSDP2 for an MoE whose ``ep_mesh`` is carved out of the data-parallel ranks (as torchtitan and
    Megatron do): ``experts`` sharded over ``expert_dp_mesh`` (the ranks holding the same experts), the
    router and shared experts over ``dp_mesh`` (all data-parallel ranks). An expert's gradient on a rank
    already sums the tokens of its whole ep group, so it is scaled by 1/ep in backward: FSDP's mean over
    ``expert_dp_mesh`` then gives the mean over all data-parallel ranks (with no custom reduce op, which gloo
    lacks, and also when ``expert_dp_mesh`` has one rank and FSDP reduces nothing). ``fsdp_kwargs`` (e.g.
    ``mp_policy``) go to both ``fully_shard`` calls; the caller shards the enclosing modules as usual.
    """
    from torch.distributed.fsdp import fully_shard

    if expert_dp_mesh.size() * moe.ep.size != dp_mesh.size():
        raise ValueError(
            f"expert_dp_mesh ({expert_dp_mesh.size()} ranks) x ep ({moe.ep.size}) must make up dp_mesh "
            f"({dp_mesh.size()} ranks)"
        )
    moe.experts.gradient_scale = 1.0 / moe.ep.size
    fully_shard(moe.experts, mesh=expert_dp_mesh, **fsdp_kwargs)
    return fully_shard(moe, mesh=dp_mesh, **fsdp_kwargs)
