"""One vector ISA for every process that compiles CPU kernels with torch.compile on this machine.

Inductor picks the vector ISA of its C++ kernels once per process, and counts an ISA only if a probe
library built for it compiles and loads (``torch._inductor.cpu_vec_isa.VecISA.check_build``): a probe
that fails, or times out, on a loaded machine leaves that process one ISA lower (AVX2 on an AVX-512
machine). Its FX graph cache, which the processes of a machine share, is not keyed by that choice. A
kernel generated for AVX2 (8 floats per step) and compiled by another process for AVX-512 stores 16
floats per step, 32 bytes past the end of a small output: glibc later aborts the rank ("malloc():
unaligned tcache chunk detected"). The reverse leaves half of each output unwritten.

``pin_inductor_cpu_isa()`` makes the choice the CPU's alone (``TORCHINDUCTOR_VEC_ISA_OK=1``: CPUID, no
probe), the same in every process, and keeps the cache of each ISA in a folder of its own, so that a
cache left by a machine of another ISA is never read. It sets the environment, which the processes a
test starts inherit (worlds' ranks, ``torchrun``), and this process's inductor config.
"""

import os

import torch

__all__ = ["pin_inductor_cpu_isa"]


def pin_inductor_cpu_isa() -> None:
    """Pins inductor's CPU vector ISA to what CPUID reports, and its cache folder to one per ISA (unless
    ``TORCHINDUCTOR_VEC_ISA_OK``, or ``TORCHINDUCTOR_CACHE_DIR`` other than inductor's default, is set)."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
    isa = torch.backends.cpu.get_cpu_capability().lower()  # what ATen runs: "avx512", "avx2", "default", ...
    default = os.path.abspath(default_cache_dir())
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:  # inductor writes its default there
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default, f"isa-{isa}")
