"""``Fp8Linear``: ``nn.Linear`` whose three GEMMs run in fp8 (``fp8.gemm.scaled_mm``).

Forward: the input and the weight are cast to e4m3 (``tdx::fp8_cast_amax``: one read each, their amaxes
recorded; ``tdx::fp8_cast_transpose_amax`` also writes the transposed copy the backward's GEMMs take, from
the same read), ``y = (x_fp8 @ w_fp8.T) / (scale_x * scale_w) + bias`` in the input's dtype. Backward: the output
gradient is cast to e5m2 (``"hybrid"``) or e4m3, then ``grad_x = g_fp8 @ w_fp8`` and
``grad_w = g_fp8.T @ x_fp8``, each in fp8 with the product of the inverse scales; the bias gradient is the
sum of the output gradient in its own dtype.

State (buffers, in the state_dict): ``amax_history [L, 3]`` and ``scale [3]`` (fp32), for the roles input,
weight and grad_output in that order. Under ``DelayedScaling`` every cast uses ``scale`` as it stands and
folds its amax into row 0 of the history (a running max over the step's casts, micro-batches included);
``fp8_step`` turns the history into new scales once per optimizer step. Under ``CurrentScaling`` each cast
computes its scale from its own amax and the buffers record nothing.
"""

import torch
from torch import Tensor, nn

from torchdist_ext.fp8.fsdp import GatheredFp8Weight
from torchdist_ext.fp8.gemm import scaled_mm
from torchdist_ext.fp8.blockwise import blockwise_fp8_linear
from torchdist_ext.fp8.recipe import TENSORWISE, CurrentScaling, DelayedScaling, Recipe
from torchdist_ext.fp8.scaling import FP8_MAX, current_scale
from torchdist_ext.fp8.state import Fp8State
from torchdist_ext.ops import all_gather_scaled_mm, fp8_cast_amax, fp8_cast_transpose_amax, scaled_mm_reduce_scatter
from torchdist_ext._weight_grad import SplitsWeightGrad, deferred_weight_grad

__all__ = ["Fp8Linear", "fp8_all_gather_linear", "fp8_linear", "fp8_linear_reduce_scatter", "gathers_fp8"]

_INPUT, _WEIGHT, _GRAD = range(3)


def _cast(x: Tensor, role: int, fp8_dtype: torch.dtype, scale: Tensor, amax_history: Tensor,
          recipe: Recipe) -> tuple[Tensor, Tensor]:
    """(x_fp8, 1 / scale as a 1-element fp32 tensor): the cast of one tensor role under the recipe."""
    x_fp8, _, inverse = _cast_both_orientations(x, role, fp8_dtype, scale, amax_history, recipe, None)
    return x_fp8, inverse


def _cast_both_orientations(x: Tensor, role: int, fp8_dtype: torch.dtype, scale: Tensor, amax_history: Tensor,
                       recipe: Recipe, row_multiple: int | None) -> tuple[Tensor, Tensor | None, Tensor]:
    """(x_fp8, x_fp8_t, 1 / scale): the cast of one tensor role under the recipe and, for a 2-D x with
    ``row_multiple``, its transpose with the rows padded to that multiple (``tdx::fp8_cast_transpose_amax``:
    one read of x; ``x_fp8_t.t()`` is the column-major operand torch._scaled_mm takes), else None."""
    def cast(role_scale):
        if row_multiple is None:
            x_fp8, amax = fp8_cast_amax(x, role_scale, fp8_dtype)
            return x_fp8, None, amax
        return fp8_cast_transpose_amax(x, role_scale, fp8_dtype, row_multiple)

    if isinstance(recipe, CurrentScaling):
        amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
        role_scale = current_scale(amax, FP8_MAX[fp8_dtype], recipe.eps).reshape(1)
        x_fp8, x_fp8_t, _ = cast(role_scale)
        return x_fp8, x_fp8_t, role_scale.reciprocal()
    role_scale = scale[role:role + 1]
    x_fp8, x_fp8_t, amax = cast(role_scale)
    amax_history[0, role] = torch.maximum(amax_history[0, role], amax)
    return x_fp8, x_fp8_t, role_scale.reciprocal()


def _column_major(x_fp8: Tensor) -> Tensor:
    """The same matrix stored column-major (what torch._scaled_mm takes as its second operand)."""
    return x_fp8.t().contiguous().t()


def _rows_padded_to_16(x_fp8: Tensor) -> Tensor:
    """x_fp8 [rows, n] with zero rows appended up to a multiple of 16 rows: the weight gradient's GEMM
    contracts over the rows, and torch._scaled_mm on a GPU takes only multiples of 16 there (zero rows add
    exact zeros to every sum)."""
    missing = -x_fp8.shape[0] % 16
    if missing == 0:
        return x_fp8
    return torch.cat([x_fp8.view(torch.uint8), x_fp8.new_zeros(missing, x_fp8.shape[1], dtype=torch.uint8)]).view(
        x_fp8.dtype)


def _weight_operand(weight: Tensor, scale: Tensor, amax_history: Tensor,
                    recipe: Recipe) -> tuple[Tensor, Tensor | None, Tensor]:
    """(w_fp8 [out, in], its transposed copy or None, 1 / scale): the weight cast to e4m3 with the transposed
    copy the input gradient's GEMM takes. A weight that FSDP2 gathered in fp8 (``GatheredFp8Weight``) is used
    as gathered: it was cast, and its amax recorded, before the all-gather."""
    if isinstance(weight, GatheredFp8Weight):
        return weight._data, None, weight._inverse_scale
    return _cast_both_orientations(weight, _WEIGHT, torch.float8_e4m3fn, scale, amax_history, recipe, 1)


def _save_for_backward(ctx, x_column_major: Tensor, x_inverse: Tensor, w_fp8: Tensor, w_fp8_t: Tensor | None,
                       w_inverse: Tensor, weight: Tensor, has_bias: bool, scale: Tensor, amax_history: Tensor,
                       recipe: Recipe, out_dtype: torch.dtype) -> None:
    """What the backward's GEMMs need, on ctx: ``x_column_major [rows_16, in]`` (the weight gradient's second
    operand) and the weight's ``[out, in]`` column-major operand of the input gradient, from the cast's
    transposed copy where there is one; a weight gathered by FSDP2 is saved as it is (its storage is
    refilled before the backward) and copied there."""
    ctx.w_is_column_major = w_fp8_t is not None
    w_saved = w_fp8_t.t() if w_fp8_t is not None else w_fp8
    # The gradient's scale as it stands now, and the history by reference (not saved: several forwards may
    # run before their backwards, and each cast updates the history in place).
    ctx.save_for_backward(x_column_major, w_saved, x_inverse, w_inverse, scale.clone())
    ctx.amax_history, ctx.recipe = amax_history, recipe
    ctx.x_dtype, ctx.w_dtype, ctx.has_bias = out_dtype, weight.dtype, has_bias
    ctx.param = None  # set by the callers in split mode: the Parameter the deferred weight gradient goes to


def _forward_gemm(ctx, x_fp8: Tensor, x_fp8_t: Tensor | None, x_inverse: Tensor, weight: Tensor,
                  bias: Tensor | None, scale: Tensor, amax_history: Tensor, recipe: Recipe,
                  out_dtype: torch.dtype) -> Tensor:
    """``x_fp8 [rows, in] @ cast(weight).T (+ bias)`` in out_dtype, and what the backward needs, on ctx
    (``x_fp8_t``: the input's transposed copy with its rows padded to 16, or None)."""
    w_fp8, w_fp8_t, w_inverse = _weight_operand(weight, scale, amax_history, recipe)
    out = scaled_mm(x_fp8, w_fp8.t(), x_inverse, w_inverse, out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    x_column_major = x_fp8_t.t() if x_fp8_t is not None else _column_major(_rows_padded_to_16(x_fp8))
    _save_for_backward(ctx, x_column_major, x_inverse, w_fp8, w_fp8_t, w_inverse, weight, bias is not None, scale,
                       amax_history, recipe, out_dtype)
    return out


def _saved_operands(ctx) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(x_column_major, w_column_major, x_inverse, w_inverse, the gradient's scale) saved by the forward."""
    x_column_major, w_saved, x_inverse, w_inverse, scale = ctx.saved_tensors
    w_column_major = w_saved if ctx.w_is_column_major else _column_major(w_saved)
    return x_column_major, w_column_major, x_inverse, w_inverse, scale


def _weight_grad(ctx, g_fp8_t: Tensor, g_inverse: Tensor, x_column_major: Tensor, x_inverse: Tensor,
                 like: Tensor) -> Tensor:
    """``g_fp8_t [out, rows_16] @ x [rows_16, in]`` in fp8, or in split mode the deferred W that adds it to
    the parameter's gradient (``torchdist_ext._weight_grad``); ``like``: a tensor of the weight's shape."""
    def weight_grad():
        return scaled_mm(g_fp8_t, x_column_major, g_inverse, x_inverse, ctx.w_dtype)

    if ctx.param is None:
        return weight_grad()
    like = torch.empty(like.shape, dtype=ctx.w_dtype, device=like.device)
    return deferred_weight_grad(ctx.param, lambda buffer: buffer.add_(weight_grad()), like)


def _backward_gemms(ctx, grad_out: Tensor, input_grad_gemm=None) -> tuple[Tensor | None, Tensor | None,
                                                                          Tensor | None]:
    """(grad_x [rows, in], grad_w, grad_bias), each None where autograd needs none: the output gradient cast
    to the recipe's gradient format, both GEMMs in fp8. ``input_grad_gemm(g_fp8, w_column_major, g_inverse,
    w_inverse)``: the input gradient's GEMM (default ``scaled_mm`` into the input's dtype)."""
    x_column_major, w_column_major, x_inverse, w_inverse, scale = _saved_operands(ctx)
    g = grad_out.reshape(-1, grad_out.shape[-1])
    # One read of the gradient for both GEMMs: g_fp8 [rows, out] and g_fp8_t [out, rows_16].
    g_fp8, g_fp8_t, g_inverse = _cast_both_orientations(g, _GRAD, ctx.recipe.grad_dtype, scale, ctx.amax_history,
                                                   ctx.recipe, 16)
    grad_x = grad_w = grad_bias = None
    if ctx.needs_input_grad[0]:
        if input_grad_gemm is None:
            grad_x = scaled_mm(g_fp8, w_column_major, g_inverse, w_inverse, ctx.x_dtype)
        else:
            grad_x = input_grad_gemm(g_fp8, w_column_major, g_inverse, w_inverse)
    if ctx.needs_input_grad[1]:
        grad_w = _weight_grad(ctx, g_fp8_t, g_inverse, x_column_major, x_inverse, w_column_major)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = g.sum(0)
    return grad_x, grad_w, grad_bias


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, scale, amax_history, recipe, owner):
        x_fp8, x_fp8_t, x_inverse = _cast_both_orientations(x.reshape(-1, x.shape[-1]), _INPUT, torch.float8_e4m3fn,
                                                       scale, amax_history, recipe, 16)
        out = _forward_gemm(ctx, x_fp8, x_fp8_t, x_inverse, weight, bias, scale, amax_history, recipe, x.dtype)
        ctx.param = owner[0]
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w, grad_bias = _backward_gemms(ctx, grad_out)
        return None if grad_x is None else grad_x.view(ctx.x_shape), grad_w, grad_bias, None, None, None, None


class _Fp8AllGatherLinearFunction(torch.autograd.Function):
    """Sequence-parallel column GEMM in fp8: this rank's sequence block is cast, and the fp8 blocks travel a
    ring (a quarter of fp32's traffic, half of bf16's) while each arrived block's GEMM runs
    (``tdx::all_gather_scaled_mm``); backward's input-gradient GEMM reduce-scatters as a ring too
    (``tdx::scaled_mm_reduce_scatter``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, amax_history, recipe, group_name, dim, owner):
        x_fp8_block, x_inverse = _cast(x.contiguous(), _INPUT, torch.float8_e4m3fn, scale, amax_history, recipe)
        w_fp8, w_fp8_t, w_inverse = _weight_operand(weight, scale, amax_history, recipe)
        out, gathered = all_gather_scaled_mm(x_fp8_block, w_fp8.t(), x_inverse, w_inverse, x.dtype, group_name, dim)
        if bias is not None:
            out = out + bias.to(x.dtype)
        x_column_major = _column_major(_rows_padded_to_16(gathered.reshape(-1, x.shape[-1])))
        _save_for_backward(ctx, x_column_major, x_inverse, w_fp8, w_fp8_t, w_inverse, weight, bias is not None,
                           scale, amax_history, recipe, x.dtype)
        ctx.param = owner[0]
        ctx.gathered_shape, ctx.group_name, ctx.dim = gathered.shape, group_name, dim
        return out

    @staticmethod
    def backward(ctx, grad_out):
        def input_grad_gemm(g_fp8, w_column_major, g_inverse, w_inverse):
            g_fp8 = g_fp8.view(*ctx.gathered_shape[:-1], g_fp8.shape[-1])
            return scaled_mm_reduce_scatter(g_fp8, w_column_major, g_inverse, w_inverse, ctx.x_dtype,
                                            ctx.group_name, ctx.dim)

        grad_x, grad_w, grad_bias = _backward_gemms(ctx, grad_out, input_grad_gemm)
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None


class _Fp8LinearReduceScatterFunction(torch.autograd.Function):
    """Sequence-parallel row GEMM in fp8: the local GEMM's partial sums reduce-scatter as a ring while the next
    block's GEMM runs (``tdx::scaled_mm_reduce_scatter``); backward casts this rank's block of the output
    gradient and its fp8 blocks travel a ring into the input gradient's GEMM (``tdx::all_gather_scaled_mm``),
    whose gathered fp8 gradient then serves the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, scale, amax_history, recipe, group_name, dim, owner):
        x_fp8, x_fp8_t, x_inverse = _cast_both_orientations(x.reshape(-1, x.shape[-1]), _INPUT, torch.float8_e4m3fn,
                                                       scale, amax_history, recipe, 16)
        w_fp8, w_fp8_t, w_inverse = _weight_operand(weight, scale, amax_history, recipe)
        out = scaled_mm_reduce_scatter(x_fp8.view(x.shape), w_fp8.t(), x_inverse, w_inverse, x.dtype, group_name,
                                       dim)
        _save_for_backward(ctx, x_fp8_t.t(), x_inverse, w_fp8, w_fp8_t, w_inverse, weight, False, scale,
                           amax_history, recipe, x.dtype)
        ctx.param = owner[0]
        ctx.group_name, ctx.dim = group_name, dim
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_column_major, w_column_major, x_inverse, w_inverse, scale = _saved_operands(ctx)
        g_block_fp8, g_inverse = _cast(grad_out.contiguous(), _GRAD, ctx.recipe.grad_dtype, scale,
                                       ctx.amax_history, ctx.recipe)
        grad_x, g_fp8 = all_gather_scaled_mm(g_block_fp8, w_column_major, g_inverse, w_inverse, ctx.x_dtype,
                                             ctx.group_name, ctx.dim)
        grad_w = None
        if ctx.needs_input_grad[1]:
            g_fp8_t = _rows_padded_to_16(g_fp8.reshape(-1, g_fp8.shape[-1])).t().contiguous()
            grad_w = _weight_grad(ctx, g_fp8_t, g_inverse, x_column_major, x_inverse, w_column_major)
        return (grad_x if ctx.needs_input_grad[0] else None), grad_w, None, None, None, None, None, None


def gathers_fp8(recipe: Recipe) -> bool:
    """Whether a sequence-parallel gather may carry fp8 bytes: only when every rank casts with the same
    scale, i.e. delayed scales reduced over the ranks (``reduce_amax``; the reduction mesh must include
    the tensor-parallel ranks)."""
    return isinstance(recipe, DelayedScaling) and recipe.reduce_amax


def _check_split_is_eager(split_param: nn.Parameter | None) -> None:
    if split_param is not None and torch.compiler.is_compiling():
        raise RuntimeError("fp8 linears in split mode (zero-bubble schedules) run eagerly: compile them without "
                           "the weight-gradient split, or run the schedule eagerly")


def fp8_all_gather_linear(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor, amax_history: Tensor,
                          recipe: Recipe, group_name: str, dim: int, split_param: nn.Parameter | None = None) -> Tensor:
    """``F.linear(all_gather(x, dim), weight, bias)`` with x cast to fp8 before the gather (see
    ``_Fp8AllGatherLinearFunction``): ``x [.., S/n, .., in]`` this rank's block along ``dim``,
    ``weight [out, in]``; returns ``[.., S, .., out]``. Needs ``gathers_fp8(recipe)``. ``split_param``: as for
    ``fp8_linear``."""
    _check_split_is_eager(split_param)
    return _Fp8AllGatherLinearFunction.apply(x, weight, bias, scale, amax_history, recipe, group_name, dim,
                                             (split_param,))


def fp8_linear_reduce_scatter(x: Tensor, weight: Tensor, scale: Tensor, amax_history: Tensor, recipe: Recipe,
                              group_name: str, dim: int, split_param: nn.Parameter | None = None) -> Tensor:
    """``reduce_scatter(F.linear(x, weight), dim)`` with fp8 GEMMs as rings (see
    ``_Fp8LinearReduceScatterFunction``): ``x [.., S, .., in]`` full along ``dim`` (S divisible by the group),
    ``weight [out, in]``; returns this rank's block ``[.., S/n, .., out]`` of the sum over the group. Needs
    ``gathers_fp8(recipe)`` (the backward gathers the fp8 output gradient). ``split_param``: as for
    ``fp8_linear``."""
    _check_split_is_eager(split_param)
    return _Fp8LinearReduceScatterFunction.apply(x, weight, scale, amax_history, recipe, group_name, dim,
                                                 (split_param,))


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor, amax_history: Tensor,
               recipe: Recipe, split_param: nn.Parameter | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with fp8 GEMMs (see the module docstring); ``x [..., in]``,
    ``weight [out, in]`` (plain tensors: the local shard under tensor parallelism). ``split_param``: the
    weight's Parameter in split mode (``torchdist_ext._weight_grad``: the weight-gradient GEMM runs
    in W), or None. Under ``RowwiseScaling`` / ``BlockScaling`` the GEMMs are ``blockwise_fp8_linear``'s (the
    scale buffers unused)."""
    _check_split_is_eager(split_param)
    if not isinstance(recipe, TENSORWISE):
        if split_param is not None:
            raise ValueError(f"{type(recipe).__name__} does not split the weight gradient yet (zero-bubble "
                             f"schedules): use a tensorwise recipe there")
        return blockwise_fp8_linear(x, weight, bias, recipe)
    return _Fp8LinearFunction.apply(x, weight, bias, scale, amax_history, recipe, (split_param,))


class Fp8Linear(SplitsWeightGrad, Fp8State, nn.Linear):
    """``nn.Linear`` whose GEMMs run in fp8 under ``recipe``.

    Shapes as ``nn.Linear``: ``[..., in_features] -> [..., out_features]``.

    Args:
        in_features, out_features: both divisible by 16 (the fp8 GEMMs' alignment).
        bias: as ``nn.Linear``.
        recipe: ``DelayedScaling``, ``CurrentScaling``, ``RowwiseScaling`` or ``BlockScaling``: formats, amax
            history and scale rule.
        amax_reduction_mesh: the ranks whose amaxes ``fp8_step`` reduces (None: the default process group);
            it must include the tensor-parallel ranks of a sharded weight.
        device, dtype: of the weight and bias (the fp8 state stays fp32).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe,
                 amax_reduction_mesh=None, device=None, dtype=None):
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 16:
                raise ValueError(f"{arg} must be a positive multiple of 16 (fp8 GEMMs), got {value!r}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.enable_fp8(recipe, amax_reduction_mesh=amax_reduction_mesh, device=device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, *, amax_reduction_mesh=None) -> "Fp8Linear":
        """The fp8 layer holding ``linear``'s own parameters (the same Parameter objects, so optimizers and
        FSDP2 see the same model)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe,
                    amax_reduction_mesh=amax_reduction_mesh, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.enable_fp8(recipe, amax_reduction_mesh=amax_reduction_mesh, device=linear.weight.device)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        return fp8_linear(x, self.weight, self.bias, self.scale, self.amax_history, self.fp8_recipe,
                          self.weight if self.split_weight_grad else None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.fp8_recipe}"
