// CUDA kernels of the MoE token permutation (contracts: kernels/moe.h).

#include "kernels/moe.h"

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels {
namespace cuda {
namespace {

// Threads of a sort block, and the most of a row block.
constexpr int kMoeThreads = 256;

int row_threads(int64_t dim) { return dim >= kMoeThreads ? kMoeThreads : std::max(32, static_cast<int>((dim + 31) / 32 * 32)); }

// One block per expert: the block walks the slots in chunks of kMoeThreads, numbering the expert's
// slots in slot order by a block-wide prefix sum. Block 0 also marks the slots without a local expert.
__global__ void sort_slots_kernel(const int64_t* __restrict__ experts, int64_t slots, int64_t num_experts,
                                  int64_t capacity, const int64_t* __restrict__ starts,
                                  int64_t* __restrict__ positions, int64_t expert_begin) {
  const int64_t e = expert_begin + blockIdx.x;
  __shared__ int64_t scan[kMoeThreads];
  const int64_t first = capacity >= 0 ? e * capacity : starts[e];
  int64_t taken = 0;  // the expert's slots before this chunk
  for (int64_t chunk = 0; chunk < slots; chunk += kMoeThreads) {
    const int64_t slot = chunk + threadIdx.x;
    const int64_t expert = slot < slots ? experts[slot] : -1;
    const int64_t flag = expert == e ? 1 : 0;
    scan[threadIdx.x] = flag;
    __syncthreads();
    for (int offset = 1; offset < kMoeThreads; offset *= 2) {
      const int64_t add = static_cast<int>(threadIdx.x) >= offset ? scan[threadIdx.x - offset] : 0;
      __syncthreads();
      scan[threadIdx.x] += add;
      __syncthreads();
    }
    if (flag) {
      const int64_t rank = taken + scan[threadIdx.x] - 1;
      positions[slot] = capacity >= 0 && rank >= capacity ? -1 : first + rank;
    } else if (e == 0 && slot < slots && (expert < 0 || expert >= num_experts)) {
      positions[slot] = -1;
    }
    taken += scan[kMoeThreads - 1];
    __syncthreads();  // every thread has read the scan before the next chunk overwrites it
  }
}

template <typename Acc>
__device__ __forceinline__ Acc slot_weight(const Acc* weights, int64_t slot) {
  return weights == nullptr ? Acc(1) : weights[slot];
}

// One block per row; threads stride over the features.
template <typename T, typename Acc>
__global__ void scatter_rows_kernel(const T* __restrict__ x, T* __restrict__ sorted,
                                    const int64_t* __restrict__ positions, const Acc* __restrict__ weights,
                                    int64_t top_k, int64_t dim, int64_t row_begin) {
  const int64_t r = row_begin + blockIdx.x;
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t position = positions[r * top_k + j];
    if (position < 0) continue;
    const Acc w = slot_weight(weights, r * top_k + j);
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      sorted[position * dim + d] = store_as<T>(w * static_cast<Acc>(load(x[r * dim + d])));
    }
  }
}

template <typename T, typename Acc>
__global__ void gather_sum_rows_kernel(const T* __restrict__ sorted, T* __restrict__ y,
                                       const int64_t* __restrict__ positions, const Acc* __restrict__ weights,
                                       int64_t top_k, int64_t dim, int64_t row_begin) {
  const int64_t r = row_begin + blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    Acc sum = 0;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t position = positions[r * top_k + j];
      if (position >= 0) sum += slot_weight(weights, r * top_k + j) * static_cast<Acc>(load(sorted[position * dim + d]));
    }
    y[r * dim + d] = store_as<T>(sum);
  }
}

// One block per row: per slot, a block-wide dot product (warp shuffles, then the warps' sums in order).
template <typename T, typename Acc>
__global__ void slot_dots_kernel(const T* __restrict__ g, const T* __restrict__ sorted,
                                 const int64_t* __restrict__ positions, Acc* __restrict__ dots, int64_t top_k,
                                 int64_t dim, int64_t row_begin) {
  const int64_t r = row_begin + blockIdx.x;
  __shared__ Acc warp_sums[kMoeThreads / 32];
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t position = positions[r * top_k + j];
    Acc dot = 0;
    if (position >= 0) {
      for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
        dot += static_cast<Acc>(load(g[r * dim + d])) * static_cast<Acc>(load(sorted[position * dim + d]));
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_down_sync(0xffffffffu, dot, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
      Acc total = 0;
      for (unsigned int w = 0; w < blockDim.x / 32; ++w) total += warp_sums[w];
      dots[r * top_k + j] = total;
    }
    __syncthreads();  // warp_sums is read before the next slot overwrites it
  }
}

void sort_slots(const SortSlotsArgs& args, const Launch& launch) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  TDX_LAUNCH(blocks, kMoeThreads, static_cast<cudaStream_t>(launch.stream), sort_slots_kernel)(
      args.experts, args.rows * args.top_k, args.num_experts, args.capacity, args.starts, args.positions,
      launch.begin);
  check_launch("moe sort_slots");
}

void scatter_rows(const ScatterRowsArgs& args, const Launch& launch) {
  const SlotRows& s = args.slots;
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(s.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    TDX_LAUNCH(blocks, row_threads(s.dim), static_cast<cudaStream_t>(launch.stream), scatter_rows_kernel<T, Acc>)(
        static_cast<const T*>(args.x), static_cast<T*>(args.sorted), s.positions,
        static_cast<const Acc*>(s.weights), s.top_k, s.dim, launch.begin);
  });
  check_launch("moe scatter_rows");
}

void gather_sum_rows(const GatherSumRowsArgs& args, const Launch& launch) {
  const SlotRows& s = args.slots;
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(s.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    TDX_LAUNCH(blocks, row_threads(s.dim), static_cast<cudaStream_t>(launch.stream),
               gather_sum_rows_kernel<T, Acc>)(static_cast<const T*>(args.sorted), static_cast<T*>(args.y),
                                               s.positions, static_cast<const Acc*>(s.weights), s.top_k, s.dim,
                                               launch.begin);
  });
  check_launch("moe gather_sum_rows");
}

void slot_dots(const SlotDotsArgs& args, const Launch& launch) {
  const SlotRows& s = args.slots;
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(s.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    TDX_LAUNCH(blocks, row_threads(s.dim), static_cast<cudaStream_t>(launch.stream), slot_dots_kernel<T, Acc>)(
        static_cast<const T*>(args.g), static_cast<const T*>(args.sorted), s.positions,
        static_cast<Acc*>(args.dots), s.top_k, s.dim, launch.begin);
  });
  check_launch("moe slot_dots");
}

}  // namespace
}  // namespace cuda

const MoeKernels& MoeKernels::cuda() {
  static const MoeKernels table{&cuda::sort_slots, &cuda::scatter_rows, &cuda::gather_sum_rows, &cuda::slot_dots};
  return table;
}

}  // namespace tdx::kernels
