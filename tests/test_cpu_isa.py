"""torchdist_ext.cpu_isa: which ISA clone of the CPU kernels runs, set from the environment or at run time."""

import os
import subprocess
import sys

import pytest

from torchdist_ext.cpu_isa import CPU_ISAS, active_cpu_isa, set_cpu_isa, supported_cpu_isas, use_cpu_isa


def import_with(isa: str) -> subprocess.CompletedProcess:
    code = "from torchdist_ext.cpu_isa import active_cpu_isa; print(active_cpu_isa())"
    env = {**os.environ, "TDX_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_best_supported_isa_is_active_by_default():
    assert CPU_ISAS == ("baseline", "avx2", "avx512")
    supported = supported_cpu_isas()
    assert supported == CPU_ISAS[: len(supported)] and "baseline" in supported
    if "TDX_CPU_ISA" not in os.environ:
        assert active_cpu_isa() == supported[-1]


def test_use_cpu_isa_switches_and_restores(cpu_isa):
    before = active_cpu_isa()
    with use_cpu_isa(cpu_isa):
        assert active_cpu_isa() == cpu_isa
    assert active_cpu_isa() == before


def test_the_environment_picks_the_isa_at_import():
    result = import_with("baseline")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "baseline"


@pytest.mark.parametrize("isa, message", [("sse9", "TDX_CPU_ISA='sse9' names no CPU kernel ISA"),
                                          ("avx512", "this CPU does not support avx512")])
def test_a_bad_environment_fails_the_import(isa, message):
    if isa in supported_cpu_isas():
        pytest.skip(f"this CPU supports {isa}")
    result = import_with(isa)
    assert result.returncode != 0 and "ValueError" in result.stderr and message in result.stderr


def test_bad_isas_are_refused():
    with pytest.raises(ValueError, match=r"isa='sse9' names no CPU kernel ISA"):
        set_cpu_isa("sse9")
    with pytest.raises(TypeError, match="isa must be a str"):
        set_cpu_isa(2)
    for isa in set(CPU_ISAS) - set(supported_cpu_isas()):
        with pytest.raises(ValueError, match=f"this CPU does not support the {isa} kernels"):
            set_cpu_isa(isa)
