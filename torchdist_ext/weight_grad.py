"""The weight-gradient split of our linears' backward, for zero-bubble pipeline schedules (Qi et al. 2024).

A layer in split mode (``split_weight_grad = True``: ``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ``RMSNorm``, ``SplitLinear`` for ``nn.Linear``) computes in its autograd backward only the input gradient (B, on the
pipeline's critical path: ``tdx::linear_dgrad``, or the sequence-parallel ring ops) and, while a
``WeightGradStore`` is collecting, queues the weight gradient (W) with what it needs (its input, or the
gathered input, and the output gradient) instead of computing it:

    store = WeightGradStore()
    with store.collecting(key):          # B: backward of micro-batch `key`; W work is queued
        torch.autograd.backward(out, grad)
    store.run(key)                       # W: later, each queued GEMM accumulates into param.grad

``run`` accumulates into each parameter's ``.grad`` (a DTensor's local shard for our tensor-parallel
layers), so the optimizer and FSDP2 see the gradient unsplit autograd would have left: with no store
collecting, a layer in split mode returns its weight gradient through autograd as usual. The split
gradient equals the unsplit one bit for bit (the same GEMMs; tested).

fp8 layers keep their whole backward in B for now.
"""

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from torchdist_ext import collectives, ops

__all__ = ["SplitLinear", "WeightGradStore", "deferred_weight_grad", "split_embedding", "split_linear",
           "split_scale"]

# (store, key) while a store collects: set by WeightGradStore.collecting around a backward.
_collecting: tuple["WeightGradStore", Hashable] | None = None

WeightGradWork = Callable[[Tensor], None]  # adds a weight gradient into the given buffer, in place


class WeightGradStore:
    """Weight-gradient work of split backwards, queued per key (e.g. ``(stage, microbatch)``)."""

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


class _SplitLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` (``kind="local"``), ``all_gather(x) @ weight.T`` (``"gather"``, the column ring) or
    ``reduce_scatter(x @ weight.T)`` (``"scatter"``, the row ring) with the weight gradient split off."""

    @staticmethod
    def forward(ctx, x, weight, owner, kind, group_name, dim):
        if kind == "local":  # F.linear's GEMM, into a fresh tensor (callers may reduce it in place)
            out = x.new_empty((*x.shape[:-1], weight.shape[0]))
            torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out=out.view(-1, weight.shape[0]))
        elif kind == "gather":
            out, _ = ops.all_gather_matmul(x, weight, group_name, dim)
        else:
            out = ops.matmul_reduce_scatter(x, weight, group_name, dim)
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.kind, ctx.group = owner[0], kind, (group_name, dim)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group_name, dim = ctx.group
        grad_x = None
        if ctx.kind == "local":
            if ctx.needs_input_grad[0]:
                grad_x = ops.linear_dgrad(grad_out, weight)

            def work(buffer, grad_out=grad_out, x=x):
                ops.linear_wgrad_(buffer, grad_out, x)
        elif ctx.kind == "gather":
            if ctx.needs_input_grad[0]:
                grad_x = ops.matmul_reduce_scatter(grad_out, weight.t(), group_name, dim)

            def work(buffer, grad_out=grad_out, x=x):
                buffer.add_(ops.all_gather_weight_grad(grad_out, x, group_name, dim))
        else:
            grad_x, grad_out_full = ops.all_gather_matmul(grad_out, weight.t(), group_name, dim, True)

            def work(buffer, grad_out_full=grad_out_full, x=x):
                ops.linear_wgrad_(buffer, grad_out_full, x)
        grad_w = deferred_weight_grad(ctx.param, work, weight) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None, None


def split_linear(x: Tensor, weight: Tensor, param: nn.Parameter, kind: str = "local", group_name: str = "",
                 dim: int = 0) -> Tensor:
    """The linear GEMM of a layer in split mode (no bias; add it outside). ``weight``: the tensor the GEMM
    uses (``param`` itself, or its local shard ``param.to_local()``); ``param``: the Parameter whose
    ``.grad`` the deferred weight gradient goes to. ``kind``: ``"local"`` (``x [..., in] -> [..., out]``),
    ``"gather"`` (``tdx::all_gather_matmul`` over ``group_name`` along ``dim``) or ``"scatter"``
    (``tdx::matmul_reduce_scatter``). Under autocast the GEMMs run in the autocast dtype, as ``F.linear``'s."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        with torch.autocast(device_type, enabled=False):
            return _SplitLinearFunction.apply(x, weight, (param,), kind, group_name, dim)
    return _SplitLinearFunction.apply(x, weight, (param,), kind, group_name, dim)


class _SplitScaleFunction(torch.autograd.Function):
    """``x * weight`` (``weight [d]`` over the last dim) with the weight gradient split off; with a group,
    the weight gradient (a partial sum over this rank's rows) is summed over it in W."""

    @staticmethod
    def forward(ctx, x, weight, owner, group_name):
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.group_name = owner[0], group_name
        return x * weight

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out * weight if ctx.needs_input_grad[0] else None
        group_name = ctx.group_name

        def work(buffer, grad_out=grad_out, x=x):
            partial = (grad_out * x).sum_to_size(buffer.shape)
            buffer.add_(collectives.all_reduce(partial, group_name) if group_name else partial)
        grad_w = deferred_weight_grad(ctx.param, work, weight) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


def split_scale(x: Tensor, weight: Tensor, param: nn.Parameter, group_name: str | None = None) -> Tensor:
    """``x * weight`` (a norm's affine weight ``[d]`` on ``x [..., d]``) in split mode; ``group_name``: the
    group whose ranks hold other rows of the same weight's input (sequence parallelism), over which W sums."""
    return _SplitScaleFunction.apply(x, weight, (param,), group_name)


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


def split_embedding(ids: Tensor, weight: Tensor, param: nn.Parameter, padding_idx: int | None = None) -> Tensor:
    """``F.embedding(ids, weight, padding_idx)`` in split mode (its backward is all W)."""
    return _SplitEmbeddingFunction.apply(ids, weight, (param,), padding_idx)


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose backward splits off the weight gradient (see the module docstring); the bias
    gradient stays in B (a sum over the rows)."""

    split_weight_grad = True

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "SplitLinear":
        """The split layer holding ``linear``'s own parameters."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: Tensor) -> Tensor:
        out = split_linear(x, self.weight, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)
