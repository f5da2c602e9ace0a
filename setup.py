"""Build of torchdist_ext: the `torchdist_ext._C` library holding every `tdx` op.

CPU sources are always built. CUDA sources are added when torch is a CUDA build
and a CUDA toolkit is found (`CUDA_HOME`); `TDX_CUDA=0|1` overrides. A GPU is
never needed to build: the decision does not ask `torch.cuda.is_available()`.
`TDX_SANITIZE=address` builds the host code with AddressSanitizer (`make asan`).

Sources are picked by folder:
  csrc/*.cpp, csrc/comm/*.cpp, csrc/ops/*.cpp, csrc/kernels/cpu/*.cpp   always
  csrc/kernels/cuda/*.cu                                                with CUDA (-DTDX_WITH_CUDA)
  csrc/planner/*.cpp                                                    torchdist_ext._planner (torch-free)
"""

import os
import shutil
from pathlib import Path

import torch
from setuptools import find_packages, setup


def locate_cuda_toolkit() -> None:
    """Points CUDA_HOME at a toolkit with headers when torch's guess has none.

    torch guesses CUDA_HOME from the `nvcc` on PATH; a wrapper script such as
    /usr/local/bin/nvcc makes that guess /usr/local, which has no CUDA headers.
    """
    if "CUDA_HOME" in os.environ or "CUDA_PATH" in os.environ:
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    guess = Path(nvcc).resolve().parent.parent
    if not (guess / "include" / "cuda_runtime_api.h").exists():
        for candidate in (Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)):
            if (candidate / "include" / "cuda_runtime_api.h").exists():
                os.environ["CUDA_HOME"] = str(candidate)
                return


locate_cuda_toolkit()
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = Path(__file__).resolve().parent  # absolute: torch < 2.14 runs ninja outside the source tree
# Ampere, Hopper, Blackwell; set TORCH_CUDA_ARCH_LIST to build for others.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0"


def build_with_cuda() -> bool:
    override = os.environ.get("TDX_CUDA")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"TDX_CUDA must be '0' or '1', got {override!r}")
        return override == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def sanitizer_flags() -> list[str]:
    """Compile and link flags of `TDX_SANITIZE` (unset: none; `address`: AddressSanitizer, -O1 with frames)."""
    sanitizer = os.environ.get("TDX_SANITIZE")
    if sanitizer is None:
        return []
    if sanitizer != "address":
        raise ValueError(f"TDX_SANITIZE must be 'address', got {sanitizer!r}")
    return ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]


def files(folder: str, pattern: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern))


def extension():
    host = files("csrc", "*.cpp") + files("csrc/comm", "*.cpp") + files("csrc/ops", "*.cpp")
    cpu_kernels = files("csrc/kernels/cpu", "*.cpp")
    # -fno-trapping-math lets the CPU kernels' selects become vector blends (we never trap on FP exceptions).
    sanitize = sanitizer_flags()  # its -O1 comes after -O3, so it wins
    cxx_flags = ["-O3", "-fno-trapping-math", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", *sanitize]
    common = dict(
        name="torchdist_ext._C",
        include_dirs=[str(ROOT / "csrc")],
        extra_link_args=["-Wl,--no-as-needed", *sanitize],
    )
    if not build_with_cuda():
        return CppExtension(
            sources=host + cpu_kernels,
            extra_compile_args={"cxx": cxx_flags},
            **common,
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    return CUDAExtension(
        sources=host + cpu_kernels + files("csrc/kernels/cuda", "*.cu"),
        extra_compile_args={
            "cxx": cxx_flags + ["-DTDX_WITH_CUDA"],
            "nvcc": ["-O3", "-DTDX_WITH_CUDA", "--expt-relaxed-constexpr"],
        },
        **common,
    )


def planner_extension():
    """torchdist_ext._planner: the torch-free cost model (csrc/planner), bound with pybind11; no libtorch."""
    import pybind11
    from setuptools import Extension

    return Extension(
        "torchdist_ext._planner",
        sources=files("csrc/planner", "*.cpp") + ["csrc/ops/sequence_plan.cpp"],  # (torch-free, shared)
        include_dirs=[str(ROOT / "csrc"), pybind11.get_include()],
        extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden", "-Wall"],
        language="c++",
    )


setup(
    name="torchdist_ext",
    version="0.1.0",
    description="Drop-in parallel layers and native ops for distributed LLM training, tested on CPU with gloo",
    packages=find_packages(include=["torchdist_ext", "torchdist_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13,<2.15", "numpy"],
    ext_modules=[extension(), planner_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
