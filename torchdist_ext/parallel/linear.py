"""Column- and row-parallel linear layers (Megatron semantics), with sequence parallelism: a column layer followed
by a row layer (an MLP, or attention's QKV and output projections) needs one collective each way per pair, fused
into the GEMM as a ring under sequence parallelism.

    up = ColumnParallelLinear.from_linear(mlp.up, tp_mesh=mesh["tp"], sequence_parallel=True)
    down = RowParallelLinear.from_linear(mlp.down, tp_mesh=mesh["tp"], sequence_parallel=True)
    y = down(F.silu(up(x)))   # x, y [batch, seq/tp, hidden]; up(x) [batch, seq, ffn/tp]
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from torchdist_ext import ops
from torchdist_ext.fp8.linear import fp8_all_gather_linear, fp8_linear, fp8_linear_reduce_scatter, gathers_fp8
from torchdist_ext.fp8.recipe import TENSORWISE
from torchdist_ext.fp8.state import Fp8State
from torchdist_ext.parallel.input_checks import (
    check_divisible,
    check_features,
    check_floating_dtype,
    check_floating_input,
    sequence_dim,
)
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.parameters import distribute_parameter
from torchdist_ext.parallel.regions import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
)
from torchdist_ext._weight_grad import SplitsWeightGrad, split_linear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _linear_init(out_features: int, in_features: int, bias: bool, device, dtype) -> tuple[Tensor, Tensor | None]:
    """Full weight and bias drawn as ``nn.Linear.reset_parameters`` draws them."""
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    full_bias = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    if weight.is_meta:
        return weight, full_bias
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if full_bias is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(full_bias, -bound, bound)
    return weight, full_bias


class _ParallelLinear(SplitsWeightGrad, Fp8State, nn.Module):
    """Shared parameter handling (full tensors in, DTensor parameters out) and the local GEMM, in the
    parameters' dtype or, once ``enable_fp8`` ran, in fp8. ``split_weight_grad = True`` (set by a
    zero-bubble pipeline) splits the weight gradient off the backward (``torchdist_ext._weight_grad``;
    in fp8 too)."""

    weight_placement: Shard
    bias_placement: Shard | Replicate

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: MeshGroup, seq_dim: int,
                 sequence_parallel: bool, device, dtype):
        super().__init__()
        self.tp = tp
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if not isinstance(seq_dim, int):
            raise TypeError(f"seq_dim must be an int, got {type(seq_dim).__name__}")
        check_floating_dtype(dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.sequence_parallel = bool(sequence_parallel)
        self.seq_dim = seq_dim
        weight, full_bias = _linear_init(out_features, in_features, bias, device, dtype)
        # Every rank starts from rank 0's draw, as one process would.
        self._set_full_parameters(weight, full_bias, src_data_rank=0)

    def enable_fp8(self, recipe, *, amax_reduction_mesh: DeviceMesh | None = None, device=None) -> None:
        """``Fp8State.enable_fp8``, refusing an ``amax_reduction_mesh`` without this layer's tp ranks: their
        delayed scales would differ, and the fp8 blocks that travel between them (sequence parallelism) or
        their replicated results would be dequantised with another rank's scale."""
        if amax_reduction_mesh is not None:
            tp_ranks = set(self.tp.mesh.mesh.flatten().tolist())
            reduced = set(amax_reduction_mesh.mesh.flatten().tolist())
            if not tp_ranks <= reduced:
                raise ValueError(f"amax_reduction_mesh (ranks {sorted(reduced)}) must include the tensor-parallel "
                                 f"ranks {sorted(tp_ranks)} of {type(self).__name__}, or they would cast with "
                                 f"different scales")
        if not isinstance(recipe, TENSORWISE) and self.tp.size > 1:
            raise ValueError(f"{type(self).__name__} over {self.tp.size} ranks takes a tensorwise fp8 recipe "
                             f"(DelayedScaling, CurrentScaling) for now, got {type(recipe).__name__}: the rowwise and "
                             f"block recipes' scales are not yet cut with the tensor-parallel shards")
        super().enable_fp8(recipe, amax_reduction_mesh=amax_reduction_mesh, device=device)

    def _set_full_parameters(self, weight: Tensor, bias: Tensor | None, src_data_rank: int | None) -> None:
        self.weight = distribute_parameter(weight, self.tp, self.weight_placement, src_data_rank)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = distribute_parameter(bias, self.tp, self.bias_placement, src_data_rank)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, tp_mesh: DeviceMesh, **kwargs) -> "_ParallelLinear":
        """The parallel layer holding ``linear``'s weights (every rank passes the same ``linear``).

        Keyword arguments are the constructor's (``gather_output``, ``sequence_parallel``, ...).
        Each rank keeps its own shard; no communication happens.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, tp_mesh=tp_mesh,
                    device="meta", dtype=linear.weight.dtype, **kwargs)
        bias = None if linear.bias is None else linear.bias.detach()
        layer._set_full_parameters(linear.weight.detach(), bias, src_data_rank=None)
        return layer

    def _local_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.fp8_recipe is not None:
            return fp8_linear(x, weight, bias, self.scale, self.amax_history, self.fp8_recipe,
                              self.weight if self.split_weight_grad else None)
        if self.split_weight_grad:
            out = split_linear(x, weight, self)
            return out if bias is None else out + bias.to(out.dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_recipe is None else f", fp8={self.fp8_recipe}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp={self.tp.size}, sequence_parallel={self.sequence_parallel}, seq_dim={self.seq_dim}{fp8}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with ``W`` split by output features over ``tp_mesh``.

    Args:
        in_features: size of the input's last dim, as ``nn.Linear``'s.
        out_features: size of the full output's last dim, as ``nn.Linear``'s; divisible by tp.
        bias: whether to add a learnable bias ``[out]`` (sharded like the output features).
        tp_mesh: 1-D DeviceMesh of the tensor-parallel group.
        gather_output: return the full ``[..., out]`` instead of this rank's ``[..., out/tp]``.
        sequence_parallel: the input is sharded along ``seq_dim`` (rank r holds the r-th block); it is
            all-gathered inside the GEMM ring (``tdx::all_gather_matmul``). In fp8 with delayed scales reduced
            over the ranks the ring carries the fp8 input blocks (``tdx::all_gather_scaled_mm``); under current
            scaling the input is all-gathered before the fp8 GEMM.
        seq_dim: the sequence dim of the activations (default 1: ``[batch, seq, hidden]``).
        device: where the parameters are created ("meta": left uninitialised).
        dtype: the parameters' floating dtype.

    Shapes:
        input  ``[..., in]`` replicated, or ``[.., S/tp, .., in]`` with sequence_parallel
        output ``[.., S, .., out/tp]`` (``out`` with gather_output), full along seq_dim
    Parameters: ``weight`` DTensor ``[out, in]`` ``Shard(0)``; ``bias`` ``[out]`` ``Shard(0)``.
    """

    weight_placement = Shard(0)
    bias_placement = Shard(0)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_mesh: DeviceMesh,
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1,
                 device=None, dtype=None):
        tp = MeshGroup.of(tp_mesh)
        check_divisible("out_features", out_features, tp)
        super().__init__(in_features, out_features, bias, tp, seq_dim, sequence_parallel, device, dtype)
        self.gather_output = bool(gather_output)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to_local()
        check_floating_input(x, "input", weight.dtype)
        check_features(x, "input", self.in_features, "in_features")
        bias = None if self.bias is None else self.bias.to_local()
        if self.sequence_parallel and self.fp8_recipe is not None and gathers_fp8(self.fp8_recipe):
            out = fp8_all_gather_linear(x, weight, bias, self.scale, self.amax_history, self.fp8_recipe, self.tp.name,
                                        sequence_dim(x, self.seq_dim), self.weight if self.split_weight_grad else None)
        elif self.sequence_parallel and self.fp8_recipe is not None:
            out = self._local_linear(gather_from_sequence_region(x, self.tp, sequence_dim(x, self.seq_dim)),
                                     weight, bias)
        elif self.sequence_parallel and self.split_weight_grad:
            out = split_linear(x, weight, self, "gather", self.tp.name, sequence_dim(x, self.seq_dim))
            if bias is not None:
                out = out + bias
        elif self.sequence_parallel:
            dim = sequence_dim(x, self.seq_dim)
            out, _ = ops.all_gather_matmul(x, weight, self.tp.name, dim)
            if bias is not None:
                out = out + bias
        else:
            out = self._local_linear(copy_to_region(x, self.tp), weight, bias)
        if self.gather_output:
            out = gather_from_region(out, self.tp, -1)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with ``W`` split by input features over ``tp_mesh``; partial sums reduced.

    Args:
        in_features: size of the full input's last dim, as ``nn.Linear``'s; divisible by tp.
        out_features: size of the output's last dim, as ``nn.Linear``'s.
        bias: whether to add a learnable bias ``[out]`` (replicated; added after the reduction).
        tp_mesh: 1-D DeviceMesh of the tensor-parallel group.
        input_is_parallel: the input is already this rank's ``[..., in/tp]`` slice (the
            output of a ColumnParallelLinear); if False it is the full ``[..., in]`` and is split here.
        sequence_parallel: reduce-scatter the output along ``seq_dim`` (inside the GEMM ring,
            ``tdx::matmul_reduce_scatter``) instead of all-reducing it; ``input.size(seq_dim)`` divisible by tp.
            In fp8 with delayed scales reduced over the ranks the partial sums reduce-scatter inside
            ``tdx::scaled_mm_reduce_scatter`` (its backward gathers the fp8 output gradient); under current
            scaling the output of the fp8 GEMM is reduce-scattered after it.
        seq_dim: the sequence dim of the activations (default 1: ``[batch, seq, hidden]``).
        device: where the parameters are created ("meta": left uninitialised).
        dtype: the parameters' floating dtype.

    Shapes:
        input  ``[..., in/tp]`` (``[..., in]`` if not input_is_parallel), full along seq_dim
        output ``[..., out]`` replicated, or ``[.., S/tp, .., out]`` with sequence_parallel
    Parameters: ``weight`` DTensor ``[out, in]`` ``Shard(1)``; ``bias`` ``[out]`` ``Replicate()``.
    """

    weight_placement = Shard(1)
    bias_placement = Replicate()

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_mesh: DeviceMesh,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seq_dim: int = 1,
                 device=None, dtype=None):
        tp = MeshGroup.of(tp_mesh)
        check_divisible("in_features", in_features, tp)
        super().__init__(in_features, out_features, bias, tp, seq_dim, sequence_parallel, device, dtype)
        self.input_is_parallel = bool(input_is_parallel)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to_local()
        check_floating_input(x, "input", weight.dtype)
        if self.input_is_parallel:
            check_features(x, "input", weight.shape[1], f"in_features / tp = {self.in_features} / {self.tp.size}")
        else:
            check_features(x, "input", self.in_features, "in_features")
            x = scatter_to_region(x, self.tp, -1)
        if self.sequence_parallel:
            dim = sequence_dim(x, self.seq_dim)
            check_divisible(f"input.size({dim})", x.shape[dim], self.tp)
            if self.fp8_recipe is None and self.split_weight_grad:
                out = split_linear(x, weight, self, "scatter", self.tp.name, dim)
            elif self.fp8_recipe is None:
                out = ops.matmul_reduce_scatter(x, weight, self.tp.name, dim)
            elif gathers_fp8(self.fp8_recipe):
                out = fp8_linear_reduce_scatter(x, weight, self.scale, self.amax_history, self.fp8_recipe,
                                                self.tp.name, dim, self.weight if self.split_weight_grad else None)
            else:
                out = reduce_scatter_to_sequence_region(self._local_linear(x, weight, None), self.tp, dim)
        else:
            out = reduce_from_region(self._local_linear(x, weight, None), self.tp)
        if self.bias is not None:
            bias = self.bias.to_local()
            if self.sequence_parallel:
                # Each rank sees only its sequence block, so the bias gradient is a partial sum.
                bias = copy_to_region(bias, self.tp)
            out = out + bias
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"
