"""A linear's backward in two halves (``tdx::linear_dgrad``, ``tdx::linear_wgrad_``), so that a zero-bubble
pipeline schedule can run the input gradient (B) now and the weight gradient (W) later.

    linear_dgrad    grad_out [..., out], weight [out, in] -> grad_input [..., in]
    linear_wgrad_   main_grad [out, in] += grad_out.flatten(0, -2).T @ input.flatten(0, -2)   (in place)

``linear_wgrad_`` computes in ``main_grad``'s dtype: an fp32 main gradient of bf16 activations (Megatron's
``main_grad``) gets the product of the upcast operands. Neither op is differentiable (they are backward
halves; the layers' autograd functions call them).
"""

import torch
from torch import Tensor

__all__ = ["linear_dgrad", "linear_wgrad_"]


def linear_dgrad(grad_out: Tensor, weight: Tensor) -> Tensor:
    """``grad_out @ weight``: the input gradient of ``F.linear(input, weight)``; ``[..., out] -> [..., in]``."""
    return torch.ops.tdx.linear_dgrad(grad_out, weight)


def linear_wgrad_(main_grad: Tensor, grad_out: Tensor, input: Tensor) -> None:
    """Adds the weight gradient of ``F.linear(input, weight)`` to ``main_grad [out, in]`` in place;
    ``grad_out [..., out]`` and ``input [..., in]`` hold the same rows."""
    torch.ops.tdx.linear_wgrad_(main_grad, grad_out, input)


def _check_floating(op: str, t: Tensor, name: str) -> None:
    torch._check_type(t.dtype.is_floating_point, lambda: f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def _check_same_device(op: str, a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    torch._check_value(a.device == b.device,
                       lambda: f"{op}: {a_name} and {b_name} must be on the same device, got {a.device} and {b.device}")


@torch.library.register_fake("tdx::linear_dgrad")
def _(grad_out, weight):
    op = "linear_dgrad"
    _check_floating(op, grad_out, "grad_out")
    _check_floating(op, weight, "weight")
    torch._check_value(weight.dim() == 2, lambda: f"{op}: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    torch._check_value(grad_out.dim() >= 1 and grad_out.shape[-1] == weight.shape[0],
                       lambda: f"{op}: grad_out.size(-1) must equal weight.size(0)={weight.shape[0]}, got shape "
                               f"{tuple(grad_out.shape)}")
    torch._check_type(grad_out.dtype == weight.dtype,
                      lambda: f"{op}: grad_out and weight must have the same dtype, got {grad_out.dtype} and "
                              f"{weight.dtype}")
    _check_same_device(op, grad_out, "grad_out", weight, "weight")
    return grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]))


@torch.library.register_fake("tdx::linear_wgrad_")
def _(main_grad, grad_out, input):
    op = "linear_wgrad_"
    for t, name in ((main_grad, "main_grad"), (grad_out, "grad_out"), (input, "input")):
        _check_floating(op, t, name)
    torch._check_value(main_grad.dim() == 2,
                       lambda: f"{op}: main_grad must be 2-D [out, in], got shape {tuple(main_grad.shape)}")
    torch._check_value(grad_out.dim() >= 1 and grad_out.shape[-1] == main_grad.shape[0],
                       lambda: f"{op}: grad_out.size(-1) must equal main_grad.size(0)={main_grad.shape[0]}, got shape "
                               f"{tuple(grad_out.shape)}")
    torch._check_value(input.dim() >= 1 and input.shape[-1] == main_grad.shape[1],
                       lambda: f"{op}: input.size(-1) must equal main_grad.size(1)={main_grad.shape[1]}, got shape "
                               f"{tuple(input.shape)}")
    torch._check_value(grad_out.numel() // main_grad.shape[0] == input.numel() // main_grad.shape[1],
                       lambda: f"{op}: grad_out and input must hold the same number of rows, got shapes "
                               f"{tuple(grad_out.shape)} and {tuple(input.shape)}")
    torch._check_type(grad_out.dtype == input.dtype,
                      lambda: f"{op}: grad_out and input must have the same dtype, got {grad_out.dtype} and "
                              f"{input.dtype}")
    _check_same_device(op, main_grad, "main_grad", grad_out, "grad_out")
    _check_same_device(op, main_grad, "main_grad", input, "input")
