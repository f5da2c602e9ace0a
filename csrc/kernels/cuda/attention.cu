// CUDA kernel of attention's log-sum-exp merge (contract: kernels/attention.h).

#include "kernels/attention.h"

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels {
namespace cuda {
namespace {

// One thread block per query row of groups [group_begin, ...); threads stride over the features.
template <typename T, typename Acc>
__global__ void merge_kernel(MergeShape shape, Acc* __restrict__ out, Acc* __restrict__ lse,
                             const T* __restrict__ block_out, const Acc* __restrict__ block_lse,
                             int64_t group_begin) {
  const int64_t g = group_begin + blockIdx.x / shape.rows;
  const int64_t i = blockIdx.x % shape.rows;
  Acc* acc_lse = lse + g * shape.lse_group_stride + i;
  const Acc b = block_lse[g * shape.block_lse_group_stride + i];
  if (b == -INFINITY) return;
  const Acc a = *acc_lse;
  const Acc max = a > b ? a : b;
  const Acc weight_a = exp(a - max);
  const Acc weight_b = exp(b - max);
  const Acc total = weight_a + weight_b;
  const Acc scale_a = weight_a / total;
  const Acc scale_b = weight_b / total;
  Acc* acc_row = out + g * shape.out_group_stride + i * shape.dim;
  const T* block_row = block_out + g * shape.block_out_group_stride + i * shape.dim;
  for (int64_t d = threadIdx.x; d < shape.dim; d += blockDim.x) {
    acc_row[d] = scale_a * acc_row[d] + scale_b * static_cast<Acc>(load(block_row[d]));
  }
  __syncthreads();  // every thread has read *acc_lse
  if (threadIdx.x == 0) *acc_lse = max + log(total);
}

void lse_merge(const LseMergeArgs& args, const Launch& launch) {
  const MergeShape& shape = args.shape;
  const int64_t blocks = (launch.end - launch.begin) * shape.rows;
  if (blocks == 0) return;
  // Whole warps, at least one (a row without features still merges its lse).
  const int threads = shape.dim >= 256 ? 256 : std::max(32, static_cast<int>((shape.dim + 31) / 32 * 32));
  visit_element_type(shape.block_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    TDX_LAUNCH(blocks, threads, static_cast<cudaStream_t>(launch.stream), merge_kernel<T, Acc>)(
        shape, static_cast<Acc*>(args.out), static_cast<Acc*>(args.lse), static_cast<const T*>(args.block_out),
        static_cast<const Acc*>(args.block_lse), launch.begin);
  });
  check_launch("lse_merge");
}

}  // namespace
}  // namespace cuda

const AttentionKernels& AttentionKernels::cuda() {
  static const AttentionKernels table{&cuda::lse_merge};
  return table;
}

}  // namespace tdx::kernels
