"""CPU tensor memory, counted as CUDA's caching allocator counts GPU memory.

    track()                     put a counting allocator in front of c10's CPU allocator (once per process)
    tracking() -> bool          whether it is in place
    memory_allocated() -> int   bytes of live CPU storages allocated since track()
    max_memory_allocated() -> int   their peak since the last reset_peak_memory_stats()
    reset_peak_memory_stats()

The counting allocator forwards every allocation to c10's (``csrc/cpu_memory.cpp``); storages allocated before
``track()`` are not counted, so call it before building the model. It stays installed for the process's life.
"""

from torchdist_ext import _C

__all__ = ["max_memory_allocated", "memory_allocated", "reset_peak_memory_stats", "track", "tracking"]


def track() -> None:
    """Counts the CPU storages allocated from now on (a no-op when already counting)."""
    _C.track_cpu_memory()


def tracking() -> bool:
    """Whether ``track()`` has run in this process."""
    return _C.tracking_cpu_memory()


def memory_allocated() -> int:
    """Bytes of live CPU storages allocated since ``track()``; RuntimeError before it."""
    return _C.cpu_memory_stats()[0]


def max_memory_allocated() -> int:
    """The largest ``memory_allocated()`` since the last ``reset_peak_memory_stats()`` (or ``track()``)."""
    return _C.cpu_memory_stats()[1]


def reset_peak_memory_stats() -> None:
    """Sets the peak to the bytes allocated now."""
    _C.reset_cpu_peak_memory()
