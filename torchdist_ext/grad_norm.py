"""Gradient clipping by the norm of the whole model's gradient, over every mesh and every pipeline stage.

    total = clip_grad_norm_(model_parts, max_norm, pp_mesh=mesh["pp"])

``torch.nn.utils.clip_grad_norm_`` on a rank's parameters sees one shard of each sharded gradient (FSDP2's
``Shard(0)``, a tensor-parallel layer's rows or columns, an expert-parallel rank's experts) and only its own
pipeline stage's layers: its norm is smaller than the model's, so every rank clips by a different, too small,
norm and the update is larger than ``max_norm`` allows (and differs between replicas). This function computes
the norm one process training the whole model would, and clips every gradient by it.
"""

import itertools
import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _parameters(model_parts: nn.Module | Iterable[nn.Module | nn.Parameter]) -> list[nn.Parameter]:
    """The parameters of ``model_parts`` (a module, or modules and parameters), each once."""
    if isinstance(model_parts, (nn.Module, Tensor)):
        parts = [model_parts]
    elif isinstance(model_parts, Iterable) and not isinstance(model_parts, (str, bytes, Mapping)):
        parts = list(model_parts)
    else:
        raise TypeError(f"model_parts must be an nn.Module or an iterable of nn.Modules and parameters, got "
                        f"{type(model_parts).__name__}")
    params: dict[int, nn.Parameter] = {}
    for part in parts:
        if isinstance(part, nn.Module):
            params.update((id(p), p) for p in part.parameters())
        elif isinstance(part, Tensor):
            params[id(part)] = part
        else:
            raise TypeError(f"model_parts must hold nn.Modules or parameters, got a {type(part).__name__}")
    return list(params.values())


def _positive_float(name: str, value, *, infinite: bool) -> float:
    """``value`` as a float, refused unless a positive number (finite unless ``infinite``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not number > 0 or (not infinite and math.isinf(number)):
        raise ValueError(f"{name} must be a positive {'number (or math.inf)' if infinite else 'finite number'}, "
                         f"got {value!r}")
    return number


def _mesh_max(grads: list[Tensor]) -> Tensor:
    """The largest absolute element of DTensor gradients on one mesh: each rank's local shards (an empty one,
    a rank's share of a dimension smaller than the mesh, counts 0), then a MAX over every mesh dimension
    (harmless over replicas). torch's inf-norm of a DTensor raises on an empty shard, on that rank alone."""
    local = [g.to_local() for g in grads]
    device = local[0].device
    largest = torch.zeros((), device=device, dtype=torch.float32)
    for tensor in local:
        if tensor.numel():
            largest = torch.maximum(largest, tensor.detach().abs().max().to(torch.float32))
    mesh = grads[0].device_mesh
    for dim in range(mesh.ndim):
        largest = _all_reduce_max(largest, mesh.get_group(dim))
    return largest


def _all_reduce_max(value: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The MAX of the 0-d fp32 ``value`` over ``group``'s ranks, NaN where any rank's is NaN (torch's inf-norm
    in one process propagates a NaN gradient element). Collectives' MAX may drop a NaN (gloo's does), so a
    NaN travels as +inf (as ``fp8_step`` sends a NaN amax) beside a flag that restores it: one all-reduce."""
    nan = value.isnan()
    packed = torch.stack([torch.where(nan, math.inf, value), nan.to(value.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, math.nan, packed[0])


def total_grad_norm(grads: Iterable[Tensor], norm_type: float = 2.0, *, pp_mesh: DeviceMesh | None = None) -> Tensor:
    """The ``norm_type`` norm of all of ``grads`` as one vector, on every rank: the full tensor of each
    DTensor gradient (one reduction per mesh, the gradients of one mesh together), over the pipeline ranks of
    ``pp_mesh`` too (each holds other stages' gradients). A 0-d fp32 tensor, replicated."""
    norm_type = _positive_float("norm_type", norm_type, infinite=True)
    if pp_mesh is not None and (not isinstance(pp_mesh, DeviceMesh) or pp_mesh.ndim != 1):
        raise TypeError(f"pp_mesh must be a 1-D DeviceMesh of the pipeline ranks, got {pp_mesh!r}")
    by_mesh: dict[DeviceMesh | None, list[Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    device = next((g.device for g in itertools.chain.from_iterable(by_mesh.values())), None)
    if device is None:
        device = torch.device(pp_mesh.device_type) if pp_mesh is not None else torch.device("cpu")
    norms = []
    for mesh, group in by_mesh.items():
        if mesh is not None and math.isinf(norm_type):
            norms.append(_mesh_max(group).to(device))
            continue
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device, torch.float32))
    total = (torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms
             else torch.zeros((), device=device, dtype=torch.float32))
    if pp_mesh is not None and pp_mesh.size() > 1:
        if math.isinf(norm_type):
            total = _all_reduce_max(total, pp_mesh.get_group())
        else:
            powered = total.pow(norm_type)
            dist.all_reduce(powered, group=pp_mesh.get_group())
            total = powered.pow(1 / norm_type)
    return total


def clip_grad_norm_(model_parts: nn.Module | Iterable[nn.Module | nn.Parameter], max_norm: float, *,
                    norm_type: float = 2.0, pp_mesh: DeviceMesh | None = None,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Scales every gradient of ``model_parts`` (a module, or this rank's pipeline stages and parameters) in
    place so that the model's whole gradient has norm at most ``max_norm``, as one process training the whole
    model would (see the module docstring); returns the norm before clipping (0-d fp32, the same on every
    rank). ``pp_mesh``: the 1-D mesh of the pipeline ranks, each holding other stages (None: no pipeline).
    ``error_if_nonfinite``: raise when the norm is nan or inf (checked on every rank alike)."""
    max_norm = _positive_float("max_norm", max_norm, infinite=False)
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"error_if_nonfinite must be a bool, got {error_if_nonfinite!r}")
    params = [p for p in _parameters(model_parts) if p.grad is not None]
    total = total_grad_norm([p.grad for p in params], norm_type, pp_mesh=pp_mesh)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total {norm_type}-norm of the gradients is {total.item()}: clip_grad_norm_ was "
                           f"asked to refuse a non-finite norm (error_if_nonfinite=True)")
    _scale_(params, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


@torch.no_grad()
def _scale_(params: list[nn.Parameter], coefficient: Tensor) -> None:
    """Multiplies each gradient (a DTensor's local shard) by ``coefficient`` in place, one foreach per device."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for p in params:
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_device.setdefault(local.device, []).append(local)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coefficient.to(device))
