"""pin_inductor_cpu_isa: processes of a machine that choose different inductor vector ISAs never share a
compiled kernel (inductor's FX graph cache is not keyed by the ISA; torchdist_ext/testing/inductor_isa.py)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

COMPILE_SIN = textwrap.dedent("""
    import os, torch
    from torchdist_ext.testing import pin_inductor_cpu_isa
    pin_inductor_cpu_isa()
    from torch._inductor import config
    x = torch.randn(2, 4, 5, 4)
    y = torch.compile(lambda t: t.sin(), fullgraph=True)(x)
    close = torch.allclose(y, x.sin(), rtol=1e-5, atol=1e-6)
    print(config.cpp.vec_isa_ok, os.environ["TORCHINDUCTOR_CACHE_DIR"], close)
""")


def compile_sin(tmp: str, capability: str | None) -> list[str]:
    """Compiles ``sin`` in a fresh process whose inductor cache is its default, under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "ATEN_CPU_CAPABILITY"))}
    env["TMPDIR"] = tmp  # inductor's default cache folder: $TMPDIR/torchinductor_$USER
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", COMPILE_SIN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_an_avx2_process_and_an_avx512_one_keep_their_kernels_apart(tmp_path):
    """The same graph compiled first by a process on AVX2 (8 floats per step), then by one on AVX-512. In
    one cache, the second reads the first's kernel and stores 16 floats per step (past the end of its
    output: a heap corruption, or a wrong result); pinned, each reads its own ISA's."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("needs a CPU with AVX-512 (to run an AVX2 and an AVX-512 process)")
    avx2 = compile_sin(str(tmp_path), "avx2")
    avx512 = compile_sin(str(tmp_path), None)
    assert avx2[0] == avx512[0] == "True"  # the ISA from CPUID, no probe build
    assert avx2[1].endswith("isa-avx2") and avx512[1].endswith("isa-avx512")
    assert avx2[2] == avx512[2] == "True", (avx2, avx512)
