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

// Numbers the items i in [0, items) for which flagged(i) holds, in increasing order, by a block-wide
// prefix sum over chunks of kMoeThreads items: number(i, n) for the n-th flagged item (from 0),
// unflagged(i) for the others.
template <typename Flagged, typename Number, typename Unflagged>
__device__ int64_t number_in_order(int64_t items, Flagged flagged, Number number, Unflagged unflagged) {
  __shared__ int64_t scan[kMoeThreads];
  int64_t taken = 0;  // flagged items before this chunk
  for (int64_t chunk = 0; chunk < items; chunk += kMoeThreads) {
    const int64_t i = chunk + threadIdx.x;
    const bool flag = i < items && flagged(i);
    scan[threadIdx.x] = flag ? 1 : 0;
    __syncthreads();
    for (int offset = 1; offset < kMoeThreads; offset *= 2) {
      const int64_t add = static_cast<int>(threadIdx.x) >= offset ? scan[threadIdx.x - offset] : 0;
      __syncthreads();
      scan[threadIdx.x] += add;
      __syncthreads();
    }
    if (flag) {
      number(i, taken + scan[threadIdx.x] - 1);
    } else if (i < items) {
      unflagged(i);
    }
    taken += scan[kMoeThreads - 1];
    __syncthreads();  // every thread has read the scan before the next chunk overwrites it
  }
  return taken;  // the flagged items, the same in every thread
}

__device__ __forceinline__ bool out_of_range(int64_t expert, int64_t num_experts) {
  return expert < -1 || expert >= num_experts;
}

__device__ __forceinline__ int64_t rank_of(int64_t expert, int64_t experts_per_rank) {
  return expert >= 0 ? expert / experts_per_rank : -1;
}

// One block per rank: its tokens numbered in token order from the block's first row.
__global__ void route_tokens_kernel(const int64_t* __restrict__ experts, int64_t tokens, int64_t top_k,
                                    int64_t ranks, int64_t experts_per_rank, const int64_t* __restrict__ starts,
                                    const int64_t* __restrict__ ends, int64_t* __restrict__ send_rows,
                                    int64_t rank_begin) {
  const int64_t r = rank_begin + blockIdx.x;
  const int64_t first = starts[r];
  const int64_t end = ends[r];
  number_in_order(
      tokens,
      [&](int64_t t) {
        for (int64_t j = 0; j < top_k; ++j) {
          if (rank_of(experts[t * top_k + j], experts_per_rank) == r) return true;
        }
        return false;
      },
      [&](int64_t t, int64_t n) { send_rows[t * ranks + r] = first + n < end ? first + n : -1; },
      [&](int64_t t) { send_rows[t * ranks + r] = -1; });
}

// One block per token: its row copied to every rank it goes to, threads striding over the features.
template <typename T, typename Acc>
__global__ void pack_rows_kernel(const T* __restrict__ x, const Acc* __restrict__ weights, T* __restrict__ rows,
                                 int64_t* __restrict__ local_experts, Acc* __restrict__ row_weights,
                                 const int64_t* __restrict__ experts, const int64_t* __restrict__ send_rows,
                                 int64_t top_k, int64_t dim, int64_t ranks, int64_t experts_per_rank,
                                 int64_t token_begin) {
  const int64_t t = token_begin + blockIdx.x;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t row = send_rows[t * ranks + r];
    if (row < 0) continue;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) rows[row * dim + d] = x[t * dim + d];
    for (int64_t j = threadIdx.x; j < top_k; j += blockDim.x) {
      const int64_t expert = experts[t * top_k + j];
      const bool here = rank_of(expert, experts_per_rank) == r;
      local_experts[row * top_k + j] = here ? expert - r * experts_per_rank : -1;
      row_weights[row * top_k + j] = here ? weights[t * top_k + j] : Acc(0);
    }
  }
}

// One block per token: threads stride over the features, summing the token's rows in rank order.
template <typename T, typename Acc>
__global__ void sum_rows_kernel(const T* __restrict__ rows, const Acc* __restrict__ row_weights, T* __restrict__ out,
                                Acc* __restrict__ out_weights, const int64_t* __restrict__ experts,
                                const int64_t* __restrict__ send_rows, int64_t top_k, int64_t dim, int64_t ranks,
                                int64_t experts_per_rank, int64_t token_begin) {
  const int64_t t = token_begin + blockIdx.x;
  const int64_t num_experts = ranks * experts_per_rank;
  bool poisoned = false;
  for (int64_t j = 0; j < top_k; ++j) poisoned |= out_of_range(experts[t * top_k + j], num_experts);
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    Acc sum = poisoned ? Acc(NAN) : Acc(0);
    for (int64_t r = 0; r < ranks; ++r) {
      const int64_t row = send_rows[t * ranks + r];
      if (row >= 0) sum += static_cast<Acc>(load(rows[row * dim + d]));
    }
    out[t * dim + d] = store_as<T>(sum);
  }
  if (row_weights == nullptr) return;
  for (int64_t j = threadIdx.x; j < top_k; j += blockDim.x) {
    const int64_t expert = experts[t * top_k + j];
    const int64_t r = rank_of(expert, experts_per_rank);
    const int64_t row = out_of_range(expert, num_experts) || r < 0 ? -1 : send_rows[t * ranks + r];
    out_weights[t * top_k + j] =
        out_of_range(expert, num_experts) ? Acc(NAN) : row >= 0 ? row_weights[row * top_k + j] : Acc(0);
  }
}

// One block per expert: its slots numbered in slot order from the segment's first row, then the rows
// they leave empty zeroed. Block 0 also marks the slots without a local expert.
__global__ void sort_slots_kernel(const int64_t* __restrict__ experts, int64_t slots, int64_t num_experts,
                                  int64_t capacity, const int64_t* __restrict__ starts,
                                  const int64_t* __restrict__ ends, int64_t* __restrict__ positions,
                                  char* __restrict__ sorted, int64_t row_bytes, int64_t expert_begin) {
  const int64_t e = expert_begin + blockIdx.x;
  const int64_t first = capacity >= 0 ? e * capacity : starts[e];
  const int64_t end = capacity >= 0 ? first + capacity : ends[e];
  const int64_t numbered = number_in_order(
      slots, [&](int64_t slot) { return experts[slot] == e; },
      [&](int64_t slot, int64_t n) { positions[slot] = first + n < end ? first + n : -1; },
      [&](int64_t slot) {
        const int64_t expert = experts[slot];
        if (e == 0 && out_of_range(expert, num_experts)) {
          positions[slot] = kInvalidSlot;
        } else if (e == 0 && expert < 0) {
          positions[slot] = -1;
        }
      });
  const int64_t filled = first + numbered < end ? first + numbered : end;
  for (int64_t byte = filled * row_bytes + threadIdx.x; byte < end * row_bytes; byte += blockDim.x) sorted[byte] = 0;
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
      if (position == kInvalidSlot) sum = Acc(NAN);
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
      dots[r * top_k + j] = position == kInvalidSlot ? Acc(NAN) : total;
    }
    __syncthreads();  // warp_sums is read before the next slot overwrites it
  }
}

void route_tokens(const RouteTokensArgs& args, const Launch& launch) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  TDX_LAUNCH(blocks, kMoeThreads, static_cast<cudaStream_t>(launch.stream), route_tokens_kernel)(
      args.experts, args.tokens, args.top_k, args.ranks, args.experts_per_rank, args.starts, args.ends,
      args.send_rows, launch.begin);
  check_launch("moe route_tokens");
}

void pack_rows(const PackRowsArgs& args, const Launch& launch) {
  const ExchangeRows& e = args.exchange;
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(e.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    TDX_LAUNCH(blocks, row_threads(e.dim), static_cast<cudaStream_t>(launch.stream), pack_rows_kernel<T, Acc>)(
        static_cast<const T*>(args.x), static_cast<const Acc*>(args.weights), static_cast<T*>(args.rows),
        args.local_experts, static_cast<Acc*>(args.row_weights), e.experts, e.send_rows, e.top_k, e.dim, e.ranks,
        e.experts_per_rank, launch.begin);
  });
  check_launch("moe pack_rows");
}

void sum_rows(const SumRowsArgs& args, const Launch& launch) {
  const ExchangeRows& e = args.exchange;
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(e.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    TDX_LAUNCH(blocks, row_threads(e.dim), static_cast<cudaStream_t>(launch.stream), sum_rows_kernel<T, Acc>)(
        static_cast<const T*>(args.rows), static_cast<const Acc*>(args.row_weights), static_cast<T*>(args.out),
        static_cast<Acc*>(args.out_weights), e.experts, e.send_rows, e.top_k, e.dim, e.ranks, e.experts_per_rank,
        launch.begin);
  });
  check_launch("moe sum_rows");
}

void sort_slots(const SortSlotsArgs& args, const Launch& launch) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  TDX_LAUNCH(blocks, kMoeThreads, static_cast<cudaStream_t>(launch.stream), sort_slots_kernel)(
      args.experts, args.rows * args.top_k, args.num_experts, args.capacity, args.starts, args.ends,
      args.positions, static_cast<char*>(args.sorted), args.row_bytes, launch.begin);
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
  static const MoeKernels table{&cuda::route_tokens, &cuda::pack_rows, &cuda::sum_rows, &cuda::sort_slots, &cuda::scatter_rows, &cuda::gather_sum_rows, &cuda::slot_dots};
  return table;
}

}  // namespace tdx::kernels
