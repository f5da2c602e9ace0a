// CUDA kernels of the vocab-parallel cross-entropy (contracts: kernels/cross_entropy.h).

#include "kernels/cross_entropy.h"

#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels {
namespace cuda {
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

// One block per row of [row_begin, ...): every thread keeps an online (max, sumexp) over its
// strided columns, then warps and the block merge the pairs.
template <typename T, typename Acc>
__global__ void stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                             int64_t vocab_local, int64_t vocab_start, Acc* __restrict__ row_max,
                             Acc* __restrict__ row_sumexp, Acc* __restrict__ target_logit, int64_t row_begin) {
  const int64_t row = row_begin + blockIdx.x;
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
                            int64_t ignore_index, T* grad_logits, int64_t row_begin) {
  const int64_t row = row_begin + blockIdx.x;
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

void shard_stats(const ShardStatsArgs& args, const Launch& launch) {
  const VocabShard& shard = args.shard;
  const int64_t rows = launch.end - launch.begin;
  if (rows == 0) return;
  visit_element_type(shard.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    auto* stats = static_cast<Acc*>(args.stats);
    TDX_LAUNCH(rows, kThreads, static_cast<cudaStream_t>(launch.stream), stats_kernel<T, Acc>)(
        static_cast<const T*>(args.logits), args.target, shard.vocab_local, shard.vocab_start, stats,
        stats + shard.rows, stats + 2 * shard.rows, launch.begin);
  });
  check_launch("cross_entropy shard_stats");
}

void shard_grad(const ShardGradArgs& args, const Launch& launch) {
  const VocabShard& shard = args.shard;
  const int64_t rows = launch.end - launch.begin;
  if (rows == 0) return;
  visit_element_type(shard.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    TDX_LAUNCH(rows, kThreads, static_cast<cudaStream_t>(launch.stream), grad_kernel<T, Acc>)(
        static_cast<const T*>(args.grad_loss), static_cast<const T*>(args.logits), args.target,
        static_cast<const Acc*>(args.lse), shard.vocab_local, shard.vocab_start, args.ignore_index,
        static_cast<T*>(args.grad_logits), launch.begin);
  });
  check_launch("cross_entropy shard_grad");
}

}  // namespace
}  // namespace cuda

const CrossEntropyKernels& CrossEntropyKernels::cuda() {
  static const CrossEntropyKernels table{&cuda::shard_stats, &cuda::shard_grad};
  return table;
}

}  // namespace tdx::kernels
