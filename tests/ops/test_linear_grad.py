"""tdx::linear_dgrad and tdx::linear_wgrad_: the two halves of torch's own linear backward (bit for bit in the
parameters' dtype; in fp32 for an fp32 main gradient of bf16 activations), opcheck, compile, bad input."""

import pytest
import torch
import torch.nn.functional as F

import torchdist_ext  # noqa: F401
from torchdist_ext.ops import linear_dgrad, linear_wgrad_


def torch_linear_grads(x, weight, grad_out):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    F.linear(x, weight).backward(grad_out)
    return x.grad, weight.grad


@pytest.mark.parametrize("shape", [(6, 32), (2, 5, 32), (0, 32)], ids=["2d", "3d", "empty"])
def test_the_halves_equal_torchs_linear_backward(shape):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(16, 32)
    grad_out = torch.randn(*shape[:-1], 16)
    grad_x, grad_w = torch_linear_grads(x, weight, grad_out)
    assert torch.equal(linear_dgrad(grad_out, weight), grad_x)
    main_grad = torch.zeros(16, 32)
    linear_wgrad_(main_grad, grad_out, x)
    assert torch.equal(main_grad, grad_w)
    linear_wgrad_(main_grad, grad_out, x)  # accumulates
    assert torch.allclose(main_grad, 2 * grad_w, rtol=1e-6, atol=1e-6)


def test_fp32_main_grad_of_bf16_activations_is_the_fp32_product():
    torch.manual_seed(0)
    x, grad_out = torch.randn(8, 32).bfloat16(), torch.randn(8, 16).bfloat16()
    main_grad = torch.ones(16, 32)
    linear_wgrad_(main_grad, grad_out, x)
    expected = torch.ones(16, 32).addmm_(grad_out.float().t(), x.float())
    assert main_grad.dtype == torch.float32 and torch.equal(main_grad, expected)


def test_opcheck_and_compile():
    x, weight, grad_out = torch.randn(2, 3, 32), torch.randn(16, 32), torch.randn(2, 3, 16)
    torch.library.opcheck(torch.ops.tdx.linear_dgrad, (grad_out, weight))
    torch.library.opcheck(torch.ops.tdx.linear_wgrad_, (torch.zeros(16, 32), grad_out, x))

    def both(g, w, a, main):
        linear_wgrad_(main, g, a)
        return linear_dgrad(g, w)

    main, compiled_main = torch.zeros(16, 32), torch.zeros(16, 32)
    expected = both(grad_out, weight, x, main)
    assert torch.equal(torch.compile(both, fullgraph=True)(grad_out, weight, x, compiled_main), expected)
    assert torch.allclose(compiled_main, main, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call, error, message", [
    (lambda: linear_dgrad(torch.randn(4, 16), torch.randn(16)), ValueError, "weight must be 2-D"),
    (lambda: linear_dgrad(torch.randn(4, 8), torch.randn(16, 32)), ValueError, r"grad_out.size\(-1\) must equal"),
    (lambda: linear_dgrad(torch.randn(4, 16).double(), torch.randn(16, 32)), TypeError, "same dtype"),
    (lambda: linear_dgrad(torch.ones(4, 16, dtype=torch.int64), torch.randn(16, 32)), TypeError, "floating-point"),
    (lambda: linear_wgrad_(torch.zeros(16), torch.randn(4, 16), torch.randn(4, 32)), ValueError, "main_grad must be 2-D"),
    (lambda: linear_wgrad_(torch.zeros(16, 32), torch.randn(4, 16), torch.randn(4, 8)), ValueError,
     r"input.size\(-1\) must equal"),
    (lambda: linear_wgrad_(torch.zeros(16, 32), torch.randn(4, 16), torch.randn(5, 32)), ValueError,
     "same number of rows"),
    (lambda: linear_wgrad_(torch.zeros(16, 32), torch.randn(4, 16), torch.randn(4, 32).double()), TypeError,
     "same dtype"),
], ids=["weight_dim", "dgrad_features", "dgrad_dtype", "integer", "main_grad_dim", "wgrad_features", "rows",
        "wgrad_dtype"])
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()
