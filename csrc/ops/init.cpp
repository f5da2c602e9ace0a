// Counter-based initialisation, host side for every device: argument checks, the block's place in the
// whole tensor, and the kernel of kernels/init.h.

#include <ATen/ATen.h>

#include <cmath>

#include "kernels/init.h"
#include "ops/device.h"

namespace tdx::ops {
namespace {

constexpr const char* kTruncNormal = "counter_trunc_normal_";

double normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

// self: a contiguous block of a tensor of shape `whole_shape`, starting at `offsets`.
void counter_trunc_normal_(const at::Tensor& self, c10::IntArrayRef whole_shape, c10::IntArrayRef offsets,
                           int64_t seed, int64_t key, double mean, double std, double a, double b) {
  const auto type = element_type(kTruncNormal, self.scalar_type());
  TORCH_CHECK_VALUE(self.is_contiguous(), kTruncNormal, ": self must be contiguous");
  const int64_t ndim = std::max<int64_t>(1, self.dim());
  TORCH_CHECK_VALUE(ndim <= kernels::kMaxInitDims, kTruncNormal, ": self may have at most ",
                    kernels::kMaxInitDims, " dimensions, got ", self.dim());
  TORCH_CHECK_VALUE(static_cast<int64_t>(whole_shape.size()) == self.dim() &&
                        static_cast<int64_t>(offsets.size()) == self.dim(),
                    kTruncNormal, ": whole_shape and offsets must have self's ", self.dim(), " dimensions, got ",
                    whole_shape, " and ", offsets);
  for (int64_t d = 0; d < self.dim(); ++d) {
    TORCH_CHECK_VALUE(offsets[d] >= 0 && offsets[d] + self.size(d) <= whole_shape[d], kTruncNormal,
                      ": the block of shape ", self.sizes(), " at offsets ", offsets,
                      " must lie inside whole_shape ", whole_shape, " (dimension ", d, ")");
  }
  TORCH_CHECK_VALUE(std::isfinite(mean) && std::isfinite(std) && std > 0, kTruncNormal,
                    ": mean must be finite and std positive, got mean=", mean, ", std=", std);
  TORCH_CHECK_VALUE(a < b, kTruncNormal, ": the truncation [a, b] must have a < b, got a=", a, ", b=", b);
  const double low = normal_cdf((a - mean) / std), high = normal_cdf((b - mean) / std);
  TORCH_CHECK_VALUE(high > low, kTruncNormal, ": [a, b] = [", a, ", ", b, "] holds no mass of N(", mean, ", ",
                    std, "^2) in double precision");
  if (self.numel() == 0) return;
  kernels::TruncNormalArgs args{};
  args.type = type;
  args.ndim = static_cast<int>(ndim);
  int64_t stride = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    const bool scalar = self.dim() == 0;
    args.sizes[d] = scalar ? 1 : self.size(d);
    args.offsets[d] = scalar ? 0 : offsets[d];
    args.strides[d] = stride;
    stride *= scalar ? 1 : whole_shape[d];
  }
  args.cols = args.sizes[ndim - 1];
  args.rows = self.numel() / args.cols;
  args.stream = kernels::counter_stream(static_cast<uint64_t>(seed), static_cast<uint64_t>(key));
  args.mean = static_cast<float>(mean);
  args.std = static_cast<float>(std);
  args.a = static_cast<float>(a);
  args.b = static_cast<float>(b);
  args.low = static_cast<float>(low);
  args.high = static_cast<float>(high);
  args.out = self.data_ptr();
  const int64_t grain = std::max<int64_t>(1, 16384 / args.cols);  // rows per CPU task: ~16k elements
  launch(kernels_for<kernels::InitKernels>(kTruncNormal, self.device()).trunc_normal, args, self.device(),
         args.rows, grain);
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_init) { m.impl("counter_trunc_normal_", &counter_trunc_normal_); }

}  // namespace tdx::ops
