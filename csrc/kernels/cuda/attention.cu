#include "kernels/cuda/attention.cuh"

#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels::cuda {
namespace {

// One thread block per query row; threads stride over the features.
template <typename T, typename Acc>
__global__ void merge_kernel(Acc* __restrict__ out, int64_t out_outer_stride, Acc* __restrict__ lse,
                             int64_t lse_outer_stride, const T* __restrict__ block_out,
                             int64_t block_out_outer_stride, const Acc* __restrict__ block_lse,
                             int64_t block_lse_outer_stride, int64_t rows, int64_t dim) {
  const int64_t g = blockIdx.x / rows;
  const int64_t i = blockIdx.x % rows;
  Acc* acc_lse = lse + g * lse_outer_stride + i;
  const Acc b = block_lse[g * block_lse_outer_stride + i];
  if (b == -INFINITY) return;
  const Acc a = *acc_lse;
  const Acc max = a > b ? a : b;
  const Acc weight_a = exp(a - max);
  const Acc weight_b = exp(b - max);
  const Acc total = weight_a + weight_b;
  const Acc scale_a = weight_a / total;
  const Acc scale_b = weight_b / total;
  Acc* acc_row = out + g * out_outer_stride + i * dim;
  const T* block_row = block_out + g * block_out_outer_stride + i * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    acc_row[d] = scale_a * acc_row[d] + scale_b * static_cast<Acc>(load(block_row[d]));
  }
  __syncthreads();  // every thread has read *acc_lse
  if (threadIdx.x == 0) *acc_lse = max + log(total);
}

}  // namespace

template <typename Acc>
void lse_merge(ElementType block_type, Acc* out, int64_t out_outer_stride, Acc* lse, int64_t lse_outer_stride,
               const void* block_out, int64_t block_out_outer_stride, const Acc* block_lse,
               int64_t block_lse_outer_stride, int64_t outer, int64_t rows, int64_t dim, cudaStream_t stream) {
  if (outer * rows == 0) return;
  const int threads = dim >= 256 ? 256 : static_cast<int>((dim + 31) / 32 * 32);
  launch_for(block_type, "lse_merge", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TDX_LAUNCH(outer * rows, threads, stream, merge_kernel<T, Acc>)(
        out, out_outer_stride, lse, lse_outer_stride, static_cast<const T*>(block_out), block_out_outer_stride,
        block_lse, block_lse_outer_stride, rows, dim);
  });
}

template void lse_merge<float>(ElementType, float*, int64_t, float*, int64_t, const void*, int64_t, const float*,
                               int64_t, int64_t, int64_t, int64_t, cudaStream_t);
template void lse_merge<double>(ElementType, double*, int64_t, double*, int64_t, const void*, int64_t,
                                const double*, int64_t, int64_t, int64_t, int64_t, cudaStream_t);

}  // namespace tdx::kernels::cuda
