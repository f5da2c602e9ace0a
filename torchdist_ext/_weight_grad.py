"""The weight-gradient split of our layers' backward for zero-bubble pipeline schedules (Qi et al. 2024): in split
mode the backward computes the input gradient (B) and queues the weight gradient (W) while a store collects.

    store = WeightGradStore()
    with store.collecting(key):          # B: backward of micro-batch `key`; W work is queued
        torch.autograd.backward(out, grad)
    store.run(key)                       # W: later, each queued GEMM accumulates into param.grad

How W is deferred under torch.compile: docs/architecture.md, "Pipeline parallelism".
"""

import itertools
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._library.effects import EffectType
from torch.distributed.tensor import DTensor

from torchdist_ext import _collectives as collectives, ops

__all__ = ["SplitLinear", "SplitsWeightGrad", "WeightGradStore", "deferred_weight_grad", "give_weight_grad_slot",
           "split_embedding", "split_linear", "split_scale"]

# (store, key) while a store collects: set by WeightGradStore.collecting around a backward.
_collecting: tuple["WeightGradStore", Hashable] | None = None

WeightGradWork = Callable[[Tensor], None]  # adds a weight gradient into the given buffer, in place


class WeightGradStore:
    """Weight-gradient work (W) of split backwards, queued per key (e.g. ``(stage, microbatch)``).

    Inside ``collecting(key)`` every layer in split mode queues its W with what it needs (its input, or the
    gathered input, and the output gradient) instead of computing it; ``run(key)`` accumulates it into each
    parameter's ``.grad`` (a DTensor's local shard for our tensor-parallel layers), so the optimizer and FSDP2
    see the gradient unsplit autograd would have left, bit for bit (the same GEMMs). With no store collecting, a
    layer in split mode computes its weight gradient at once: returned through autograd eagerly, added into
    ``.grad`` under ``torch.compile``. The constructor takes no arguments.
    """

    def __init__(self):
        self._work: dict[Hashable, list[tuple[nn.Parameter, WeightGradWork]]] = defaultdict(list)

    @contextmanager
    def collecting(self, key: Hashable) -> Iterator[None]:
        """While inside, layers in split mode queue their weight gradients under ``key``."""
        global _collecting
        previous, _collecting = _collecting, (self, key)
        try:
            yield
        finally:
            _collecting = previous

    def run(self, key: Hashable) -> None:
        """Runs (W) the work queued under ``key``, in the order it was queued, into each parameter's
        ``.grad``; a key with no work is a no-op."""
        with torch.no_grad():  # accumulates into .grad (a DTensor's local shard) in place
            for param, work in self._work.pop(key, []):
                work(_grad_buffer(param))

    def pending(self) -> list[Hashable]:
        """The keys with queued work."""
        return list(self._work)

    def clear(self) -> None:
        self._work.clear()


def _grad_buffer(param: nn.Parameter) -> Tensor:
    """``param.grad`` (its local shard for a DTensor), created as zeros when missing."""
    if param.grad is None:
        local = param.to_local() if isinstance(param, DTensor) else param
        zeros = torch.zeros_like(local, memory_format=torch.contiguous_format)
        param.grad = (DTensor.from_local(zeros, param.device_mesh, param.placements, run_check=False,
                                         shape=param.shape, stride=param.stride())
                      if isinstance(param, DTensor) else zeros)
    grad = param.grad
    if isinstance(param, DTensor) and (not isinstance(grad, DTensor) or grad.placements != param.placements):
        raise ValueError(f"a parameter's .grad must be laid out as the parameter (placements {param.placements}) "
                         f"for a deferred weight gradient to add into it, got "
                         f"{grad.placements if isinstance(grad, DTensor) else 'a plain tensor'}")
    return grad.to_local() if isinstance(grad, DTensor) else grad


def deferred_weight_grad(param: nn.Parameter, work: WeightGradWork, weight: Tensor) -> Tensor | None:
    """For a layer's backward in split mode: queues ``work`` (which adds the weight gradient into a buffer)
    for ``param`` while a store collects (autograd then gets no weight gradient); otherwise runs it now into
    zeros like ``weight`` and returns that for autograd."""
    if _collecting is not None:
        store, key = _collecting
        store._work[key].append((param, work))
        return None
    grad = torch.zeros_like(weight)
    work(grad)
    return grad


def _weight_grad_work(kind: str, grad_out: Tensor, saved: Tensor, group_name: str, dim: int) -> WeightGradWork:
    """The W of a split backward: ``"linear"`` adds ``grad_out^T @ saved`` (``saved``: the GEMM's input);
    ``"gather"`` the weight gradient of the sequence-parallel column ring (``saved``: this rank's input block,
    gathered over ``group_name`` along ``dim``); ``"scale"`` the sum of ``grad_out * saved`` over the rows
    (a norm's weight), summed over ``group_name`` when it is set."""
    if kind == "linear":
        return lambda buffer: ops.linear_wgrad_(buffer, grad_out, saved)
    if kind == "gather":
        return lambda buffer: buffer.add_(ops.all_gather_weight_grad(grad_out, saved, group_name, dim))
    if kind == "scale":
        def work(buffer):
            partial = (grad_out * saved).sum_to_size(buffer.shape)
            buffer.add_(collectives.all_reduce(partial, group_name) if group_name else partial)
        return work
    raise ValueError(f"kind must be 'linear', 'gather' or 'scale', got {kind!r}")


# Weight-gradient slots: slot id -> the layer whose .weight the compiled backward's W goes to.
_slot_layers: dict[int, weakref.ref] = {}
_next_slot = itertools.count()


def give_weight_grad_slot(layer: nn.Module) -> None:
    """Gives ``layer`` (a layer in split mode, with a ``weight``) its weight-gradient slot, once: the
    non-persistent 0-d buffer ``_weight_grad_slot`` through which compiled backward code finds the layer
    (a copy of the layer shares the slot: call this on the copy)."""
    slot = getattr(layer, "_weight_grad_slot", None)
    if slot is not None and (ref := _slot_layers.get(int(slot))) is not None and ref() is layer:
        return
    index = next(_next_slot)
    _slot_layers[index] = weakref.ref(layer, lambda _, index=index: _slot_layers.pop(index, None))
    layer.register_buffer("_weight_grad_slot", torch.tensor(index), persistent=False)


def _slot_parameter(slot: Tensor) -> nn.Parameter:
    layer = _slot_layers.get(int(slot), lambda: None)()
    if layer is None:
        raise RuntimeError(f"weight-gradient slot {int(slot)} names no live layer: was the layer's buffer replaced "
                           "after its split was enabled? (to_empty() of a model built on the meta device comes "
                           "before Pipeline and enable_weight_grad_split)")
    return layer.weight


@torch.library.custom_op("tdx::defer_weight_grad", mutates_args=())
def _defer_weight_grad(slot: Tensor, grad_out: Tensor, saved: Tensor, kind: str, group_name: str, dim: int) -> None:
    """The W of a split backward under torch.compile, registered as an ordered effectful op so the compiled
    backward keeps it and its order: queued for the layer of ``slot`` (with copies of ``grad_out`` and ``saved``)
    while a store collects, else added into its weight's ``.grad`` now. ``kind``, ``grad_out``, ``saved``,
    ``group_name``, ``dim``: as ``_weight_grad_work``."""
    param = _slot_parameter(slot)
    if _collecting is None:
        with torch.no_grad():
            _weight_grad_work(kind, grad_out, saved, group_name, dim)(_grad_buffer(param))
        return
    store, key = _collecting  # copies: the compiled code may reuse these buffers' memory once this returns
    store._work[key].append((param, _weight_grad_work(kind, grad_out.clone(), saved.clone(), group_name, dim)))


@_defer_weight_grad.register_fake
def _(slot, grad_out, saved, kind, group_name, dim) -> None:
    return None


torch.library._register_effectful_op("tdx::defer_weight_grad", EffectType.ORDERED)


def _carrier(layer: nn.Module) -> Tensor | tuple[nn.Parameter]:
    """What a split autograd function carries to W: eagerly the layer's weight itself; under torch.compile the
    layer's slot (a graph input: every layer of a class shares one graph)."""
    if not torch.compiler.is_compiling():
        return (layer.weight,)
    slot = getattr(layer, "_weight_grad_slot", None)
    if slot is None:
        raise RuntimeError(f"{type(layer).__name__} in split mode under torch.compile needs its weight-gradient "
                           f"slot: set split_weight_grad = True on the layer (or call give_weight_grad_slot)")
    return slot


def _weight_grad(ctx, slot: Tensor | None, kind: str, grad_out: Tensor, saved: Tensor, weight: Tensor,
                 group_name: str = "", dim: int = 0) -> Tensor | None:
    """The weight's gradient for autograd in a split backward: None when W is deferred (always under compile,
    where ``slot`` names the layer), else as ``deferred_weight_grad``."""
    if slot is not None:
        _defer_weight_grad(slot, grad_out, saved, kind, group_name, dim)
        return None
    return deferred_weight_grad(ctx.param, _weight_grad_work(kind, grad_out, saved, group_name, dim), weight)


def _save_with_carrier(ctx, carrier: Tensor | tuple[nn.Parameter], *tensors: Tensor) -> None:
    ctx.has_slot = isinstance(carrier, Tensor)
    ctx.param = None if ctx.has_slot else carrier[0]
    ctx.save_for_backward(*tensors, *((carrier,) if ctx.has_slot else ()))


def _saved_with_slot(ctx) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """The tensors saved by ``_save_with_carrier``, and the slot (None when the weight itself was carried)."""
    tensors = ctx.saved_tensors
    return (tensors[:-1], tensors[-1]) if ctx.has_slot else (tensors, None)


class _SplitLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` (``kind="local"``), ``all_gather(x) @ weight.T`` (``"gather"``, the column ring) or
    ``reduce_scatter(x @ weight.T)`` (``"scatter"``, the row ring) with the weight gradient split off."""

    @staticmethod
    def forward(ctx, x, weight, carrier, kind, group_name, dim):
        if kind == "local":  # F.linear's GEMM, into a fresh tensor (callers may reduce it in place)
            out = x.new_empty((*x.shape[:-1], weight.shape[0]))
            torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out=out.view(-1, weight.shape[0]))
        elif kind == "gather":
            out, _ = ops.all_gather_matmul(x, weight, group_name, dim)
        else:
            out = ops.matmul_reduce_scatter(x, weight, group_name, dim)
        _save_with_carrier(ctx, carrier, x, weight)
        ctx.kind, ctx.group = kind, (group_name, dim)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x, weight), slot = _saved_with_slot(ctx)
        group_name, dim = ctx.group
        grad_x = grad_w = None
        if ctx.kind == "local":
            if ctx.needs_input_grad[0]:
                grad_x = ops.linear_dgrad(grad_out, weight)
            if ctx.needs_input_grad[1]:
                grad_w = _weight_grad(ctx, slot, "linear", grad_out, x, weight)
        elif ctx.kind == "gather":
            if ctx.needs_input_grad[0]:
                grad_x = ops.matmul_reduce_scatter(grad_out, weight.t(), group_name, dim)
            if ctx.needs_input_grad[1]:
                grad_w = _weight_grad(ctx, slot, "gather", grad_out, x, weight, group_name, dim)
        else:
            grad_x, grad_out_full = ops.all_gather_matmul(grad_out, weight.t(), group_name, dim, True)
            if ctx.needs_input_grad[1]:
                grad_w = _weight_grad(ctx, slot, "linear", grad_out_full, x, weight)
        return grad_x, grad_w, None, None, None, None


def split_linear(x: Tensor, weight: Tensor, layer: nn.Module, kind: str = "local", group_name: str = "",
                 dim: int = 0) -> Tensor:
    """The linear GEMM of a layer in split mode (no bias; add it outside). ``weight``: the tensor the GEMM
    uses (``layer.weight`` itself, or its local shard ``layer.weight.to_local()``); ``layer``: the layer whose
    ``weight.grad`` the deferred weight gradient goes to. ``kind``: ``"local"`` (``x [..., in] -> [..., out]``),
    ``"gather"`` (``tdx::all_gather_matmul`` over ``group_name`` along ``dim``) or ``"scatter"``
    (``tdx::matmul_reduce_scatter``). Under autocast the GEMMs run in the autocast dtype, as ``F.linear``'s."""
    device_type = x.device.type
    carrier = _carrier(layer)
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return _SplitLinearFunction.apply(x, weight, carrier, kind, group_name, dim)
    return _SplitLinearFunction.apply(x, weight, carrier, kind, group_name, dim)


class _SplitScaleFunction(torch.autograd.Function):
    """``x * weight`` (``weight [d]`` over the last dim) with the weight gradient split off; with a group,
    the weight gradient (a partial sum over this rank's rows) is summed over it in W."""

    @staticmethod
    def forward(ctx, x, weight, carrier, group_name):
        _save_with_carrier(ctx, carrier, x, weight)
        ctx.group_name = group_name
        return x * weight

    @staticmethod
    def backward(ctx, grad_out):
        (x, weight), slot = _saved_with_slot(ctx)
        grad_x = grad_out * weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(ctx, slot, "scale", grad_out, x, weight, ctx.group_name)
        return grad_x, grad_w, None, None


def split_scale(x: Tensor, weight: Tensor, layer: nn.Module, group_name: str = "") -> Tensor:
    """``x * weight`` (a norm's affine weight ``[d]`` on ``x [..., d]``) in split mode; ``layer``: the norm
    whose ``weight.grad`` W adds to; ``group_name``: the group whose ranks hold other rows of the same
    weight's input (sequence parallelism), over which W sums ("": none)."""
    return _SplitScaleFunction.apply(x, weight, _carrier(layer), group_name)


class _SplitEmbeddingFunction(torch.autograd.Function):
    """``F.embedding(ids, weight)``: the whole backward is the weight gradient (W)."""

    @staticmethod
    def forward(ctx, ids, weight, owner, padding_idx):
        ctx.save_for_backward(ids)
        ctx.param, ctx.padding_idx, ctx.rows = owner[0], padding_idx, weight.shape[0]
        ctx.weight_meta = weight.new_empty(0)
        return F.embedding(ids, weight, padding_idx=padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        padding_idx = -1 if ctx.padding_idx is None else ctx.padding_idx

        def work(buffer, grad_out=grad_out, ids=ids, rows=ctx.rows):
            buffer.add_(torch.ops.aten.embedding_dense_backward(grad_out, ids, rows, padding_idx, False))
        weight = ctx.weight_meta.new_empty(ctx.rows, grad_out.shape[-1])
        grad_w = deferred_weight_grad(ctx.param, work, weight) if ctx.needs_input_grad[1] else None
        return None, grad_w, None, None


def split_embedding(ids: Tensor, weight: Tensor, layer: nn.Module, padding_idx: int | None = None) -> Tensor:
    """``F.embedding(ids, weight, padding_idx)`` in split mode (its backward is all W; eager only: keep the
    embedding outside compiled regions, as the main job does)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("the vocab-parallel embedding in split mode runs eagerly: compile the transformer "
                           "blocks, not the embedding")
    return _SplitEmbeddingFunction.apply(ids, weight, (layer.weight,), padding_idx)


class SplitsWeightGrad:
    """Mixin of our layers with a ``weight`` whose backward can split off the weight gradient
    (``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``, ``RMSNorm``, ``Fp8Linear``): the
    ``split_weight_grad`` switch (False by default); turning it on gives the layer its weight-gradient slot.
    fp8 linears in split mode and the split embedding run eagerly (a clear error inside a compiled region). A
    mixin: no constructor arguments."""

    _split_weight_grad: bool = False

    @property
    def split_weight_grad(self) -> bool:
        return self._split_weight_grad

    @split_weight_grad.setter
    def split_weight_grad(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"split_weight_grad must be a bool, got {value!r}")
        self._split_weight_grad = value
        if value:
            give_weight_grad_slot(self)


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose backward splits off the weight gradient (queued while a ``WeightGradStore`` collects);
    the bias gradient stays in B (a sum over the rows). ``enable_weight_grad_split`` turns a module's plain
    ``nn.Linear`` layers into this class in place.

    Args:
        in_features: size of the input's last dim.
        out_features: size of the output's last dim.
        bias: whether the layer adds a learnable bias ``[out_features]``.
        device: where the parameters are created, as ``nn.Linear``'s.
        dtype: the parameters' dtype, as ``nn.Linear``'s.
    """

    split_weight_grad = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        give_weight_grad_slot(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "SplitLinear":
        """The split layer holding ``linear``'s own parameters."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: Tensor) -> Tensor:
        out = split_linear(x, self.weight, self)
        return out if self.bias is None else out + self.bias.to(out.dtype)
