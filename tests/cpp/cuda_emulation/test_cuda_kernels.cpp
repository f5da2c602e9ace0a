// The CUDA kernels (csrc/kernels/cuda), compiled by the host compiler against
// the CPU stand-in of the CUDA runtime in this folder and run here, through
// the same checks as the CPU kernels (kernel_checks.h: a direct double-precision
// computation within the bounds of error_bounds.h), with the CUDA kernels' own
// summation paths. This checks the kernels' indexing, reductions and barriers
// without a GPU; it does not check what only a GPU shows (the memory model,
// speed). The stand-in runs them without FMA contraction; the bounds also hold
// with it, as on a GPU.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_checks.h"
// The kernels under test, as one translation unit with this test.
#include "kernels/cuda/attention.cu"
#include "kernels/cuda/cross_entropy.cu"
#include "kernels/cuda/fp8.cu"
#include "kernels/cuda/moe.cu"

using tdx::kernels::AttentionKernels;
using tdx::kernels::CrossEntropyKernels;
using tdx::kernels::Fp8Kernels;
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
  // Features: one, under a warp, past a block of threads.
  tdx::test::for_each_type_and_size({1, 7, 300}, [](auto acc, ElementType type, int64_t dim) {
    tdx::test::check_moe_permutation<decltype(acc)>(MoeKernels::cuda(), type, dim);
  });
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
