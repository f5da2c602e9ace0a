"""Distributed checkpoints of a model held as parts (pipeline stages) with one optimizer per part, loadable at
any other layout: another dp / tp / cp / pp split, or one process.

    torchdist_ext.checkpoint.save(path, parts, optimizers, extra={"step": step, "sampler": sampler.state_dict()})
    extra = torchdist_ext.checkpoint.load(path, parts, optimizers, extra={"step": 0, "sampler": {...}})

Every entry is keyed by the full model's parameter and buffer names (a part must keep them: a pipeline stage
holds its modules under the names they have in the whole model), the optimizer state flattened per parameter
(``state.<name>.exp_avg``, ``param_groups.<name>.lr``), so a rank loads exactly the entries of the parts it now
holds, resharded by ``torch.distributed.checkpoint`` from whatever shards wrote them. Buffers (fp8 amax
histories) travel with the model. ``extra``: small picklable values (step, data position), written once.
"""

from collections.abc import Sequence
from os import PathLike
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

__all__ = ["load", "save"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _check_parts(parts: Sequence[nn.Module], optimizers: Sequence[Optimizer]) -> None:
    if not all(isinstance(p, nn.Module) for p in parts):
        raise TypeError(f"parts must be nn.Modules, got {[type(p).__name__ for p in parts]}")
    if not all(isinstance(o, Optimizer) for o in optimizers):
        raise TypeError(f"optimizers must be torch.optim.Optimizers, got {[type(o).__name__ for o in optimizers]}")
    if len(parts) != len(optimizers):
        raise ValueError(f"one optimizer per part: got {len(parts)} parts and {len(optimizers)} optimizers")


def _per_part(parts, optimizers) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    per_part = [get_state_dict(part, optimizer, options=_OPTIONS) for part, optimizer in zip(parts, optimizers)]
    names = [name for model, _ in per_part for name in model]
    if len(names) != len(set(names)):
        raise ValueError(f"parts must not share parameters or buffers: {sorted({n for n in names if names.count(n) > 1})}")
    return per_part


def _merged(per_part, extra: dict[str, Any] | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": {}, "optimizer": {}}
    for model, optimizer in per_part:
        state["model"].update(model)
        state["optimizer"].update(optimizer)
    if extra is not None:
        state["extra"] = dict(extra)
    return state


def save(checkpoint_id: str | PathLike, parts: Sequence[nn.Module], optimizers: Sequence[Optimizer], *,
         extra: dict[str, Any] | None = None) -> None:
    """Writes this rank's parts and optimizers (and ``extra``) into the checkpoint ``checkpoint_id`` (a
    directory); every rank calls it."""
    _check_parts(parts, optimizers)
    dcp.save(_merged(_per_part(parts, optimizers), extra), checkpoint_id=checkpoint_id)


def load(checkpoint_id: str | PathLike, parts: Sequence[nn.Module], optimizers: Sequence[Optimizer], *,
         extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Loads the checkpoint ``checkpoint_id`` into this rank's parts and optimizers, whatever layout wrote it;
    returns the saved values of ``extra``'s keys (``extra`` gives their structure). Every rank calls it."""
    _check_parts(parts, optimizers)
    per_part = _per_part(parts, optimizers)
    state = _merged(per_part, extra)
    dcp.load(state, checkpoint_id=checkpoint_id)  # in place: each entry resharded from the saved shards
    for (model, optimizer_state), part, optimizer in zip(per_part, parts, optimizers):
        set_state_dict(part, optimizer, model_state_dict={name: state["model"][name] for name in model},
                       optim_state_dict={name: state["optimizer"][name] for name in optimizer_state}, options=_OPTIONS)
    return state.get("extra")
