// The two halves of a linear's backward, for zero-bubble pipeline schedules
// that run them at different times: the input gradient (B, on the critical
// path) and the weight gradient (W, accumulated later into the parameter's
// gradient buffer). GEMMs through ATen (cuBLAS / the CPU BLAS): no kernel table.

#include <ATen/ATen.h>

#include "ops/device.h"

namespace tdx::ops {
namespace {

constexpr const char* kDgrad = "linear_dgrad";
constexpr const char* kWgrad = "linear_wgrad_";

void check_floating(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), op, ": ", name, " must be a floating-point tensor, got ",
                   t.scalar_type());
}

void check_same_device(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                       const char* b_name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), op, ": ", a_name, " and ", b_name, " must be on the same device, got ",
                    a.device(), " and ", b.device());
}

// grad_out [..., out] @ weight [out, in] -> [..., in]
at::Tensor linear_dgrad(const at::Tensor& grad_out, const at::Tensor& weight) {
  check_floating(kDgrad, grad_out, "grad_out");
  check_floating(kDgrad, weight, "weight");
  TORCH_CHECK_VALUE(weight.dim() == 2, kDgrad, ": weight must be 2-D [out, in], got shape ", weight.sizes());
  TORCH_CHECK_VALUE(grad_out.dim() >= 1 && grad_out.size(-1) == weight.size(0), kDgrad,
                    ": grad_out.size(-1) must equal weight.size(0)=", weight.size(0), ", got shape ", grad_out.sizes());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == weight.scalar_type(), kDgrad,
                   ": grad_out and weight must have the same dtype, got ", grad_out.scalar_type(), " and ",
                   weight.scalar_type());
  check_same_device(kDgrad, grad_out, "grad_out", weight, "weight");
  auto sizes = grad_out.sizes().vec();
  sizes.back() = weight.size(1);
  return at::mm(grad_out.reshape({-1, weight.size(0)}), weight).view(sizes);
}

// main_grad [out, in] += grad_out.flatten(0, -2).T @ input.flatten(0, -2), in main_grad's dtype (an fp32
// main gradient of 16-bit activations gets their product in fp32: the operands are upcast first).
void linear_wgrad_(const at::Tensor& main_grad, const at::Tensor& grad_out, const at::Tensor& input) {
  check_floating(kWgrad, main_grad, "main_grad");
  check_floating(kWgrad, grad_out, "grad_out");
  check_floating(kWgrad, input, "input");
  TORCH_CHECK_VALUE(main_grad.dim() == 2, kWgrad, ": main_grad must be 2-D [out, in], got shape ",
                    main_grad.sizes());
  TORCH_CHECK_VALUE(grad_out.dim() >= 1 && grad_out.size(-1) == main_grad.size(0), kWgrad,
                    ": grad_out.size(-1) must equal main_grad.size(0)=", main_grad.size(0), ", got shape ",
                    grad_out.sizes());
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(-1) == main_grad.size(1), kWgrad,
                    ": input.size(-1) must equal main_grad.size(1)=", main_grad.size(1), ", got shape ",
                    input.sizes());
  TORCH_CHECK_VALUE(grad_out.numel() / main_grad.size(0) == input.numel() / main_grad.size(1), kWgrad,
                    ": grad_out and input must hold the same number of rows, got shapes ", grad_out.sizes(), " and ",
                    input.sizes());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == input.scalar_type(), kWgrad,
                   ": grad_out and input must have the same dtype, got ", grad_out.scalar_type(), " and ",
                   input.scalar_type());
  check_same_device(kWgrad, main_grad, "main_grad", grad_out, "grad_out");
  check_same_device(kWgrad, main_grad, "main_grad", input, "input");
  const auto dtype = main_grad.scalar_type();
  const auto rows_out = grad_out.reshape({-1, main_grad.size(0)}).to(dtype);
  const auto rows_in = input.reshape({-1, main_grad.size(1)}).to(dtype);
  main_grad.addmm_(rows_out.t(), rows_in);
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_linear_grad) {
  m.impl("linear_dgrad", &linear_dgrad);
  m.impl("linear_wgrad_", &linear_wgrad_);
}

}  // namespace tdx::ops
