// CUDA registration of the vocab-parallel cross-entropy: the shared host code
// of cross_entropy.cpp with the kernels of kernels/cuda/cross_entropy.cu on
// the current stream. Targets are not range-checked here (that would sync).

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/cross_entropy.cuh"
#include "ops/cross_entropy.h"
#include "ops/element_type.h"

namespace tdx::ops {
namespace {

void cuda_shard_stats(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                      at::Tensor& stats) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  const auto type = element_type("vocab_parallel_cross_entropy", logits.scalar_type());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "vocab_parallel_cross_entropy", [&] {
    auto* out = stats.data_ptr<scalar_t>();
    kernels::cuda::vocab_shard_stats<scalar_t>(type, logits.data_ptr(), target.data_ptr<int64_t>(), rows,
                                               logits.size(1), vocab_start, out, out + rows, out + 2 * rows,
                                               stream);
  });
}

void cuda_shard_grad(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                     const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index, at::Tensor& grad_logits) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto type = element_type("vocab_parallel_cross_entropy_backward", logits.scalar_type());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(lse.scalar_type(), "vocab_parallel_cross_entropy_backward", [&] {
    kernels::cuda::vocab_shard_grad<scalar_t>(type, grad_loss.data_ptr(), logits.data_ptr(),
                                              target.data_ptr<int64_t>(), lse.data_ptr<scalar_t>(),
                                              logits.size(0), logits.size(1), vocab_start, ignore_index,
                                              grad_logits.data_ptr(), stream);
  });
}

std::tuple<at::Tensor, at::Tensor> cuda_forward(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start, int64_t vocab_size,
    int64_t ignore_index, c10::string_view group_name, bool /*inplace_backward: autograd's concern*/) {
  return vocab_parallel_cross_entropy(
      &cuda_shard_stats, logits, target, vocab_start, vocab_size, ignore_index, group_name);
}

at::Tensor cuda_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                         const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index) {
  return vocab_parallel_cross_entropy_backward(
      &cuda_shard_grad, grad_loss, logits, target, lse, vocab_start, ignore_index);
}

void cuda_backward_inplace(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                           const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index) {
  vocab_parallel_cross_entropy_backward_(&cuda_shard_grad, grad_loss, logits, target, lse, vocab_start,
                                         ignore_index);
}

}  // namespace

TORCH_LIBRARY_IMPL(tdx, CUDA, m) {
  m.impl("vocab_parallel_cross_entropy", &cuda_forward);
  m.impl("vocab_parallel_cross_entropy_backward", &cuda_backward);
  m.impl("vocab_parallel_cross_entropy_backward_", &cuda_backward_inplace);
}

}  // namespace tdx::ops
