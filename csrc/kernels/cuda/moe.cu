// CUDA kernels of the MoE token permutation (contracts: kernels/moe.h).

#include "kernels/moe.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels {
namespace cuda {
namespace {

// Threads of a sort block, and the most of a row block.
constexpr int kMoeThreads = 256;

int row_threads(int64_t dim) { return dim >= kMoeThreads ? kMoeThreads : std::max(32, static_cast<int>((dim + 31) / 32 * 32)); }

// The sum of `value` over the threads of the block before this one (exclusive) and over all of them
// (total), by a prefix sum in shared memory. Every thread of the block calls it.
struct BlockSums {
  int64_t before;
  int64_t total;
};

__device__ BlockSums block_exclusive_sum(int64_t value) {
  __shared__ int64_t scan[kMoeThreads];
  scan[threadIdx.x] = value;
  __syncthreads();
  for (int offset = 1; offset < kMoeThreads; offset *= 2) {
    const int64_t add = static_cast<int>(threadIdx.x) >= offset ? scan[threadIdx.x - offset] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  const BlockSums sums{scan[threadIdx.x] - value, scan[kMoeThreads - 1]};
  __syncthreads();  // every thread has read the scan before a next call overwrites it
  return sums;
}

// Numbers the items i in [0, items) for which flagged(i) holds, in increasing order, by a block-wide
// prefix sum over chunks of kMoeThreads items: number(i, n) for the n-th flagged item (from 0),
// unflagged(i) for the others.
template <typename Flagged, typename Number, typename Unflagged>
__device__ int64_t number_in_order(int64_t items, Flagged flagged, Number number, Unflagged unflagged) {
  int64_t taken = 0;  // flagged items before this chunk
  for (int64_t chunk = 0; chunk < items; chunk += kMoeThreads) {
    const int64_t i = chunk + threadIdx.x;
    const bool flag = i < items && flagged(i);
    const BlockSums sums = block_exclusive_sum(flag ? 1 : 0);
    if (flag) {
      number(i, taken + sums.before);
    } else if (i < items) {
      unflagged(i);
    }
    taken += sums.total;
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
      [&](int64_t t, int64_t n) { send_rows[t * ranks + r] = first + n < end ? first + n : kOverflowRow; },
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
  for (int64_t r = 0; r < ranks; ++r) poisoned |= send_rows[t * ranks + r] == kOverflowRow;
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
        out_of_range(expert, num_experts) || row == kOverflowRow ? Acc(NAN)
        : row >= 0                                               ? row_weights[row * top_k + j]
                                                                 : Acc(0);
  }
}

// The sort of the slots, in four kernels over all slots at once (the scratch: `counts`, one row of
// num_experts per block of kSortBlockSlots slots, then a row of each expert's slots).
static_assert(kSortBlockSlots == kMoeThreads, "one thread per slot of a sort block");

__device__ __forceinline__ int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ int64_t segment_first(int64_t e, int64_t capacity, const int64_t* starts) {
  return capacity >= 0 ? e * capacity : starts[e];
}

__device__ __forceinline__ int64_t segment_end(int64_t e, int64_t capacity, const int64_t* ends) {
  return capacity >= 0 ? (e + 1) * capacity : ends[e];
}

// 1. One block per block of slots: each slot's rank among the block's earlier slots of its expert (kept
// in positions until step 3), and the block's count of each expert.
__global__ void rank_slots_kernel(const int64_t* __restrict__ experts, int64_t slots, int64_t num_experts,
                                  int64_t* __restrict__ positions, int64_t* __restrict__ counts) {
  __shared__ int64_t ids[kSortBlockSlots];
  const int64_t slot = blockIdx.x * kSortBlockSlots + threadIdx.x;
  const int64_t expert = slot < slots ? experts[slot] : -1;
  ids[threadIdx.x] = expert;
  int64_t* block_counts = counts + blockIdx.x * num_experts;
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) block_counts[e] = 0;
  __syncthreads();
  if (expert < 0 || expert >= num_experts) return;
  int64_t before = 0;
  bool last = true;  // no later slot of this block has the expert
  for (int i = 0; i < kSortBlockSlots; ++i) {
    if (ids[i] != expert) continue;
    if (i < static_cast<int>(threadIdx.x)) ++before;
    if (i > static_cast<int>(threadIdx.x)) last = false;
  }
  positions[slot] = before;
  if (last) block_counts[expert] = before + 1;
}

// 2. One block per expert: each block's count replaced by the expert's first row for that block's
// slots (the segment's first row plus the counts of the earlier blocks), and the expert's slots in
// the totals row; the segment's end in segment_ends. Each thread takes a run of consecutive blocks.
__global__ void block_offsets_kernel(int64_t blocks, int64_t num_experts, int64_t capacity,
                                     const int64_t* __restrict__ starts, const int64_t* __restrict__ ends,
                                     int64_t* __restrict__ counts, int32_t* __restrict__ segment_ends) {
  const int64_t e = blockIdx.x;
  const int64_t per_thread = (blocks + kMoeThreads - 1) / kMoeThreads;
  const int64_t begin = lesser(blocks, threadIdx.x * per_thread);
  const int64_t end = lesser(blocks, begin + per_thread);
  int64_t run = 0;
  for (int64_t b = begin; b < end; ++b) run += counts[b * num_experts + e];
  const BlockSums sums = block_exclusive_sum(run);
  int64_t next = segment_first(e, capacity, starts) + sums.before;
  for (int64_t b = begin; b < end; ++b) {
    const int64_t count = counts[b * num_experts + e];
    counts[b * num_experts + e] = next;
    next += count;
  }
  if (threadIdx.x == 0) {
    counts[blocks * num_experts + e] = sums.total;
    segment_ends[e] = static_cast<int32_t>(segment_end(e, capacity, ends));
  }
}

// 3. One block per block of slots: positions from the ranks and the offsets (-1 past the segment or
// without an expert, kInvalidSlot for an id out of range).
__global__ void place_slots_kernel(const int64_t* __restrict__ experts, int64_t slots, int64_t num_experts,
                                   int64_t capacity, const int64_t* __restrict__ ends,
                                   const int64_t* __restrict__ counts, int64_t* __restrict__ positions) {
  const int64_t slot = blockIdx.x * kSortBlockSlots + threadIdx.x;
  if (slot >= slots) return;
  const int64_t expert = experts[slot];
  if (out_of_range(expert, num_experts)) {
    positions[slot] = kInvalidSlot;
  } else if (expert < 0) {
    positions[slot] = -1;
  } else {
    const int64_t position = counts[blockIdx.x * num_experts + expert] + positions[slot];
    positions[slot] = position < segment_end(expert, capacity, ends) ? position : -1;
  }
}

// 4. kZeroBlocks blocks per expert: the rows of its segment that no slot fills, zeroed (in 16-byte
// stores where the rows allow).
constexpr int kZeroBlocks = 8;

__global__ void zero_padding_kernel(int64_t blocks, int64_t num_experts, int64_t capacity,
                                    const int64_t* __restrict__ starts, const int64_t* __restrict__ ends,
                                    const int64_t* __restrict__ counts, char* __restrict__ sorted,
                                    int64_t row_bytes) {
  const int64_t e = blockIdx.x / kZeroBlocks;
  const int64_t first = segment_first(e, capacity, starts), end = segment_end(e, capacity, ends);
  const int64_t filled = lesser(end, first + counts[blocks * num_experts + e]);
  char* from = sorted + filled * row_bytes;
  const int64_t bytes = (end - filled) * row_bytes;
  const int64_t stride = static_cast<int64_t>(kZeroBlocks) * blockDim.x;
  const int64_t thread = (blockIdx.x % kZeroBlocks) * blockDim.x + threadIdx.x;
  if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(sorted) % 16 == 0) {
    uint4* words = reinterpret_cast<uint4*>(from);
    for (int64_t w = thread; w < bytes / 16; w += stride) words[w] = uint4{0, 0, 0, 0};
  } else {
    for (int64_t byte = thread; byte < bytes; byte += stride) from[byte] = 0;
  }
}

// `Width` consecutive elements of a row, moved by one load or store (16 bytes on the vector path).
template <typename T, int Width>
struct alignas(sizeof(T) * Width) Pack {
  T v[Width];
};

// The elements of a 16-byte pack of T.
template <typename T>
constexpr int kVectorWidth = static_cast<int>(16 / sizeof(T));

// Whether rows of `dim` elements of T starting at each of `rows` can move in 16-byte packs.
template <typename T>
bool rows_fit_packs(int64_t dim, std::initializer_list<const void*> rows) {
  if (dim * static_cast<int64_t>(sizeof(T)) % 16 != 0) return false;
  for (const void* row : rows) {
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0) return false;
  }
  return true;
}

// One block per row: threads stride over the row's packs, each read once and written to every slot.
template <typename T, typename Acc, int Width>
__global__ void scatter_rows_kernel(const T* __restrict__ x, T* __restrict__ sorted,
                                    const int64_t* __restrict__ positions, const Acc* __restrict__ weights,
                                    int64_t top_k, int64_t dim, int64_t row_begin) {
  using Row = Pack<T, Width>;
  const int64_t r = row_begin + blockIdx.x;
  const Row* from = reinterpret_cast<const Row*>(x + r * dim);
  for (int64_t p = threadIdx.x; p < dim / Width; p += blockDim.x) {
    const Row in = from[p];
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t position = positions[r * top_k + j];
      if (position < 0) continue;
      Row out = in;
      if (weights != nullptr) {
        const Acc w = weights[r * top_k + j];
        for (int i = 0; i < Width; ++i) out.v[i] = store_as<T>(w * static_cast<Acc>(load(in.v[i])));
      }
      reinterpret_cast<Row*>(sorted + position * dim)[p] = out;
    }
  }
}

// One block per row: threads stride over the row's packs, summing the slots' weighted packs in slot order.
template <typename T, typename Acc, int Width>
__global__ void gather_sum_rows_kernel(const T* __restrict__ sorted, T* __restrict__ y,
                                       const int64_t* __restrict__ positions, const Acc* __restrict__ weights,
                                       int64_t top_k, int64_t dim, int64_t row_begin) {
  using Row = Pack<T, Width>;
  const int64_t r = row_begin + blockIdx.x;
  for (int64_t p = threadIdx.x; p < dim / Width; p += blockDim.x) {
    Acc sum[Width];
    for (int i = 0; i < Width; ++i) sum[i] = 0;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t position = positions[r * top_k + j];
      if (position == kInvalidSlot) {
        for (int i = 0; i < Width; ++i) sum[i] = Acc(NAN);
      }
      if (position < 0) continue;
      const Acc w = weights == nullptr ? Acc(1) : weights[r * top_k + j];
      const Row in = reinterpret_cast<const Row*>(sorted + position * dim)[p];
      for (int i = 0; i < Width; ++i) sum[i] += w * static_cast<Acc>(load(in.v[i]));
    }
    Row out;
    for (int i = 0; i < Width; ++i) out.v[i] = store_as<T>(sum[i]);
    reinterpret_cast<Row*>(y + r * dim)[p] = out;
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
  if (launch.end == launch.begin) return;
  const auto stream = static_cast<cudaStream_t>(launch.stream);
  const int64_t slots = args.rows * args.top_k;
  const int64_t blocks = (slots + kSortBlockSlots - 1) / kSortBlockSlots;
  if (blocks > 0) {
    TDX_LAUNCH(blocks, kSortBlockSlots, stream, rank_slots_kernel)(args.experts, slots, args.num_experts,
                                                                  args.positions, args.scratch);
    check_launch("moe sort_slots (ranks)");
  }
  TDX_LAUNCH(args.num_experts, kMoeThreads, stream, block_offsets_kernel)(
      blocks, args.num_experts, args.capacity, args.starts, args.ends, args.scratch, args.segment_ends);
  check_launch("moe sort_slots (offsets)");
  if (blocks > 0) {
    TDX_LAUNCH(blocks, kSortBlockSlots, stream, place_slots_kernel)(args.experts, slots, args.num_experts,
                                                                   args.capacity, args.ends, args.scratch,
                                                                   args.positions);
    check_launch("moe sort_slots (positions)");
  }
  TDX_LAUNCH(args.num_experts * kZeroBlocks, kMoeThreads, stream, zero_padding_kernel)(
      blocks, args.num_experts, args.capacity, args.starts, args.ends, args.scratch,
      static_cast<char*>(args.sorted), args.row_bytes);
  check_launch("moe sort_slots (padding)");
}

// The kernel templates of the row moves (Kernel::of<T, Acc, Width>()): each takes (from, to, positions,
// weights, top_k, dim, row_begin).
struct ScatterRows {
  template <typename T, typename Acc, int Width>
  static auto of() { return &scatter_rows_kernel<T, Acc, Width>; }
};
struct GatherSumRows {
  template <typename T, typename Acc, int Width>
  static auto of() { return &gather_sum_rows_kernel<T, Acc, Width>; }
};

// Launches Kernel over one block per work item, moving rows of `from` to rows of `to`: in 16-byte packs where
// the rows' size and both buffers allow, else element by element.
template <typename Kernel>
void move_rows(const SlotRows& s, const void* from, void* to, const Launch& launch, const char* name) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(s.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    const auto run = [&](auto kernel, int64_t width) {
      TDX_LAUNCH(blocks, row_threads(s.dim / width), static_cast<cudaStream_t>(launch.stream), kernel)(
          static_cast<const T*>(from), static_cast<T*>(to), s.positions, static_cast<const Acc*>(s.weights), s.top_k,
          s.dim, launch.begin);
    };
    if (rows_fit_packs<T>(s.dim, {from, to})) {
      run(Kernel::template of<T, Acc, kVectorWidth<T>>(), kVectorWidth<T>);
    } else {
      run(Kernel::template of<T, Acc, 1>(), 1);
    }
  });
  check_launch(name);
}

void scatter_rows(const ScatterRowsArgs& args, const Launch& launch) {
  move_rows<ScatterRows>(args.slots, args.x, args.sorted, launch, "moe scatter_rows");
}

void gather_sum_rows(const GatherSumRowsArgs& args, const Launch& launch) {
  move_rows<GatherSumRows>(args.slots, args.sorted, args.y, launch, "moe gather_sum_rows");
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
