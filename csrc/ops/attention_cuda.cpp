// CUDA registration of ring attention and lse_merge_: the ring of attention.cpp
// with ATen's memory-efficient attention (which returns log-sum-exp) for the
// blocks and kernels/cuda/attention.cu for the merge. Kv heads are expanded to
// the query heads for the block kernel only (they travel at kv heads) and the
// block's dK/dV are summed back over each group. fp16, bf16 and fp32.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cuda/attention.cuh"
#include "ops/attention.h"
#include "ops/element_type.h"

namespace tdx::ops {
namespace {

// The efficient-attention kernels pad log-sum-exp rows to a multiple of 32.
constexpr int64_t kLseAlignment = 32;

at::Tensor expand_heads(const at::Tensor& kv, int64_t q_heads) {
  const int64_t kv_heads = kv.size(1);
  return kv_heads == q_heads ? kv : kv.repeat_interleave(q_heads / kv_heads, 1);
}

at::Tensor sum_head_groups(const at::Tensor& grad, int64_t kv_heads) {
  const int64_t q_heads = grad.size(1);
  if (q_heads == kv_heads) return grad;
  return grad.unflatten(1, {kv_heads, q_heads / kv_heads}).sum(2);
}

void check_cuda_dtype(const at::Tensor& q) {
  TORCH_CHECK_TYPE(
      q.scalar_type() != at::kDouble, "ring_attention on CUDA: float64 is not supported by the block kernels; "
      "use float32, bfloat16 or float16");
}

std::tuple<at::Tensor, at::Tensor> cuda_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      bool causal, double scale) {
  check_cuda_dtype(q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t q_heads = q.size(1);
  auto result = at::_scaled_dot_product_efficient_attention(
      q, expand_heads(k, q_heads), expand_heads(v, q_heads), std::nullopt, /*compute_log_sumexp=*/true, 0.0, causal,
      scale);
  const auto& out = std::get<0>(result);
  const auto& lse = std::get<1>(result);
  return {out.contiguous(), lse.narrow(2, 0, q.size(2)).contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_block_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  check_cuda_dtype(q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t q_heads = q.size(1);
  const int64_t rows = q.size(2);
  const int64_t padded = (rows + kLseAlignment - 1) / kLseAlignment * kLseAlignment;
  auto lse_padded = at::zeros({lse.size(0), lse.size(1), padded}, lse.options().dtype(at::kFloat));
  lse_padded.narrow(2, 0, rows).copy_(lse);
  const auto unused_rng = at::empty({}, at::TensorOptions().dtype(at::kLong));  // dropout is 0
  auto grads = at::_scaled_dot_product_efficient_attention_backward(
      grad_out.contiguous(), q.contiguous(), expand_heads(k, q_heads).contiguous(),
      expand_heads(v, q_heads).contiguous(), at::Tensor(), out.contiguous(), lse_padded, unused_rng, unused_rng, 0.0,
      {true, true, true, false}, causal, scale);
  return {std::get<0>(grads), sum_head_groups(std::get<1>(grads), k.size(1)),
          sum_head_groups(std::get<2>(grads), v.size(1))};
}

void cuda_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                const at::Tensor& block_lse) {
  const auto shape = check_lse_merge(out, lse, block_out, block_lse);
  const c10::cuda::CUDAGuard guard(out.device());
  const auto type = element_type("lse_merge_", block_out.scalar_type());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "lse_merge_", [&] {
    kernels::cuda::lse_merge<scalar_t>(type, out.data_ptr<scalar_t>(), shape.out_outer_stride,
                                       lse.data_ptr<scalar_t>(), shape.lse_outer_stride, block_out.data_ptr(),
                                       shape.rows * shape.dim, block_lse.data_ptr<scalar_t>(), shape.rows,
                                       shape.outer, shape.rows, shape.dim, stream);
  });
}

const BlockAttention kCudaBlock{&cuda_block_forward, &cuda_block_backward, &cuda_merge};

std::tuple<at::Tensor, at::Tensor> cuda_ring_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     c10::string_view group_name, bool causal, double scale,
                                                     c10::string_view layout) {
  return ring_attention_forward(kCudaBlock, q, k, v, group_name, causal, scale, layout);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_ring_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::string_view group_name, bool causal, double scale, c10::string_view layout) {
  return ring_attention_backward(kCudaBlock, grad_out, q, k, v, out, lse, group_name, causal, scale, layout);
}

}  // namespace

TORCH_LIBRARY_IMPL(tdx, CUDA, m) {
  m.impl("ring_attention_fwd", &cuda_ring_forward);
  m.impl("ring_attention_bwd", &cuda_ring_backward);
  m.impl("lse_merge_", &cuda_merge);
}

}  // namespace tdx::ops
