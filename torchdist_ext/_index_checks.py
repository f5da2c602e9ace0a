"""Whether ops check the values of index tensors (cross-entropy targets, embedding ids).

One rule on every device. With checks on (the default), an index out of range
raises a ``ValueError`` naming its position and value; on a GPU that costs one
device-to-host sync per call. With checks off, whatever the index touches
comes out NaN (the row's loss and gradient, the embedding row), never a
plausible wrong value, and nothing syncs. ``TDX_INDEX_CHECKS=0`` in the
environment starts with them off. Under ``torch.compile`` the embedding's
check is skipped (a data-dependent raise would break the graph) and only the
NaN rule holds; the cross-entropy checks inside its op either way.

    index_checks_enabled() -> bool
    set_index_checks(enabled) -> the previous setting
"""

from torchdist_ext import _C

__all__ = ["index_checks_enabled", "set_index_checks"]


def index_checks_enabled() -> bool:
    """True while ops raise on out-of-range indices."""
    return _C.index_checks()


def set_index_checks(enabled: bool) -> bool:
    """Switches index checks for this process; returns the previous setting."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    return _C.set_index_checks(enabled)
