"""Which instruction set the CPU kernels run in.

Every CPU kernel of ``torchdist_ext`` is compiled three times, for ``"baseline"``
x86-64, ``"avx2"`` (AVX2 + FMA) and ``"avx512"`` (AVX-512 F/BW/DQ/VL + FMA); the
best one this CPU supports runs, unless the environment variable
``TDX_CPU_ISA`` names another (a name this CPU cannot run fails the import).
The clones round differently (FMA contraction, vector width); the test suite
runs every clone the machine supports against stated error bounds.

    CPU_ISAS                  ("baseline", "avx2", "avx512"), narrowest first
    supported_cpu_isas()      the ones this CPU runs
    active_cpu_isa()          the one in use
    set_cpu_isa(isa)          switch (this process); returns the previous one
    use_cpu_isa(isa)          the same as a context manager
"""

import contextlib
from collections.abc import Iterator

from torchdist_ext import _C

__all__ = ["CPU_ISAS", "active_cpu_isa", "set_cpu_isa", "supported_cpu_isas", "use_cpu_isa"]

CPU_ISAS: tuple[str, ...] = _C.cpu_isas()


def supported_cpu_isas() -> tuple[str, ...]:
    """The ISAs whose kernels this CPU (and OS) can run, narrowest first."""
    return _C.supported_cpu_isas()


def active_cpu_isa() -> str:
    """The ISA whose kernels the ops run now."""
    return _C.active_cpu_isa()


def set_cpu_isa(isa: str) -> str:
    """Makes ``isa`` the active ISA of this process; returns the previous one.

    Raises ``ValueError`` if ``isa`` is not one of ``CPU_ISAS`` or this CPU lacks it.
    """
    if not isinstance(isa, str):
        raise TypeError(f"isa must be a str, one of {CPU_ISAS}, got {type(isa).__name__}")
    return _C.set_cpu_isa(isa)


@contextlib.contextmanager
def use_cpu_isa(isa: str) -> Iterator[None]:
    """Runs the body with ``isa``'s kernels, then restores the previous ISA."""
    previous = set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(previous)
