"""The rank-agreement check: before any payload travels, the ranks of a group agree on the call.

Every communicating ``tdx`` op, the ``MoE``, ``VocabParallelEmbedding``, Ulysses and hybrid attention layers
(eager), ``convert_to_fp8`` and the pipeline runtime compare, across their group, every argument that must
agree (shapes, dtypes, flags, scales, orders, recipe fields, expert counts), and whether each rank's own input
checks passed. A disagreement, or one rank's refusal, raises on every rank. Cost, modes and design:
docs/architecture.md ("Bad input and faults").

    set_agreement_checks("auto" | "on" | "off") -> the previous mode
    agreement_checks() -> the mode
    check_agreement(group, op, fields, validate=None)   for layers written in Python
"""

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchdist_ext import _C

__all__ = ["AGREEMENT_MODES", "agreement_checks", "check_agreement", "collective_device", "set_agreement_checks"]

AGREEMENT_MODES = ("auto", "on", "off")


def agreement_checks() -> str:
    """Which calls are checked: "auto" (every call on the CPU, the first 64 calls of each op on each group
    elsewhere), "on" (every call) or "off" (none; each rank still checks its own inputs, and a refusal on one
    rank leaves the others to the collective's timeout). ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every call
    whatever the mode."""
    return _C.agreement_checks()


def set_agreement_checks(mode: str) -> str:
    """Sets which calls are checked for this process (``TDX_AGREEMENT_CHECKS`` sets it at start-up); returns
    the previous mode. Every rank must set the same mode at the same point of its program."""
    if mode not in AGREEMENT_MODES:
        raise ValueError(f"mode must be one of {AGREEMENT_MODES}, got {mode!r}")
    return _C.set_agreement_checks(mode)


def collective_device(group: dist.ProcessGroup) -> str:
    """Where ``group``'s small host-side collectives run: "cpu" when it has a CPU backend (gloo), else this
    rank's GPU ("cuda:i")."""
    try:
        group._get_backend(torch.device("cpu"))
        return "cpu"
    except RuntimeError:
        return f"cuda:{torch.cuda.current_device()}"


def check_agreement(group: dist.ProcessGroup | str | None, op: str,
                    fields: Mapping[str, object] | Callable[[], Mapping[str, object]],
                    validate: Callable[[], None] | None = None) -> None:
    """Runs ``validate`` (this rank's checks of its own arguments), then makes sure that every rank of
    ``group`` passed its checks and passes equal ``fields``. Raises on every rank otherwise: this rank's own
    exception as it was; another rank's ``ValueError`` / ``TypeError`` (or a ``RuntimeError`` for any other
    exception) with that rank's message; or a ``ValueError`` naming the first field two ranks disagree on and
    both values. Without torch.distributed initialised, on a group of one rank, or while torch.compile traces
    (a collective with a data-dependent raise would break the graph; the ops inside check their own
    arguments), only ``validate`` runs.

    Args:
        group: the process group whose ranks make the call together, or its registered name (None: the
            default group).
        op: the call's name, for messages (e.g. "MoE").
        fields: name -> value, in a fixed order; names hold no "=" or newline. A tensor is compared by dtype
            and shape, anything else by its ``repr``. Or a function returning them, called after ``validate``
            (an exception it raises counts as this rank's refusal).
        validate: raises for arguments this rank refuses.
    """
    if torch.compiler.is_compiling():
        if validate is not None:
            validate()
        return
    own: Exception | None = None
    try:
        if validate is not None:
            validate()
        if callable(fields):
            fields = fields()
        text = _fields_text(op, fields)
    except Exception as error:  # noqa: BLE001 - every rank must learn of any refusal
        own, text = error, ""
    if isinstance(group, str):
        group = _resolve_process_group(group)
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        if own is not None:
            raise own
        return
    group = dist.group.WORLD if group is None else group
    message = "" if own is None else str(own) if isinstance(own, (ValueError, TypeError, RuntimeError)) else (
        f"{type(own).__name__}: {own}")
    try:
        _C.check_agreement(group.group_name, collective_device(group), op, text, _error_kind(own), message)
    except (ValueError, TypeError, RuntimeError):
        if own is not None:  # this rank's own exception, with its traceback
            raise own from None
        raise


def _fields_text(op: str, fields: Mapping[str, object]) -> str:
    """One "name=value" line per field (a tensor's value: its dtype and shape; else its repr, one line)."""
    lines = []
    for name, value in fields.items():
        if not isinstance(name, str) or "=" in name or "\n" in name:
            raise ValueError(f"check_agreement({op!r}): field names must be strings without '=' or newlines, "
                             f"got {name!r}")
        shown = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        lines.append(f"{name}={shown}".replace("\n", "\\n") + "\n")
    return "".join(lines)


def _error_kind(error: Exception | None) -> int:
    """The native check's code for an error: 0 none, 1 RuntimeError (and any other type), 2 ValueError,
    3 TypeError."""
    if error is None:
        return 0
    return 2 if isinstance(error, ValueError) else 3 if isinstance(error, TypeError) else 1
