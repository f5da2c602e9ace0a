// The CUDA kernels (csrc/kernels/cuda), compiled by the host compiler against
// the CPU stand-in of the CUDA runtime in this folder and run here, through
// the same checks as the CPU kernels (kernel_checks.h: a direct double-precision
// computation within the bounds of error_bounds.h), with the CUDA kernels' own
// summation paths. This checks the kernels' indexing, reductions and barriers
// without a GPU; it does not check what only a GPU shows (the memory model,
// speed). The stand-in runs them without FMA contraction; the bounds also hold
// with it, as on a GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernel_checks.h"
// The kernels under test, as one translation unit with this test.
#include "kernels/cuda/attention.cu"
#include "kernels/cuda/cross_entropy.cu"
#include "kernels/cuda/fp8.cu"
#include "kernels/cuda/init.cu"
#include "kernels/cuda/moe.cu"

using tdx::kernels::AttentionKernels;
using tdx::kernels::CrossEntropyKernels;
using tdx::kernels::Fp8Kernels;
using tdx::kernels::InitKernels;
using tdx::kernels::MoeKernels;
using tdx::kernels::ElementType;
namespace gpu = tdx::kernels::cuda;

namespace {

// A term's path through stats_kernel (kernels/cuda/cross_entropy.cu): each of a
// thread's ceil(n / 256) columns may rescale its running sum, then 5 warp-shuffle
// merges and up to 7 merges of the warps' results, each an add and a rescale.
tdx::test::SumexpPath cuda_sumexp_path(int64_t n) {
  const double per_thread = std::ceil(n / 256.0);
  return {per_thread + 12, per_thread + 12};
}

}  // namespace

TEST(CudaEmulation, RunsEveryThreadOfEveryBlockAndReducesThroughShufflesAndSharedMemory) {
  // Each block sums its thread indices the way the kernels reduce: shuffles in a warp, then shared memory.
  struct Kernel {
    static void sum_indices(int64_t* out) {
      int64_t value = threadIdx.x;
      for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
      __shared__ int64_t warp_sums[32];
      if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
      __syncthreads();
      if (threadIdx.x == 0) {
        int64_t total = 0;
        for (unsigned int w = 0; w < blockDim.x / 32; ++w) total += warp_sums[w];
        out[blockIdx.x] = total + 1000 * blockIdx.x;
      }
    }
  };
  std::vector<int64_t> out(5, -1);
  TDX_LAUNCH(5, 128, nullptr, Kernel::sum_indices)(out.data());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  for (int64_t b = 0; b < 5; ++b) EXPECT_EQ(out[b], 127 * 128 / 2 + 1000 * b);
}

TEST(CudaEmulation, RejectsAnInvalidLaunchLikeTheRuntime) {
  struct Kernel {
    static void touch(int* out) { *out = 1; }
  };
  int out = 0;
  TDX_LAUNCH(1, 2048, nullptr, Kernel::touch)(&out);  // over 1024 threads per block
  EXPECT_THROW(gpu::check_launch("touch"), std::runtime_error);
  TDX_LAUNCH(0, 32, nullptr, Kernel::touch)(&out);  // an empty grid
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // reading the error clears it
  EXPECT_EQ(out, 0);
}

TEST(CudaCrossEntropyStats, MatchDirectComputationInEveryElementTypeAndRowLength) {
  tdx::test::for_each_type_and_size(tdx::test::kVocabSizes, [](auto acc, ElementType type, int64_t vocab) {
    tdx::test::check_shard_stats<decltype(acc)>(CrossEntropyKernels::cuda(), &cuda_sumexp_path, type, vocab);
  });
}

TEST(CudaCrossEntropyStats, NoRowsLaunchesNothing) {
  const tdx::kernels::ShardStatsArgs args{{ElementType::kFloat32, 0, 128, 0}, nullptr, nullptr, nullptr};
  CrossEntropyKernels::cuda().shard_stats(args, tdx::kernels::Launch{0, 0, nullptr});
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaCrossEntropyGrad, IsSoftmaxMinusOneHotTimesUpstreamInEveryElementTypeInAndOutOfPlace) {
  tdx::test::for_each_type_and_size(tdx::test::kVocabSizes, [](auto acc, ElementType type, int64_t vocab) {
    tdx::test::check_shard_grad<decltype(acc)>(CrossEntropyKernels::cuda(), type, vocab);
  });
}

TEST(CudaLseMerge, SequencesOfMergesStayWithinTheirBoundForEveryBlockTypeAndStride) {
  // Features: none, one, under a warp, not a multiple of the warp, one block of threads, several per thread.
  tdx::test::for_each_type_and_size({0, 1, 33, 64, 256, 300}, [](auto acc, ElementType type, int64_t dim) {
    tdx::test::check_lse_merges<decltype(acc)>(AttentionKernels::cuda(), type, dim);
  });
}

TEST(CudaMoePermutation, SortsSlotsExpertMajorAndMovesRowsBothWaysInEveryElementType) {
  // Features: one, under a warp, 16-byte packs of every type, past a block of threads (packs of 32-
  // and 64-bit types, elements of 16-bit ones).
  tdx::test::for_each_type_and_size({1, 7, 16, 300}, [](auto acc, ElementType type, int64_t dim) {
    tdx::test::check_moe_permutation<decltype(acc)>(MoeKernels::cuda(), type, dim);
  });
}

TEST(CudaMoePermutation, SortsMoreBlocksOfSlotsThanASortBlockHasThreads) {
  // 260 blocks of 256 slots: each thread of the offsets kernel takes a run of two blocks.
  constexpr int64_t rows = 260 * 128, top_k = 2, experts = 7;
  std::mt19937 gen(5);
  std::uniform_int_distribution<int64_t> pick(-1, experts - 1);
  std::vector<int64_t> ids(rows * top_k);
  for (auto& id : ids) id = pick(gen);
  for (const int64_t capacity : {int64_t{-1}, int64_t{rows / 5}}) {
    std::vector<int64_t> counts(experts, 0), starts(experts, 0), ends(experts, 0);
    for (const int64_t id : ids) {
      if (id >= 0) ++counts[id];
    }
    for (int64_t e = 0; e < experts; ++e) {  // dropless: expert 2's segment 3 rows longer than its slots
      ends[e] = starts[e] + counts[e] + (e == 2 ? 3 : 0);
      if (e + 1 < experts) starts[e + 1] = ends[e];
    }
    const int64_t sorted_rows = capacity >= 0 ? experts * capacity : ends[experts - 1];
    std::vector<int64_t> want(ids.size(), -1), taken(experts, 0);  // slot order within each expert's segment
    std::vector<float> want_sorted(sorted_rows, 0.0f);
    for (size_t slot = 0; slot < ids.size(); ++slot) {
      const int64_t e = ids[slot];
      if (e < 0) continue;
      const int64_t first = capacity >= 0 ? e * capacity : starts[e], end = capacity >= 0 ? first + capacity : ends[e];
      const int64_t position = first + taken[e]++;
      if (position < end) want[slot] = position, want_sorted[position] = 9.0f;
    }
    std::vector<int64_t> got(ids.size(), -7), scratch(tdx::kernels::sort_scratch_size(ids.size(), experts), -7);
    std::vector<float> sorted(sorted_rows, 9.0f);  // rows no slot fills are zeroed
    std::vector<int32_t> segment_ends(experts, -7), want_ends(experts);
    for (int64_t e = 0; e < experts; ++e) want_ends[e] = static_cast<int32_t>(capacity >= 0 ? (e + 1) * capacity : ends[e]);
    MoeKernels::cuda().sort_slots({ids.data(), rows, top_k, experts, capacity, starts.data(), ends.data(), got.data(),
                                   sorted.data(), 4, scratch.data(), segment_ends.data()},
                                  tdx::kernels::Launch{0, experts, nullptr});
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(got, want) << "capacity " << capacity;
    EXPECT_EQ(sorted, want_sorted) << "capacity " << capacity;
    EXPECT_EQ(segment_ends, want_ends) << "capacity " << capacity;
  }
}

TEST(CudaMoePermutation, MovesRowsElementByElementFromAnAddressOff16Bytes) {
  // Rows of 8 floats (32 bytes) would move in 16-byte packs; starting 4 bytes past an aligned address, the
  // kernels take the element-by-element path and still move every row.
  constexpr int64_t rows = 3, top_k = 2, dim = 8;
  const std::vector<int64_t> positions = {4, -1, 0, 2, 1, 3};
  const std::vector<float> weights = {0.5f, 9.0f, 2.0f, 1.0f, -1.0f, 4.0f};
  alignas(16) float x_storage[rows * dim + 1], sorted_storage[5 * dim + 1], y_storage[rows * dim + 1];
  float *x = x_storage + 1, *sorted = sorted_storage + 1, *y = y_storage + 1;
  for (int64_t i = 0; i < rows * dim; ++i) x[i] = static_cast<float>(i) - 7.0f;
  std::fill(sorted, sorted + 5 * dim, 0.0f);
  const tdx::kernels::SlotRows plain{ElementType::kFloat32, rows, top_k, dim, positions.data(), nullptr};
  const tdx::kernels::SlotRows weighted{ElementType::kFloat32, rows, top_k, dim, positions.data(), weights.data()};
  MoeKernels::cuda().scatter_rows({plain, x, sorted}, tdx::kernels::Launch{0, rows, nullptr});
  MoeKernels::cuda().gather_sum_rows({weighted, sorted, y}, tdx::kernels::Launch{0, rows, nullptr});
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  for (int64_t slot = 0; slot < rows * top_k; ++slot) {
    if (positions[slot] < 0) continue;
    for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(sorted[positions[slot] * dim + d], x[(slot / top_k) * dim + d]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float w = 0;
    for (int64_t j = 0; j < top_k; ++j) w += positions[r * top_k + j] >= 0 ? weights[r * top_k + j] : 0.0f;
    for (int64_t d = 0; d < dim; ++d) EXPECT_FLOAT_EQ(y[r * dim + d], w * x[r * dim + d]) << r << ", " << d;
  }
}

TEST(CudaMoeExchange, RoutesPacksAndSumsTheExchangedRowsInEveryElementType) {
  tdx::test::for_each_type_and_size({1, 7, 300}, [](auto acc, ElementType type, int64_t dim) {
    tdx::test::check_moe_exchange<decltype(acc)>(MoeKernels::cuda(), type, dim);
  });
}

TEST(CudaFp8Cast, RoundsToTheNearestFp8ValueAndFindsTheAmaxOfEveryChunk) {
  for (const auto type : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
    tdx::test::check_fp8_cast_amax(Fp8Kernels::cuda(), type);
  }
}

TEST(CudaFp8Cast, CastsAMatrixInBothLayoutsAndFindsTheAmaxOfEveryTile) {
  for (const auto type : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
    tdx::test::check_fp8_cast_transpose_amax(Fp8Kernels::cuda(), type);
  }
}

TEST(CudaFp8Cast, CastsEachBlockWithTheScaleOfItsOwnAmax) {
  for (const auto type : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
    tdx::test::check_fp8_cast_blockwise(Fp8Kernels::cuda(), type);
  }
}

TEST(CudaTruncNormal, FillsEachBlockWithTheWholeTensorsValuesInEveryElementType) {
  for (const auto type : tdx::test::kAllTypes) tdx::test::check_trunc_normal(InitKernels::cuda(), type);
}
