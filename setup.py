"""Build of torchdist_ext: the `torchdist_ext._C` library holding every `tdx` op.

CPU sources are always built. CUDA sources are added when torch is a CUDA build
and a CUDA toolkit is found (`CUDA_HOME`); `TDX_CUDA=0|1` overrides. A GPU is
never needed to build: the decision does not ask `torch.cuda.is_available()`.

Sources are picked by folder:
  csrc/*.cpp, csrc/comm/*.cpp, csrc/ops/*.cpp, csrc/kernels/cpu/*.cpp   always
  csrc/ops/*_cuda.cpp, csrc/kernels/cuda/*.cu                           with CUDA
"""

import os
from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent
CUDA_HOST_SUFFIX = "_cuda.cpp"
# Ampere, Hopper, Blackwell; set TORCH_CUDA_ARCH_LIST to build for others.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0"


def build_with_cuda() -> bool:
    override = os.environ.get("TDX_CUDA")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"TDX_CUDA must be '0' or '1', got {override!r}")
        return override == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def files(folder: str, pattern: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern))


def extension():
    host = files("csrc", "*.cpp") + files("csrc/comm", "*.cpp") + files("csrc/ops", "*.cpp")
    cpu_host = [f for f in host if not f.endswith(CUDA_HOST_SUFFIX)]
    cuda_host = [f for f in host if f.endswith(CUDA_HOST_SUFFIX)]
    cpu_kernels = files("csrc/kernels/cpu", "*.cpp")
    cxx_flags = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
    common = dict(
        name="torchdist_ext._C",
        include_dirs=[str(ROOT / "csrc")],
        extra_link_args=["-Wl,--no-as-needed"],
    )
    if not build_with_cuda():
        return CppExtension(
            sources=cpu_host + cpu_kernels,
            extra_compile_args={"cxx": cxx_flags},
            **common,
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    return CUDAExtension(
        sources=cpu_host + cpu_kernels + cuda_host + files("csrc/kernels/cuda", "*.cu"),
        extra_compile_args={
            "cxx": cxx_flags + ["-DTDX_WITH_CUDA"],
            "nvcc": ["-O3", "-DTDX_WITH_CUDA", "--expt-relaxed-constexpr"],
        },
        **common,
    )


setup(
    name="torchdist_ext",
    version="0.1.0",
    description="Drop-in parallel layers and native ops for distributed LLM training, tested on CPU with gloo",
    packages=find_packages(include=["torchdist_ext", "torchdist_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11,<2.15", "numpy"],
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
