#include "kernels/cuda/cross_entropy.cuh"

#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Merges two (max, sum of exp(x - max)) pairs.
template <typename Acc>
__device__ __forceinline__ void merge(Acc& max, Acc& sum, Acc other_max, Acc other_sum) {
  const Acc new_max = max > other_max ? max : other_max;
  if (new_max == -INFINITY) {  // both sums are 0 (or NaN, which must survive)
    sum += other_sum;
    return;
  }
  sum = sum * exp(max - new_max) + other_sum * exp(other_max - new_max);
  max = new_max;
}

// One block per row: every thread keeps an online (max, sumexp) over its
// strided columns, then warps and the block merge the pairs.
template <typename T, typename Acc>
__global__ void stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                             int64_t vocab_local, int64_t vocab_start, Acc* __restrict__ row_max,
                             Acc* __restrict__ row_sumexp, Acc* __restrict__ target_logit) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab_local;
  Acc max = -INFINITY;
  Acc sum = 0;
  for (int64_t v = threadIdx.x; v < vocab_local; v += blockDim.x) {
    const Acc value = static_cast<Acc>(load(x[v]));
    if (value > max) {
      sum = sum * exp(max - value) + Acc(1);
      max = value;
    } else {
      // value <= max, or NaN (which must reach the sum); while max is -inf, so is value: shift by 0.
      sum += exp(value - (max == -INFINITY ? Acc(0) : max));
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const Acc other_max = __shfl_down_sync(0xffffffffu, max, offset);
    const Acc other_sum = __shfl_down_sync(0xffffffffu, sum, offset);
    merge(max, sum, other_max, other_sum);
  }
  __shared__ Acc warp_max[kWarps];
  __shared__ Acc warp_sum[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_max[warp] = max;
    warp_sum[warp] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) merge(max, sum, warp_max[w], warp_sum[w]);
    row_max[row] = max;
    row_sumexp[row] = sum;
    const int64_t local_target = target[row] - vocab_start;
    target_logit[row] =
        (local_target >= 0 && local_target < vocab_local) ? static_cast<Acc>(load(x[local_target])) : Acc(0);
  }
}

// grad_logits may be logits (in place): every element is read by the thread that writes it.
template <typename T, typename Acc>
__global__ void grad_kernel(const T* __restrict__ grad_loss, const T* logits, const int64_t* __restrict__ target,
                            const Acc* __restrict__ lse, int64_t vocab_local, int64_t vocab_start,
                            int64_t ignore_index, T* grad_logits) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab_local;
  T* dx = grad_logits + row * vocab_local;
  if (target[row] == ignore_index) {  // exactly 0, also where exp(x - lse) is not finite (a masked row)
    for (int64_t v = threadIdx.x; v < vocab_local; v += blockDim.x) dx[v] = store_as<T>(Acc(0));
    return;
  }
  const Acc g = static_cast<Acc>(load(grad_loss[row]));
  const Acc row_lse = lse[row];
  const int64_t local_target = target[row] - vocab_start;
  for (int64_t v = threadIdx.x; v < vocab_local; v += blockDim.x) {
    const Acc is_target = v == local_target ? Acc(1) : Acc(0);
    dx[v] = store_as<T>(g * (exp(static_cast<Acc>(load(x[v])) - row_lse) - is_target));
  }
}

}  // namespace

template <typename Acc>
void vocab_shard_stats(ElementType type, const void* logits, const int64_t* target, int64_t rows,
                       int64_t vocab_local, int64_t vocab_start, Acc* row_max, Acc* row_sumexp,
                       Acc* target_logit, cudaStream_t stream) {
  if (rows == 0) return;
  launch_for(type, "vocab_shard_stats", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TDX_LAUNCH(rows, kThreads, stream, stats_kernel<T, Acc>)(static_cast<const T*>(logits), target, vocab_local,
                                                             vocab_start, row_max, row_sumexp, target_logit);
  });
}

template <typename Acc>
void vocab_shard_grad(ElementType type, const void* grad_loss, const void* logits, const int64_t* target,
                      const Acc* lse, int64_t rows, int64_t vocab_local, int64_t vocab_start,
                      int64_t ignore_index, void* grad_logits, cudaStream_t stream) {
  if (rows == 0) return;
  launch_for(type, "vocab_shard_grad", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TDX_LAUNCH(rows, kThreads, stream, grad_kernel<T, Acc>)(
        static_cast<const T*>(grad_loss), static_cast<const T*>(logits), target, lse, vocab_local,
        vocab_start, ignore_index, static_cast<T*>(grad_logits));
  });
}

template void vocab_shard_stats<float>(ElementType, const void*, const int64_t*, int64_t, int64_t, int64_t,
                                       float*, float*, float*, cudaStream_t);
template void vocab_shard_stats<double>(ElementType, const void*, const int64_t*, int64_t, int64_t, int64_t,
                                        double*, double*, double*, cudaStream_t);
template void vocab_shard_grad<float>(ElementType, const void*, const void*, const int64_t*, const float*,
                                      int64_t, int64_t, int64_t, int64_t, void*, cudaStream_t);
template void vocab_shard_grad<double>(ElementType, const void*, const void*, const int64_t*, const double*,
                                       int64_t, int64_t, int64_t, int64_t, void*, cudaStream_t);

}  // namespace tdx::kernels::cuda
