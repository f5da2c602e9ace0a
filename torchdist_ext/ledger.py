"""The communication ledger: a c10d backend (C++, ``csrc/comm/ledger_backend.cpp``) that wraps gloo or NCCL and
counts, per process group and operation, the calls, the bytes this rank sends and receives and the time to
completion of everything that goes through the group, the ``tdx`` ops' rings and all-to-alls included.

    dist.init_process_group(ledger.backend("gloo"))                    # or "cpu:gloo,cuda:nccl"
    ... train ...
    ledger.read(mesh["tp"])                   -> {"all_gather_into_tensor": OpTally(calls, sent_bytes, ...), ...}
    ledger.by_label({"tp": mesh["tp"], "cp": [mesh["ring"], mesh["ulysses"]]})  -> {"tp": {...}, "cp": {...}}
    ledger.reset()                                                      # every group of the world
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchdist_ext import _C

__all__ = ["OpTally", "backend", "by_label", "read", "reset", "total"]

# The backends a ledger can wrap: the name it registers under -> the inner backend and the devices it serves.
_WRAPPABLE = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",)}
_PREFIX = "ledger_"
Group = dist.ProcessGroup | DeviceMesh


@dataclass(frozen=True)
class OpTally:
    """One operation's entry of a ledger, summed over its calls (``+`` adds two entries).

    Args:
        calls: the calls made.
        sent_bytes: the bytes this rank sent, as the ring algorithms move them (all-reduce 2(n-1)/n X, all-gather
            and reduce-scatter (n-1)/n of the full buffer, all-to-all the blocks to other ranks, send X): the
            convention of nccl-tests' bus bandwidth and of the planner's ``comm`` (``csrc/comm/ledger.h``).
        received_bytes: the bytes this rank received, by the same convention (recv X).
        seconds: from each call to the first time this rank sees it complete (on NCCL: the host side only).
    """

    calls: int = 0
    sent_bytes: float = 0.0
    received_bytes: float = 0.0
    seconds: float = 0.0

    def __add__(self, other: OpTally) -> OpTally:
        return OpTally(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _create(inner_name: str):
    """The creator function torch.distributed calls for a ``ledger_<inner_name>`` group."""

    def create(options, backend_options):
        plugin = dist.Backend._plugins.get(inner_name.upper())
        if plugin is not None and plugin.extended_api:  # torch >= 2.14 creates gloo and NCCL through plugins too
            inner = plugin.creator_fn(options, backend_options)
        elif inner_name == "gloo":
            inner = dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size,
                                          timeout=options.timeout)
            inner.options.global_ranks_in_group = options.global_ranks_in_group
            inner.options.group_name = options.group_id
        else:
            nccl_options = backend_options or dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = options.timeout
            nccl_options.global_ranks_in_group = options.global_ranks_in_group
            nccl_options.group_name = options.group_id
            inner = dist.ProcessGroupNCCL(options.store, options.group_rank, options.group_size, nccl_options)
        return _C.ledger_backend(inner, _PREFIX + inner_name)

    return create


def _typed_registration() -> bool:
    """Whether ``register_backend`` can file a ledger under its inner backend's type (torch >= 2.14). Older torch
    files every registered backend as CUSTOM, and a process group holds one backend per type, so a group cannot
    hold two ledgers (one per device)."""
    return "_backend_type" in dist.Backend.register_backend.__code__.co_varnames


def _register(inner_name: str) -> str:
    name = _PREFIX + inner_name
    if name.upper() not in dist.Backend._plugins:
        kwargs = {}
        backend_type = getattr(dist.ProcessGroup.BackendType, inner_name.upper(), None)
        if _typed_registration() and backend_type is not None:
            kwargs["_backend_type"] = backend_type
        dist.Backend.register_backend(name, _create(inner_name), extended_api=True,
                                      devices=list(_WRAPPABLE[inner_name]), **kwargs)
    return name


def backend(spec: str = "gloo") -> str:
    """The ``init_process_group`` / ``new_group`` backend string that wraps every backend of ``spec`` in a ledger:
    ``"gloo"`` -> ``"ledger_gloo"``, ``"cpu:gloo,cuda:nccl"`` -> ``"cpu:ledger_gloo,cuda:ledger_nccl"``.
    Registers the ledger backends with ``torch.distributed.Backend.register_backend``. Groups created later
    (``new_group``, ``init_device_mesh``) inherit the default group's backend, so every mesh of a run is counted.

    Before torch 2.14 a group holds one ledger only (see ``_typed_registration``): a spec with a backend per device
    then counts its cuda backend, leaves the cpu one uncounted, and says so with a warning."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a backend string such as 'gloo' or 'cpu:gloo,cuda:nccl', got {spec!r}")
    parsed = []
    for part in spec.split(","):
        device, _, inner = part.rpartition(":")
        device, inner = device.strip(), inner.strip().lower()
        if inner not in _WRAPPABLE:
            raise ValueError(f"spec={spec!r}: a ledger wraps {' or '.join(_WRAPPABLE)}, not {inner!r}")
        if device and device not in _WRAPPABLE[inner]:
            raise ValueError(f"spec={spec!r}: {inner} serves {', '.join(_WRAPPABLE[inner])}, not {device!r}")
        parsed.append((device, inner))
    uncounted = set()
    if len(parsed) > 1 and not _typed_registration():
        uncounted = {device for device, _ in parsed if device != "cuda"}
        warnings.warn(f"ledger.backend({spec!r}): torch {torch.__version__} gives a process group one registered "
                      "backend only, so the ledger counts the cuda backend and not the "
                      f"{', '.join(sorted(uncounted))} one (torch >= 2.14 counts both)", stacklevel=2)
    return ",".join(f"{device}:{inner if device in uncounted else _register(inner)}" if device else _register(inner)
                    for device, inner in parsed)


def _require_process_group(caller: str) -> None:
    """Refuses to read or reset ledgers before this process has a default process group (the ledgers live in
    its groups' backends)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"ledger.{caller}: no process group is initialised in this process; call "
                           "torch.distributed.init_process_group(ledger.backend(...)) first")


def _group_of(group, caller: str) -> dist.ProcessGroup:
    if group is not None and not isinstance(group, (DeviceMesh, dist.ProcessGroup)):
        raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None (the world), got "
                        f"{type(group).__name__}")
    _require_process_group(caller)
    if group is None:
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: a {group.ndim}-D mesh {group.mesh_dim_names} has several groups; pass a 1-D "
                             "mesh (mesh['tp']) or flatten it")
        return group.get_group()
    return group


def _ledgers(group: dist.ProcessGroup) -> list:
    """The ledger backends of ``group``, one per device type it serves (a backend shared by both counted once)."""
    found = {}
    for device in ("cpu", "cuda"):
        try:
            backend_ = group._get_backend(torch.device(device))
        except RuntimeError:  # no backend for this device
            continue
        if _C.is_ledger_backend(backend_):
            found.setdefault(_C.ledger_id(backend_), backend_)
    if not found:
        raise ValueError(f"group {group.group_name!r} ({dist.get_backend(group)}) is not counted: create it with "
                         "torchdist_ext.ledger.backend(...)")
    return list(found.values())


def read(group: Group | None = None) -> dict[str, OpTally]:
    """This rank's tallies per operation on ``group`` (a process group, a 1-D mesh, or None for the world)."""
    tallies: dict[str, OpTally] = {}
    for ledger in _ledgers(_group_of(group, "read")):
        for op, values in _C.ledger_tallies(ledger).items():
            tallies[op] = tallies.get(op, OpTally()) + OpTally(*values)
    return tallies


def total(tallies: Mapping[str, OpTally]) -> OpTally:
    """The sum of a ledger's tallies over its operations."""
    return sum(tallies.values(), OpTally())


def by_label(groups: Mapping[str, Group | Sequence[Group]], *, rest: str | None = None) -> dict[str, dict[str, OpTally]]:
    """Tallies per label, summed over the distinct groups given that label
    (``{"cp": [mesh["ring"], mesh["ulysses"]], "dp": fsdp_mesh}``). A group given several labels is counted once,
    under the labels joined: ``"dp+ep"``. With ``rest``, every other counted group of this rank is summed under
    that label."""
    _require_process_group("by_label")
    labels: dict[str, list[str]] = {}
    resolved: dict[str, dist.ProcessGroup] = {}
    if rest is not None:
        for pg in _counted_groups():
            labels[pg.group_name] = [rest]
            resolved[pg.group_name] = pg
    for label, members in groups.items():
        for group in members if isinstance(members, (list, tuple)) else [members]:
            pg = _group_of(group, "by_label")
            if labels.get(pg.group_name) == [rest]:
                del labels[pg.group_name]
            if label not in labels.setdefault(pg.group_name, []):
                labels[pg.group_name].append(label)
            resolved[pg.group_name] = pg
    result: dict[str, dict[str, OpTally]] = {}
    for name, pg in resolved.items():
        merged = result.setdefault("+".join(labels[name]), {})
        for op, tally in read(pg).items():
            merged[op] = merged.get(op, OpTally()) + tally
    return result


def reset(group: Group | None = None) -> None:
    """Empties the ledgers of ``group``, or of every counted group of this rank with None."""
    if group is not None:
        for ledger in _ledgers(_group_of(group, "reset")):
            _C.ledger_reset(ledger)
        return
    _require_process_group("reset")
    for pg in _counted_groups():
        for ledger in _ledgers(pg):
            _C.ledger_reset(ledger)


def _counted_groups() -> list[dist.ProcessGroup]:
    """This rank's process groups that a ledger counts."""
    counted = []
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            _ledgers(pg)
        except ValueError:  # a group created with another backend
            continue
        counted.append(pg)
    return counted
