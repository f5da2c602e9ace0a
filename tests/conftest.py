import pytest

from torchdist_ext.cpu_isa import CPU_ISAS, supported_cpu_isas
from torchdist_ext.testing import pin_inductor_cpu_isa

pytest_plugins = ["torchdist_ext.testing.pytest_fixtures"]

# Before anything compiles, here and in every process a test starts: see torchdist_ext/testing/inductor_isa.py.
pin_inductor_cpu_isa()


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request) -> str:
    """Every ISA clone of the CPU kernels (torchdist_ext.cpu_isa), whatever this machine's best:
    tests that take it run once per clone; those this CPU lacks are skipped, with the reason."""
    if request.param not in supported_cpu_isas():
        pytest.skip(f"this CPU lacks {request.param} (it runs {', '.join(supported_cpu_isas())})")
    return request.param
