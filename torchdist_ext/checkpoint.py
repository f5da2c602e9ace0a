"""Distributed checkpoints of a model held as parts (pipeline stages) with one optimizer per part, loadable at
any other layout: another dp / tp / cp / pp split, or one process.

    torchdist_ext.checkpoint.save(path, parts, optimizers, extra={"step": step, "sampler": sampler.state_dict()})
    extra = torchdist_ext.checkpoint.load(path, parts, optimizers, extra={"step": 0, "sampler": {...}})
    step = torchdist_ext.checkpoint.load_extra(path, {"step": 0})["step"]   # no model, no process group
    path = torchdist_ext.checkpoint.latest(directory)   # its step-N checkpoint of the largest N
    torchdist_ext.checkpoint.save(path, [model], [inner_optimizer], diloco=diloco)   # island 0 writes

Every entry is keyed by the full model's parameter and buffer names (a part must keep them: a pipeline stage
holds its modules under the names they have in the whole model), the optimizer state flattened per parameter
(``state.<name>.exp_avg``, ``param_groups.<name>.lr``), so a rank loads exactly the entries of the parts it now
holds, resharded by ``torch.distributed.checkpoint`` from whatever shards wrote them. Buffers (fp8 amax
histories) travel with the model. ``extra``: small picklable values (step, data position), written once.
With ``diloco`` (a ``torchdist_ext.diloco.DiLoCo`` over ``parts``) only island 0 writes, its outer optimizer's
state, the parameters at their last sync and the inner step count beside its model and inner optimizer; a load
at any island count gives every island island 0's state.
A checkpoint that cannot be read (a corrupt or foreign metadata or shard file) raises ValueError naming it.
"""

import copy
import pickle
import re
import warnings
import zipfile
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

__all__ = ["latest", "load", "load_extra", "save"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_NOT_OURS = "is corrupt or not a checkpoint written by torchdist_ext.checkpoint"
# What decoding a damaged file raises (DCP unpickles the metadata and each value; torch.load reads zip archives).
_DECODING_ERRORS = (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, UnicodeDecodeError)


def _checked(parts: Sequence[nn.Module], optimizers: Sequence[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
    if isinstance(parts, nn.Module) or isinstance(optimizers, Optimizer):
        raise TypeError("parts and optimizers must be sequences (one module: [module], [optimizer])")
    parts, optimizers = list(parts), list(optimizers)
    if not all(isinstance(p, nn.Module) for p in parts):
        raise TypeError(f"parts must be nn.Modules, got {[type(p).__name__ for p in parts]}")
    if not all(isinstance(o, Optimizer) for o in optimizers):
        raise TypeError(f"optimizers must be torch.optim.Optimizers, got {[type(o).__name__ for o in optimizers]}")
    if len(parts) != len(optimizers):
        raise ValueError(f"one optimizer per part: got {len(parts)} parts and {len(optimizers)} optimizers")
    for index, (part, optimizer) in enumerate(zip(parts, optimizers)):
        mine = {id(p) for p in part.parameters()}
        if any(id(p) not in mine for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(f"optimizers[{index}] holds parameters that are not in parts[{index}]")
    return parts, optimizers


def _check_extra(extra: Any, where: str = "extra") -> None:
    """``extra``: None or a dict with string keys (nested dicts too): DCP keys its entries by those strings."""
    if extra is None and where == "extra":
        return
    if not isinstance(extra, dict):
        if where == "extra":
            raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
        return
    for key, value in extra.items():
        if not isinstance(key, str):
            raise TypeError(f"{where} keys must be strings, got {key!r}")
        _check_extra(value, f"{where}[{key!r}]")


def _per_part(parts, optimizers, *, saving: bool) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each part's (model, flattened optimizer) state dict. torch builds a never-stepped optimizer's state by
    stepping it with lr 0, and only when no parameter has a gradient: the gradients are set aside meanwhile;
    saving leaves such an optimizer as it was, with no state to save."""
    grads = {p: p.grad for part in parts for p in part.parameters()}
    fresh = [not optimizer.state for optimizer in optimizers]
    try:
        for p in grads:
            p.grad = None
        per_part = [get_state_dict(part, optimizer, options=_OPTIONS) for part, optimizer in zip(parts, optimizers)]
    finally:
        for p, grad in grads.items():
            p.grad = grad
    if saving:
        for (_, optimizer_state), optimizer, was_fresh in zip(per_part, optimizers, fresh):
            if was_fresh:
                for key in [k for k in optimizer_state if k.startswith("state.")]:
                    del optimizer_state[key]
                optimizer.state.clear()
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
        state["extra"] = copy.deepcopy(extra)
    return state


def _first_failure(error: CheckpointException) -> tuple[BaseException, list]:
    """The first failing rank's exception and its stack frames (DCP's failures hold (exception, frames) pairs)."""
    failure = next(iter(error.failures.values()), (error, []))
    return failure if isinstance(failure, tuple) else (failure, [])


def _failure_message(checkpoint_id: str | PathLike, error: CheckpointException, *, loading: bool) -> str:
    """One line on why DCP failed, without its stack frames (chain the error for those). A failure while
    reading the shard files' contents means a damaged file: said so, without torch.load's advice to unpickle
    it unsafely."""
    failure, frames = _first_failure(error)
    text = next((line.strip() for line in str(failure).splitlines() if line.strip()), type(failure).__name__)
    if not loading:
        return f"checkpoint {checkpoint_id}: {text}"
    if isinstance(failure, FileNotFoundError):
        return f"checkpoint {checkpoint_id}: its shard file {failure.filename or '(*.distcp)'} is missing"
    reading = any(getattr(frame, "name", None) in ("read_data", "load_bytes") for frame in frames)
    if reading or isinstance(failure, _DECODING_ERRORS) or "weights_only" in str(failure):
        return (f"checkpoint {checkpoint_id}: a shard file (*.distcp) {_NOT_OURS} "
                f"({type(failure).__name__} while reading it)")
    return f"checkpoint {checkpoint_id}: {text}"


def _check_diloco(diloco, parts: list[nn.Module]) -> None:
    from torchdist_ext.diloco import DiLoCo

    if diloco is not None and not isinstance(diloco, DiLoCo):
        raise TypeError(f"diloco must be a torchdist_ext.diloco.DiLoCo or None, got {type(diloco).__name__}")
    if diloco is not None and not any(diloco.model is part for part in parts):
        raise ValueError("diloco's model must be one of parts")


def _diloco_state(diloco, *, saving: bool) -> dict[str, Any]:
    """The DiLoCo's entries: its outer optimizer's flattened state, the synced parameters, the inner steps."""
    (_, outer), = _per_part([diloco.model], [diloco.outer], saving=saving)
    return {"outer": outer, "synced": diloco.synced_tensors(), "inner_steps": diloco.inner_steps}


def save(checkpoint_id: str | PathLike, parts: Sequence[nn.Module], optimizers: Sequence[Optimizer], *,
         extra: dict[str, Any] | None = None, diloco=None) -> None:
    """Writes this rank's parts and optimizers (and ``extra``) into the checkpoint ``checkpoint_id`` (a
    directory); every rank calls it. The optimizers are left as they were (one never stepped saves no state).
    With ``diloco`` the ranks of island 0 write (and its DiLoCo state), the others wait for them."""
    parts, optimizers = _checked(parts, optimizers)
    _check_extra(extra)
    _check_diloco(diloco, parts)
    if diloco is None or diloco.in_first_island:
        state = _merged(_per_part(parts, optimizers, saving=True), extra)
        if diloco is not None:
            state["diloco"] = _diloco_state(diloco, saving=True)
        try:
            dcp.save(state, checkpoint_id=checkpoint_id,
                     process_group=None if diloco is None else diloco.first_island)
        except CheckpointException as error:
            raise ValueError(_failure_message(checkpoint_id, error, loading=False)) from error
    if diloco is not None:
        dist.barrier()  # the checkpoint is complete before any island reads it


def _saved_keys(checkpoint_id: str | PathLike) -> set[str]:
    """The entries the checkpoint holds, from its metadata file: FileNotFoundError without one, ValueError
    naming it when it cannot be read or is not DCP's."""
    metadata_file = Path(checkpoint_id) / ".metadata"
    try:
        metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    except (FileNotFoundError, NotADirectoryError) as error:
        raise FileNotFoundError(f"no checkpoint at {checkpoint_id}: {error}") from error
    except OSError as error:
        raise ValueError(f"checkpoint {checkpoint_id}: cannot read its metadata file {metadata_file}: "
                         f"{error.strerror or type(error).__name__}") from error
    except Exception as error:  # unpickling a damaged file raises whatever its bytes lead to
        raise ValueError(f"checkpoint {checkpoint_id}: its metadata file {metadata_file} {_NOT_OURS}") from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"checkpoint {checkpoint_id}: its metadata file {metadata_file} {_NOT_OURS} (it holds a "
                         f"{type(metadata).__name__})")
    return set(metadata.state_dict_metadata)


def _dcp_load(state: dict[str, Any], checkpoint_id: str | PathLike, **kwargs) -> None:
    """``dcp.load`` in place, a failure raised as ValueError naming the checkpoint."""
    try:
        dcp.load(state, checkpoint_id=checkpoint_id, **kwargs)
    except CheckpointException as error:
        raise ValueError(_failure_message(checkpoint_id, error, loading=True)) from error


def _check_hyperparameters(optimizer: Optimizer, part: nn.Module, loaded: dict[str, Any], index: int) -> None:
    """Refuses to merge parameters saved with different hyperparameters into one param group."""
    name_of = {id(p): name for name, p in part.named_parameters()}
    for group in optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"]]
        for key in group:
            values = {repr(loaded[f"param_groups.{n}.{key}"]) for n in names if f"param_groups.{n}.{key}" in loaded}
            if len(values) > 1:
                raise ValueError(f"optimizers[{index}]: one param group would get the saved {key} values "
                                 f"{sorted(values)} of its parameters; give them param groups of their own")


def load(checkpoint_id: str | PathLike, parts: Sequence[nn.Module], optimizers: Sequence[Optimizer], *,
         extra: dict[str, Any] | None = None, diloco=None) -> dict[str, Any] | None:
    """Loads the checkpoint ``checkpoint_id`` into this rank's parts and optimizers, whatever layout wrote it;
    returns the saved values of ``extra``'s keys (``extra`` gives their structure; it is not changed). An
    optimizer whose parameters have no saved state (saved before its first step) is left without state.
    With ``diloco``, its state too (island 0's, at any island count). Every rank calls it."""
    parts, optimizers = _checked(parts, optimizers)
    _check_extra(extra)
    _check_diloco(diloco, parts)
    saved = _saved_keys(checkpoint_id)
    if diloco is not None and "diloco.inner_steps" not in saved:
        raise ValueError(f"checkpoint {checkpoint_id} holds no DiLoCo state (it was saved without diloco=)")
    per_part = _per_part(parts, optimizers, saving=False)
    kept = []  # hyperparameters the checkpoint lacks (e.g. a scheduler's initial_lr): this run's values stay
    for _, optimizer_state in per_part:  # state that was never saved stays unloaded
        missing = [k for k in optimizer_state if f"optimizer.{k}" not in saved]
        kept.append({k: optimizer_state[k] for k in missing if k.startswith("param_groups.")})
        for key in missing:
            del optimizer_state[key]
    state = _merged(per_part, extra)
    if diloco is not None:
        state["diloco"] = _diloco_state(diloco, saving=False)
        outer = state["diloco"]["outer"]
        for key in [k for k in outer if f"diloco.outer.{k}" not in saved]:  # never stepped: no state saved
            del outer[key]
    _dcp_load(state, checkpoint_id)  # in place: each entry resharded from the saved shards (the synced too)
    for (_, optimizer_state), hyperparameters in zip(per_part, kept):
        optimizer_state.update(hyperparameters)
        state["optimizer"].update(hyperparameters)
    for index, ((model, optimizer_state), part, optimizer) in enumerate(zip(per_part, parts, optimizers)):
        _check_hyperparameters(optimizer, part, {k: state["optimizer"][k] for k in optimizer_state}, index)
        model_state = {name: state["model"][name] for name in model}
        loaded = {name: state["optimizer"][name] for name in optimizer_state}
        if any(k.startswith("state.") for k in loaded):
            set_state_dict(part, optimizer, model_state_dict=model_state, optim_state_dict=loaded, options=_OPTIONS)
        else:  # saved before its first step: the hyperparameters, no state (torch cannot unflatten none)
            set_model_state_dict(part, model_state, options=_OPTIONS)
            optimizer.state.clear()
            _set_hyperparameters(optimizer, part, loaded)
    if diloco is not None:
        _load_diloco(diloco, state["diloco"])
    return state.get("extra")


def _load_diloco(diloco, loaded: dict[str, Any]) -> None:
    """The outer optimizer's state and the inner step count (the synced parameters were loaded in place)."""
    outer = loaded["outer"]
    if any(k.startswith("state.") for k in outer):
        set_optimizer_state_dict(diloco.model, diloco.outer, outer, options=_OPTIONS)
    else:
        diloco.outer.state.clear()
        _set_hyperparameters(diloco.outer, diloco.model, outer)
    diloco.inner_steps = int(loaded["inner_steps"])


def latest(path: str | PathLike) -> Path:
    """``path`` when it holds a checkpoint (its ``.metadata``), else the ``step-N`` directory in it of the largest
    N that holds one (a run saving every few steps); FileNotFoundError naming ``path`` when there is none."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    steps = [(int(match[1]), child) for child in (path.iterdir() if path.is_dir() else ())
             if (match := re.fullmatch(r"step-(\d+)", child.name, re.ASCII)) and (child / ".metadata").is_file()]
    if not steps:
        raise FileNotFoundError(f"{path} holds no checkpoint: neither its .metadata nor a step-N directory with one")
    return max(steps)[1]


def load_extra(checkpoint_id: str | PathLike, extra: dict[str, Any]) -> dict[str, Any]:
    """The saved values of ``extra``'s keys (``extra`` gives their structure; it is not changed), read without
    a model or a process group: what a run needs before it builds them (the step it resumes at). Each process
    that calls it reads on its own."""
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    _check_extra(extra)
    _saved_keys(checkpoint_id)
    state = {"extra": copy.deepcopy(extra)}
    with warnings.catch_warnings():  # DCP warns that it reads in one process: what no_dist=True asks
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        _dcp_load(state, checkpoint_id, no_dist=True)
    return state["extra"]


def _set_hyperparameters(optimizer: Optimizer, part: nn.Module, loaded: dict[str, Any]) -> None:
    name_of = {id(p): name for name, p in part.named_parameters()}
    for group in optimizer.param_groups:
        first = name_of[id(group["params"][0])]
        for key in group:
            if f"param_groups.{first}.{key}" in loaded:
                group[key] = loaded[f"param_groups.{first}.{key}"]
