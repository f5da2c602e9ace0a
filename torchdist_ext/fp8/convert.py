"""Turning a model's linears (``nn.Linear`` and our tensor-parallel ones) into fp8 ones, and the
once-per-step scale update.

    convert_to_fp8(model, recipe, *, amax_reduction_mesh=None, filter_fn=None) -> model   (in place)
    fp8_step(model)   after optimizer.step(): reduce the step's amaxes, update every scale, roll the histories

``fp8_step`` reduces the amaxes of all fp8 modules of the model with ONE all-reduce(MAX): their history rows
0 (input, weight and grad_output of every module) are stacked into one buffer. A NaN amax is sent as +inf
(collectives' MAX may drop NaN), so every rank sees a non-finite amax and keeps its scale, as the rule says;
ranks then agree on every scale exactly. Under tensor parallelism with sequence parallelism a rank casts only
its part of the input, so without this reduction the ranks' scales would differ.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchdist_ext.agreement import check_agreement
from torchdist_ext.fp8.fsdp import enable_fp8_all_gather, fold_gathered_weight_amax_
from torchdist_ext.fp8.linear import Fp8Linear
from torchdist_ext.fp8.recipe import TENSORWISE, BlockScaling, CurrentScaling, DelayedScaling, Recipe, RowwiseScaling
from torchdist_ext.fp8.scaling import update_delayed_scales_
from torchdist_ext.fp8.state import Fp8State

__all__ = ["convert_to_fp8", "fp8_modules", "fp8_step"]


def _local_features(module: nn.Module) -> tuple[int, int] | None:
    """The (out, in) features of the GEMM a convertible module runs on this rank, or None. Convertible: an
    ``nn.Linear``, or a module with fp8 state not yet enabled (our tensor-parallel linears, whose weight is
    a DTensor: its local shard counts)."""
    if type(module) is nn.Linear:
        return module.out_features, module.in_features
    if isinstance(module, Fp8State) and module.fp8_recipe is None:
        weight = module.weight
        return tuple((weight.to_local() if isinstance(weight, DTensor) else weight).shape)
    return None


def _converted_settings(module: nn.Module) -> dict[str, object] | None:
    """The conversion settings of a module that already has fp8 state (an earlier ``convert_to_fp8``, or an
    ``Fp8Linear`` built as one), else None."""
    if not isinstance(module, Fp8State) or module.fp8_recipe is None:
        return None
    return {"recipe": module.fp8_recipe, "amax_reduction_mesh": module.amax_reduction_mesh,
            "fp8_all_gather": getattr(module, "gathered_weight_amax", None) is not None}


def _refuse_another_conversion(name: str, module: nn.Module, asked: dict[str, object]) -> None:
    """Converting a module that already has fp8 state with the settings it has changes nothing; with others it is
    refused: its state (amax history, scales, fp8 weight) was built for the first ones, and keeping them would
    leave the new ones silently unapplied."""
    has = _converted_settings(module)
    where = f"module {name!r}" if name else "the model"
    for key, value in asked.items():
        if has[key] != value:
            raise ValueError(f"convert_to_fp8: {where} ({type(module).__name__}) is already converted "
                             f"with {key}={has[key]!r}, and was asked again with {key}={value!r}: a module is "
                             f"converted once (pass the same {key}, or exclude it with filter_fn)")


def convert_to_fp8(model: nn.Module, recipe: Recipe, *, amax_reduction_mesh=None,
                   filter_fn: Callable[[str, nn.Module], bool] | None = None,
                   fp8_all_gather: bool = False) -> nn.Module:
    """Turns, in place, the linears of ``model`` that ``filter_fn(fully_qualified_name, module)`` accepts
    (default: all) and whose GEMM's features (this rank's shard under tensor parallelism) are multiples of
    16 into fp8 ones: every ``nn.Linear`` is replaced by an ``Fp8Linear`` holding the same parameters;
    ``ColumnParallelLinear`` and ``RowParallelLinear`` stay themselves, gaining the fp8 state (so names,
    DTensor placements and FSDP2 / DCP see the same model). ``amax_reduction_mesh``: the DeviceMesh whose
    ranks reduce their amaxes in ``fp8_step`` (None: the default process group; under tensor parallelism
    it must include the tp ranks). Returns ``model`` (an ``nn.Linear`` passed as the model is returned
    converted).

    ``fp8_all_gather=True``: FSDP2 (``fully_shard`` after this call) all-gathers each converted weight as fp8
    bytes cast with its delayed scale (``torchdist_ext.fp8.fsdp``); needs ``DelayedScaling(reduce_amax=True)``
    and an ``amax_reduction_mesh`` that includes the FSDP ranks (the default does). The weights become new
    Parameter objects (same values and placements): build the optimizer after ``fully_shard``, as FSDP2
    asks anyway.

    Collective over the amax-reduction group (the default group when ``amax_reduction_mesh`` is None, once
    torch.distributed is initialised): its ranks agree on the recipe and on the modules converted. A process
    that converts a model alone inside a distributed job wraps the call in
    ``torchdist_ext.set_agreement_checks("off")``.

    A module converted before (by an earlier call) is left as it is when this call asks for its settings
    (``recipe``, ``amax_reduction_mesh``, ``fp8_all_gather``), and refused with a ValueError, before anything
    changes, when it asks for others (``filter_fn`` may exclude it)."""
    def validate():
        if not isinstance(recipe, (DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling)):
            raise TypeError(f"recipe must be a DelayedScaling, CurrentScaling, RowwiseScaling or BlockScaling, got "
                            f"{type(recipe).__name__}")
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(f"filter_fn must be callable(name, module) -> bool, got {type(filter_fn).__name__}")
        if not isinstance(fp8_all_gather, bool):
            raise TypeError(f"fp8_all_gather must be a bool, got {fp8_all_gather!r}")
        if fp8_all_gather and not (isinstance(recipe, DelayedScaling) and recipe.reduce_amax):
            raise ValueError(f"fp8_all_gather=True needs DelayedScaling(reduce_amax=True): every FSDP rank must "
                             f"cast its shard with the same scale, known before the gather; got {recipe}")
        if not isinstance(recipe, TENSORWISE):
            parallel = [name for name, module in model.named_modules() if chosen(name, module)
                        and not isinstance(module, (nn.Linear, Fp8Linear)) and module.tp.size > 1]
            if parallel:
                raise ValueError(f"{type(recipe).__name__} runs on unsharded linears for now; these tensor-parallel "
                                 f"layers (tp > 1) take a tensorwise recipe (DelayedScaling, CurrentScaling): "
                                 f"{parallel}")
        asked = {"recipe": recipe, "amax_reduction_mesh": amax_reduction_mesh, "fp8_all_gather": fp8_all_gather}
        for name, module in model.named_modules():
            if _converted_settings(module) is not None and (filter_fn is None or filter_fn(name, module)):
                _refuse_another_conversion(name, module, asked)

    def chosen(name: str, module: nn.Module) -> bool:
        features = _local_features(module)
        return not (features is None or any(f % 16 for f in features)
                    or (filter_fn is not None and not filter_fn(name, module)))

    # The ranks that reduce amaxes together agree on the recipe and on which modules turn fp8 (fp8_step stacks
    # their amaxes into one buffer), or all refuse.
    if isinstance(amax_reduction_mesh, DeviceMesh) and amax_reduction_mesh.ndim == 1:
        group = amax_reduction_mesh.get_group()
    else:  # the default process group (a bad mesh is refused below, by enable_fp8)
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    check_agreement(group, "convert_to_fp8", lambda: {
        "recipe": recipe, "fp8_all_gather": fp8_all_gather,
        "converted modules": [name for name, module in model.named_modules() if chosen(name, module)]}, validate)

    def converted(name: str, module: nn.Module) -> nn.Module | None:
        if not chosen(name, module):
            return None
        if type(module) is nn.Linear:
            module = Fp8Linear.from_linear(module, recipe, amax_reduction_mesh=amax_reduction_mesh)
        else:
            module.enable_fp8(recipe, amax_reduction_mesh=amax_reduction_mesh, device=module.weight.device)
        if fp8_all_gather:
            enable_fp8_all_gather(module)
        return module

    root = converted("", model)
    if root is not None:
        return root
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            replacement = converted(f"{name}.{child_name}" if name else child_name, child)
            if replacement is not None and replacement is not child:
                setattr(module, child_name, replacement)
    return model


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` with fp8 GEMMs, in module order."""
    return [m for m in model.modules() if isinstance(m, Fp8State) and m.fp8_recipe is not None]


@torch.no_grad()
def _agree_on_step(modules: list[nn.Module]) -> None:
    """The ranks that reduce amaxes together (the first module's ``amax_reduction_mesh``, the default group
    without one) agree on their modules' recipes before any reduction: a rank whose modules were converted with
    another recipe (``Fp8Linear.from_linear`` takes one per call) would otherwise reduce alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    mesh = modules[0].amax_reduction_mesh
    recipes = list(dict.fromkeys(repr(m.fp8_recipe) for m in modules))
    reduces = any(isinstance(m.fp8_recipe, DelayedScaling) and m.fp8_recipe.reduce_amax for m in modules)
    check_agreement(None if mesh is None else mesh.get_group(), "fp8_step",
                    {"recipes": recipes, "reduces amaxes": reduces})


def fp8_step(model: nn.Module) -> None:
    """Once per optimizer step, on every rank: reduce this step's amaxes (one all-reduce over the modules'
    ``amax_reduction_mesh`` when the recipe says ``reduce_amax`` and a process group exists), then update
    every delayed scale and roll every history (``torchdist_ext.fp8.scaling``). No host sync."""
    converted = fp8_modules(model)
    if not converted:
        return
    _agree_on_step(converted)
    modules = [m for m in converted if isinstance(m.fp8_recipe, DelayedScaling)]
    if not modules:
        return
    mesh, reduce_amax = modules[0].amax_reduction_mesh, modules[0].fp8_recipe.reduce_amax
    for m in modules[1:]:
        if m.amax_reduction_mesh != mesh or m.fp8_recipe.reduce_amax != reduce_amax:
            raise ValueError(
                f"fp8_step: every fp8 module of the model must have one amax_reduction_mesh and one reduce_amax "
                f"(one collective for all); got {mesh} / reduce_amax={reduce_amax} and {m.amax_reduction_mesh} / "
                f"reduce_amax={m.fp8_recipe.reduce_amax}")
    for m in modules:
        fold_gathered_weight_amax_(m)
    if reduce_amax and dist.is_available() and dist.is_initialized():
        current = torch.stack([m.amax_history[0] for m in modules])  # [modules, roles]: one buffer
        current = torch.where(current.isnan(), float("inf"), current)
        dist.all_reduce(current, op=dist.ReduceOp.MAX, group=None if mesh is None else mesh.get_group())
        for m, row in zip(modules, current):
            m.amax_history[0].copy_(row)
    for m in modules:
        recipe = m.fp8_recipe
        update_delayed_scales_(m.amax_history, m.scale, m.fp8_max, recipe.margin, recipe.amax_compute_algo)
