"""``Fp8State``: what a module with fp8 GEMMs holds (its recipe and, as buffers, its amax history and scales),
shared by ``Fp8Linear`` and the tensor-parallel linears that ``convert_to_fp8`` turns to fp8."""

import torch
from torch import Tensor, nn

from torchdist_ext.fp8.recipe import CurrentScaling, DelayedScaling, Recipe
from torchdist_ext.fp8.scaling import FP8_MAX

__all__ = ["ROLES", "Fp8State"]

ROLES = ("input", "weight", "grad_output")


class Fp8State:
    """Mixin for an ``nn.Module``: ``fp8_recipe`` (None: the module runs in its own dtype),
    ``amax_reduction_mesh``, and the buffers ``amax_history [L, 3]`` and ``scale [3]`` (fp32; roles
    input, weight, grad_output; L = amax_history_len, 1 under CurrentScaling)."""

    fp8_recipe: Recipe | None = None
    amax_reduction_mesh = None

    def enable_fp8(self: nn.Module, recipe: Recipe, *, amax_reduction_mesh=None, device=None) -> None:
        """Gives the module its fp8 state: a zero history and scales of 1 (TransformerEngine's start)."""
        if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
            raise TypeError(f"recipe must be a DelayedScaling or a CurrentScaling, got {type(recipe).__name__}")
        self.fp8_recipe = recipe
        self.amax_reduction_mesh = amax_reduction_mesh
        history_len = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        self.register_buffer("amax_history", torch.zeros(history_len, len(ROLES), device=device))
        self.register_buffer("scale", torch.ones(len(ROLES), device=device))

    @property
    def fp8_max(self) -> Tensor:
        """[3] fp32: each role's format maximum (e4m3 for input and weight, the recipe's gradient format)."""
        grad_max = FP8_MAX[self.fp8_recipe.grad_dtype]
        return torch.tensor([FP8_MAX[torch.float8_e4m3fn]] * 2 + [grad_max], device=self.scale.device)
