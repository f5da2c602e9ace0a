"""The rank-agreement check: before any payload travels, the ranks of a group agree on the call.

Every communicating ``tdx`` op, the ``MoE`` layer, ``convert_to_fp8`` and the pipeline runtime compare, across
their group, every argument that must agree (shapes, dtypes, flags, scales, orders, recipe fields, expert
counts), and whether each rank's own input checks passed. A disagreement, or one rank's refusal, raises on
every rank. Cost and design: docs/architecture.md ("The rank-agreement check").

    set_agreement_checks("auto" | "on" | "off") -> the previous mode
    agreement_checks() -> the mode
    check_agreement(group, op, fields, validate=None)   for layers written in Python
"""

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from torchdist_ext import _C

__all__ = ["AGREEMENT_MODES", "agreement_checks", "check_agreement", "set_agreement_checks"]

AGREEMENT_MODES = ("auto", "on", "off")


def agreement_checks() -> str:
    """Which calls are checked: "auto" (every call on the CPU, the first 64 calls of each op elsewhere), "on"
    (every call) or "off" (none; each rank still checks its own inputs)."""
    return _C.agreement_checks()


def set_agreement_checks(mode: str) -> str:
    """Sets which calls are checked for this process (``TDX_AGREEMENT_CHECKS`` sets it at start-up); returns
    the previous mode. Every rank must set the same mode at the same point of its program."""
    if mode not in AGREEMENT_MODES:
        raise ValueError(f"mode must be one of {AGREEMENT_MODES}, got {mode!r}")
    return _C.set_agreement_checks(mode)


def _collective_device(group: dist.ProcessGroup) -> str:
    """Where ``group``'s collectives run: the CPU when it has a CPU backend, else this rank's GPU."""
    try:
        group._get_backend(torch.device("cpu"))
        return "cpu"
    except RuntimeError:
        return f"cuda:{torch.cuda.current_device()}"


def check_agreement(group: dist.ProcessGroup | None, op: str,
                    fields: Mapping[str, object] | Callable[[], Mapping[str, object]],
                    validate: Callable[[], None] | None = None) -> None:
    """Runs ``validate`` (this rank's checks of its own arguments), then makes sure that every rank of
    ``group`` passed its checks and passes equal ``fields`` (each value compared as its ``repr``). Raises on
    every rank otherwise: this rank's own exception as it was, another rank's ``ValueError`` / ``TypeError`` /
    ``RuntimeError`` with that rank's message, or a ``ValueError`` naming the first field two ranks disagree
    on and both values. Without a process group, or on a group of one rank, only ``validate`` runs.

    Args:
        group: the process group whose ranks make the call together.
        op: the call's name, for messages (e.g. "MoE").
        fields: name -> value, in a fixed order; names hold no "=" or newline. Or a function returning them,
            called after ``validate`` has passed (for fields that only checked arguments can give).
        validate: raises ``ValueError`` / ``TypeError`` / ``RuntimeError`` for arguments this rank refuses.
    """
    own: Exception | None = None
    if validate is not None:
        try:
            validate()
        except (ValueError, TypeError, RuntimeError) as error:
            own = error
    if group is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        if own is not None:
            raise own
        return
    if callable(fields):
        fields = {} if own is not None else fields()
    text = "".join(f"{name}={value!r}".replace("\n", " ") + "\n" for name, value in fields.items())
    try:
        _C.check_agreement(group.group_name, _collective_device(group), op, text, _error_kind(own),
                           "" if own is None else str(own))
    except (ValueError, TypeError, RuntimeError):
        if own is not None:  # this rank's own exception, with its traceback
            raise own from None
        raise


def _error_kind(error: Exception | None) -> int:
    """The native check's code for an error: 0 none, 1 RuntimeError, 2 ValueError, 3 TypeError."""
    if error is None:
        return 0
    return 2 if isinstance(error, ValueError) else 3 if isinstance(error, TypeError) else 1
