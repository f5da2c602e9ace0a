"""torchdist_ext: drop-in parallel layers and native ops for distributed LLM training.

Importing the package loads the native library ``torchdist_ext._C`` (every
``torch.ops.tdx`` op) and registers the ops' fake implementations and
autograd. A missing or broken build fails here, loudly.

Public API:
    torchdist_ext.parallel   tensor-parallel layers (see its docstring)
    torchdist_ext.ops        typed Python wrappers of the ``tdx`` ops
    torchdist_ext.testing    persistent CPU worlds for multi-rank tests
"""

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from torchdist_ext import _C  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "torchdist_ext: the native library torchdist_ext._C failed to load. Build it with "
        "`pip install --no-build-isolation -e .` against the installed torch "
        f"({torch.__version__}). Original error: {error}"
    ) from error

from torchdist_ext import ops  # noqa: E402,F401  (registers fake impls and autograd)

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
