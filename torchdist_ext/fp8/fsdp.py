"""FSDP2 all-gathers the weights of fp8 linears in fp8: one byte per element instead of two (bf16) or four.

    model = convert_to_fp8(model, DelayedScaling(), fp8_all_gather=True)   # before fully_shard
    fully_shard(model, mesh=dp_mesh)                                       # then build the optimizer

``enable_fp8_all_gather`` wraps a weight in an ``Fp8AllGatherWeight``, whose FSDP2 hooks cast this rank's shard
with the delayed weight scale and hand the gathered bytes to the fp8 linear as a ``GatheredFp8Weight``. Why this
is exact and needs no extra collective: docs/architecture.md, "fp8".
"""

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import DTensor

from torchdist_ext.fp8.state import ROLES
from torchdist_ext.ops import fp8_cast_amax

__all__ = ["Fp8AllGatherWeight", "GatheredFp8Weight", "enable_fp8_all_gather", "fold_gathered_weight_amax_"]

_WEIGHT = ROLES.index("weight")  # the weight's column of the amax history, entry of the scales

# FSDP2 pads, slices, copies and moves a parameter's local tensor: those ops keep the wrapper (as torchao's
# weight wrappers do); every other op sees the plain tensor inside and returns plain tensors.
_OPS_KEEPING_THE_WRAPPER = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """A full-precision weight (or FSDP2's shard of it) whose FSDP2 all-gather carries fp8 bytes.

    Behaves as the tensor it wraps (same shape, dtype and device) in every op; FSDP2's padding, slicing, copies
    and moves keep the wrapper, every other op returns plain tensors. Around each all-gather FSDP2 calls:

        fsdp_pre_all_gather:  this rank's shard [rows/dp (padded), in] -> fp8 bytes cast with the module's
                              delayed weight scale (tdx::fp8_cast_amax; the shard's amax goes into the
                              module's ``gathered_weight_amax``, which ``fp8_step`` folds into the weight's
                              history row and reduces with every other amax)
        all-gather:           the bytes (uint8: every backend carries them)
        fsdp_post_all_gather: the gathered bytes -> a ``GatheredFp8Weight`` [rows, in]: the fp8 weight and its
                              inverse scale, in the unsharded parameter's place

    The owning module (an fp8 linear with a delayed recipe) provides the scale and records the amax.

    Args:
        tensor: the full-precision weight, or its local tensor for a DTensor weight; kept as ``_tensor``.
    """

    _tensor: Tensor

    @staticmethod
    def __new__(cls, tensor: Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor):
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _OPS_KEEPING_THE_WRAPPER:
            return out
        return pytree.tree_map_only(Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner_tensors["_tensor"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard cast to fp8 with ``module``'s delayed weight scale, as uint8 bytes padded to
        FSDP2's padded shard rows; metadata: the inverse scale and the unsharded size."""
        if tuple(self.shape[1:]) != tuple(outer_size[1:]):
            raise NotImplementedError(f"fp8 all-gather needs FSDP2's dim-0 sharding of the weight, got a shard of "
                                      f"shape {tuple(self.shape)} of {tuple(outer_size)}")
        _check_scale_is_shared(mesh, module)
        scale = module.scale[_WEIGHT:_WEIGHT + 1]
        with torch.no_grad():
            shard_fp8, amax = fp8_cast_amax(self._tensor, scale, torch.float8_e4m3fn)
            torch.maximum(module.gathered_weight_amax, amax, out=module.gathered_weight_amax)
            shard_bytes = shard_fp8.view(torch.uint8)
            # The shard dim is the mesh's last (HSDP: replicate x shard); torch 2.11's mesh.size takes no -1.
            padded_rows = -(-outer_size[0] // mesh.size(mesh.ndim - 1))
            if shard_bytes.shape[0] not in (padded_rows, outer_size[0]):  # an uneven or empty shard
                padded = shard_bytes.new_zeros((padded_rows, *shard_bytes.shape[1:]))
                padded[:shard_bytes.shape[0]] = shard_bytes
                shard_bytes = padded
            inverse_scale = scale.reciprocal()
        return (shard_bytes,), (inverse_scale, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered bytes as a ``GatheredFp8Weight`` of the unsharded size in ``param_dtype`` (FSDP2's
        first all-gather), or ``out``'s inverse scale refreshed (later all-gathers write the same storage)."""
        (gathered,) = all_gather_outputs
        inverse_scale, size = metadata
        if inverse_scale.is_cuda:  # made on FSDP2's all-gather stream, read by the GEMMs on this one
            inverse_scale.record_stream(torch.cuda.current_stream(inverse_scale.device))
        if out is not None:
            local = out._local_tensor if isinstance(out, DTensor) else out
            local._inverse_scale = inverse_scale  # not in place: a forward's autograd may have saved the old one
            return None
        data = gathered[:size[0]].view(torch.float8_e4m3fn)
        return GatheredFp8Weight(data, inverse_scale, param_dtype), (gathered,)


class GatheredFp8Weight(torch.Tensor):
    """An unsharded weight as FSDP2 gathered it, posing as a ``dtype`` tensor of its shape so that FSDP2 and
    autograd treat it as the parameter. Only the fp8 linear reads it (its forward uses the bytes as they are,
    without casting the weight again); other ops raise.

    Args:
        data: the gathered fp8 weight (e4m3, ``[out, in]``), kept as ``_data``.
        inverse_scale: fp32, one element: the reciprocal of the scale the shards were cast with, kept as
            ``_inverse_scale``.
        dtype: the dtype it poses as (the unsharded parameter's: FSDP2's ``param_dtype``).
    """

    _data: Tensor
    _inverse_scale: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, inverse_scale: Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=dtype, device=data.device)

    def __init__(self, data: Tensor, inverse_scale: Tensor, dtype: torch.dtype):
        self._data, self._inverse_scale = data, inverse_scale

    def __repr__(self) -> str:
        return f"GatheredFp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, inverse_scale={self._inverse_scale})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        (self, *rest), kwargs = args, kwargs or {}
        if func is torch.ops.aten.zeros_like.default:  # FSDP2's zero gradient of an unused parameter
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        aliasing = func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
        same_view = (func in (torch.ops.aten.view.default, torch.ops.aten.as_strided.default)
                     and tuple(rest[0]) == tuple(self.shape))
        if not (aliasing or same_view):
            raise NotImplementedError(
                f"{func} on a weight that FSDP2 all-gathered in fp8: only the fp8 linear that owns it reads it "
                f"(convert_to_fp8(..., fp8_all_gather=False) keeps full-precision gathers)")
        return cls(self._data, self._inverse_scale, self.dtype)

    def __tensor_flatten__(self):
        return ["_data", "_inverse_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return GatheredFp8Weight(inner_tensors["_data"], inner_tensors["_inverse_scale"], dtype)


def _check_scale_is_shared(mesh, module) -> None:
    """Every FSDP rank must cast with the same weight scale: fp8_step reduces the amaxes over the module's
    ``amax_reduction_mesh`` (None: the whole world), which must include the FSDP ranks."""
    reduction = module.amax_reduction_mesh
    if reduction is None:
        return
    fsdp_ranks, reduced = set(mesh.mesh.flatten().tolist()), set(reduction.mesh.flatten().tolist())
    if not fsdp_ranks <= reduced:
        raise ValueError(f"fp8 all-gather: the amax_reduction_mesh (ranks {sorted(reduced)}) must include the FSDP "
                         f"ranks {sorted(fsdp_ranks)}, or their shards would be cast with different scales")


def enable_fp8_all_gather(module: torch.nn.Module) -> None:
    """Makes FSDP2 all-gather ``module.weight`` in fp8: the weight (a Parameter, plain or a DTensor) becomes a
    Parameter whose (local) tensor is an ``Fp8AllGatherWeight`` with the same values, placements and
    ``requires_grad``; the module's ``state_dict`` keeps holding the plain tensor (so checkpoints load into
    any model, fp8 gathers or not).

    ``module``: an fp8 linear with a delayed recipe, before ``fully_shard``. Every data-parallel rank casts with
    the same scale as long as ``fp8_step`` reduces the amaxes over them (``reduce_amax=True`` with an
    ``amax_reduction_mesh`` that includes the FSDP ranks; the default, the whole world, does; checked at the
    gather). The gathered bytes equal the cast of the whole weight (under a bf16 ``param_dtype`` the shard is
    cast to fp8 directly, skipping the bf16 rounding a bf16 gather applies first).

    Limits: FSDP2's default dim-0 sharding; ``reshard_after_forward`` True or False (an int reshards the
    gathered bytes to a smaller mesh, which FSDP2 does not support for all-gather extensions); under a
    ``set_post_optim_event`` the event must be recorded after ``fp8_step`` (the gathers read the new scales);
    weights tied between converted linears are not supported (each gets its own Parameter)."""
    weight = module.weight
    with torch.no_grad():
        if isinstance(weight, DTensor):
            wrapped = DTensor.from_local(Fp8AllGatherWeight(weight.to_local().detach()), weight.device_mesh,
                                         weight.placements, run_check=False, shape=weight.shape,
                                         stride=weight.stride())
        else:
            wrapped = Fp8AllGatherWeight(weight.detach())
    module.weight = torch.nn.Parameter(wrapped, requires_grad=weight.requires_grad)
    module.register_state_dict_post_hook(_plain_weight_in_state_dict)
    # The gathers' amax has a buffer of its own: FSDP2 gathers again before the backward, and a compiled
    # block's backward holds the amax history (it records the output gradient's amax there), so a write
    # into the history between the two would invalidate it.
    module.register_buffer("gathered_weight_amax", torch.zeros((), dtype=torch.float32, device=weight.device),
                           persistent=False)


def fold_gathered_weight_amax_(module: torch.nn.Module) -> None:
    """Moves the amax of the step's fp8 weight gathers (if the module's weight is gathered in fp8) into the
    weight's row of the amax history; ``fp8_step`` calls it before reducing the amaxes."""
    gathered = getattr(module, "gathered_weight_amax", None)
    if gathered is not None:
        torch.maximum(module.amax_history[0, _WEIGHT], gathered, out=module.amax_history[0, _WEIGHT])
        gathered.zero_()


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    weight = state_dict.get(key)
    if isinstance(weight, DTensor) and isinstance(weight._local_tensor, Fp8AllGatherWeight):
        state_dict[key] = DTensor.from_local(weight._local_tensor._tensor, weight.device_mesh, weight.placements,
                                             run_check=False, shape=weight.shape, stride=weight.stride())
    elif isinstance(weight, Fp8AllGatherWeight):
        state_dict[key] = weight._tensor
