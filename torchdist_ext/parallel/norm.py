"""RMSNorm inside a tensor-parallel model, with or without sequence parallelism."""

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from torchdist_ext.parallel.input_checks import check_features, check_floating_dtype, check_floating_input
from torchdist_ext.parallel.mesh_group import MeshGroup
from torchdist_ext.parallel.parameters import distribute_parameter
from torchdist_ext.parallel.regions import copy_to_region
from torchdist_ext._weight_grad import SplitsWeightGrad, split_scale

__all__ = ["RMSNorm"]


def _check_computes_rms_norm(norm: nn.Module, eps: float) -> None:
    """Runs a CPU copy of an RMSNorm-like module (random weight in [0.5, 1.5]) once on random rows: it must
    compute weight * x / sqrt(mean(x^2) + eps) (a Gemma-style norm scales by 1 + weight and is refused)."""
    if not norm.weight.is_floating_point():
        raise TypeError(f"norm.weight must be a floating-point tensor, got {norm.weight.dtype}")
    probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(0)
    dim = probe.weight.shape[0]
    x = torch.randn(4, dim, generator=gen)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
        got, want = probe(x), F.rms_norm(x, (dim,), probe.weight, eps)
    if not isinstance(got, Tensor) or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise TypeError(f"norm ({type(norm).__name__}) does not compute weight * x / sqrt(mean(x^2) + eps); "
                        "from_rms_norm takes RMSNorms only")


class RMSNorm(SplitsWeightGrad, nn.Module):
    """``F.rms_norm`` with its weight replicated over ``tp_mesh``.

    Without sequence parallelism every rank normalises the same activations
    and computes the same weight gradient. With ``sequence_parallel=True`` each
    rank normalises its sequence block, so the weight gradient is all-reduced
    over the group (Megatron's rule for sequence-parallel parameters).

    Shapes: input ``[..., dim]`` (any sharding along other dims) -> output of the same shape.
    Parameters: ``weight`` DTensor ``[dim]`` ``Replicate()``, initialised to ones.
    ``split_weight_grad = True`` (a zero-bubble pipeline sets it) splits the weight gradient off the backward.

    Args:
        dim: the normalised (last) dimension, a positive int.
        tp_mesh: the 1-D tensor-parallel mesh the weight is replicated over.
        sequence_parallel: each rank holds a sequence block; the weight gradient is all-reduced over tp.
        eps: added to the mean square; None uses ``torch.finfo(x.dtype).eps``, as ``nn.RMSNorm`` does.
        device, dtype: of the weight.
    """

    def __init__(self, dim: int, *, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                 eps: float | None = 1e-6, device=None, dtype=None):
        super().__init__()
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        check_floating_dtype(dtype)
        self.tp = MeshGroup.of(tp_mesh)
        self.dim = dim
        self.eps = eps
        self.sequence_parallel = bool(sequence_parallel)
        ones = torch.ones(dim, device=device, dtype=dtype)
        self.weight = distribute_parameter(ones, self.tp, Replicate(), src_data_rank=None)

    @classmethod
    def from_rms_norm(cls, norm: nn.Module, *, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> "RMSNorm":
        """The parallel norm with ``norm``'s weight and eps.

        ``norm`` is an ``nn.RMSNorm`` over one dim with a weight, or any RMSNorm-like module with a 1-D
        ``weight`` and an ``eps`` or ``variance_epsilon`` attribute (Hugging Face's ``LlamaRMSNorm``,
        ``Qwen2RMSNorm``, ...) that computes ``weight * x / sqrt(mean(x^2) + eps)``.
        """
        if isinstance(norm, nn.RMSNorm):
            if len(norm.normalized_shape) != 1 or norm.weight is None:
                raise TypeError(f"norm must be an nn.RMSNorm over one dim with a weight, got {norm!r}")
            eps = norm.eps
        elif isinstance(norm, (nn.LayerNorm, nn.GroupNorm)) or getattr(norm, "bias", None) is not None:
            raise TypeError(f"norm must be an RMSNorm (no mean subtraction, no bias), got {type(norm).__name__}")
        else:
            weight = getattr(norm, "weight", None)
            eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
            if not isinstance(weight, Tensor) or weight.dim() != 1 or not isinstance(eps, (int, float)):
                raise TypeError(
                    f"norm must be an nn.RMSNorm or an RMSNorm-like module with a 1-D weight and a float eps or "
                    f"variance_epsilon, got {type(norm).__name__}"
                )
            _check_computes_rms_norm(norm, float(eps))
        layer = cls(norm.weight.shape[0], tp_mesh=tp_mesh, sequence_parallel=sequence_parallel, eps=eps,
                    device="meta", dtype=norm.weight.dtype)
        layer.weight = distribute_parameter(norm.weight.detach(), layer.tp, Replicate(), src_data_rank=None)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to_local()
        check_floating_input(x, "input", weight.dtype)
        check_features(x, "input", self.dim, "dim")
        if self.split_weight_grad:  # the normalisation in B, the weight's scaling split (its gradient in W)
            group = self.tp.name if self.sequence_parallel else ""
            return split_scale(F.rms_norm(x, (self.dim,), None, self.eps), weight, self, group)
        if self.sequence_parallel:
            weight = copy_to_region(weight, self.tp)
        return F.rms_norm(x, (self.dim,), weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, tp={self.tp.size}, sequence_parallel={self.sequence_parallel}"
