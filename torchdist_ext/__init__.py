"""torchdist_ext: drop-in parallel layers and native ops for distributed LLM training.

Importing the package loads the native library ``torchdist_ext._C`` (every
``torch.ops.tdx`` op) and registers the ops' fake implementations and
autograd. A missing or broken build fails here, loudly.

Public API:
    torchdist_ext.parallel      parallel layers and functions (see its docstring)
    torchdist_ext.ops           typed Python wrappers of the ``tdx`` ops
    torchdist_ext.testing       persistent CPU worlds for multi-rank tests
    torchdist_ext.planner       the memory / bubble / communication cost model
    torchdist_ext.cpu_isa       which instruction set the CPU kernels run in
    torchdist_ext.pipeline      pipeline schedules (zero-bubble W/B split) and their runtime
    torchdist_ext.fp8           fp8 recipes, Fp8Linear, convert_to_fp8
    clip_grad_norm_             clips by the whole model's gradient norm
    set_index_checks, index_checks_enabled
                                whether ops raise on out-of-range indices
    set_agreement_checks, agreement_checks
                                which calls the rank-agreement check covers

Signatures and details: docs/api.md.
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
from torchdist_ext.grad_norm import clip_grad_norm_  # noqa: E402
from torchdist_ext._index_checks import index_checks_enabled, set_index_checks  # noqa: E402
from torchdist_ext.agreement import agreement_checks, set_agreement_checks  # noqa: E402

__version__ = "0.1.0"
__all__ = ["agreement_checks", "clip_grad_norm_", "index_checks_enabled", "ops", "set_agreement_checks",
           "set_index_checks", "__version__"]
