"""``Fp8State``: what a module with fp8 GEMMs holds (its recipe and, as buffers, its amax history and scales),
shared by ``Fp8Linear`` and the tensor-parallel linears that ``convert_to_fp8`` turns to fp8."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext.fp8.recipe import BlockScaling, CurrentScaling, DelayedScaling, Recipe, RowwiseScaling
from torchdist_ext.fp8.scaling import FP8_MAX

__all__ = ["ROLES", "Fp8State"]

ROLES = ("input", "weight", "grad_output")


class Fp8State:
    """Mixin for an ``nn.Module``: ``fp8_recipe`` (None: the module runs in its own dtype),
    ``amax_reduction_mesh`` (a 1-D DeviceMesh, or None for the default process group), and the fp32
    buffers ``amax_history [L, 3]`` and ``scale [3]`` (roles input, weight, grad_output; L =
    amax_history_len, 1 under CurrentScaling; in the state_dict) and ``fp8_max [3]`` (each role's format
    maximum; not saved); with FSDP2's fp8 all-gather also ``gathered_weight_amax`` (0-d, not saved; see
    ``torchdist_ext.fp8.fsdp``). The buffers stay fp32 when the module is cast to another dtype."""

    fp8_recipe: Recipe | None = None
    amax_reduction_mesh: DeviceMesh | None = None
    _FP32_BUFFERS = ("amax_history", "scale", "fp8_max", "gathered_weight_amax")

    def enable_fp8(self: nn.Module, recipe: Recipe, *, amax_reduction_mesh: DeviceMesh | None = None,
                   device=None) -> None:
        """Gives the module its fp8 state: a zero history and scales of 1 (TransformerEngine's start)."""
        if not isinstance(recipe, (DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling)):
            raise TypeError(f"recipe must be a DelayedScaling, CurrentScaling, RowwiseScaling or BlockScaling, got "
                            f"{type(recipe).__name__}")
        if amax_reduction_mesh is not None and not isinstance(amax_reduction_mesh, DeviceMesh):
            raise TypeError(f"amax_reduction_mesh must be a DeviceMesh or None, got {type(amax_reduction_mesh).__name__}")
        if amax_reduction_mesh is not None and amax_reduction_mesh.ndim != 1:
            raise ValueError(f"amax_reduction_mesh must be 1-D (flatten a multi-dim mesh with _flatten()), got "
                             f"{amax_reduction_mesh.ndim}-D {amax_reduction_mesh}")
        self.fp8_recipe = recipe
        self.amax_reduction_mesh = amax_reduction_mesh
        history_len = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        fp32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("amax_history", torch.zeros(history_len, len(ROLES), **fp32))
        self.register_buffer("scale", torch.ones(len(ROLES), **fp32))
        grad_max = FP8_MAX[recipe.grad_dtype]
        self.register_buffer("fp8_max", torch.tensor([FP8_MAX[torch.float8_e4m3fn]] * 2 + [grad_max], **fp32),
                             persistent=False)

    def reset_fp8_state(self) -> None:
        """Back to the start (zero history, scales of 1): after ``to_empty()`` of a model built on the meta
        device, whose buffers hold no values."""
        with torch.no_grad():
            self.amax_history.zero_()
            self.scale.fill_(1.0)
            grad_max = FP8_MAX[self.fp8_recipe.grad_dtype]
            self.fp8_max.copy_(torch.tensor([FP8_MAX[torch.float8_e4m3fn]] * 2 + [grad_max]))
            if getattr(self, "gathered_weight_amax", None) is not None:  # fp8 all-gather (torchdist_ext.fp8.fsdp)
                self.gathered_weight_amax.zero_()

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` / ``.half()`` cast the parameters; the fp8 buffers keep their fp32 values (only
        moved to the new device)."""
        kept = {name: self._buffers[name] for name in self._FP32_BUFFERS if self._buffers.get(name) is not None}
        module = super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != torch.float32:
                self._buffers[name] = before.to(after.device)
        return module
