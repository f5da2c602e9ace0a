// The CUDA kernels (csrc/kernels/cuda), compiled by the host compiler against
// the CPU stand-in of the CUDA runtime in this folder and run here, against the
// CPU kernels (themselves tested against direct computations in tests/cpp):
// every element type, row lengths around the block and warp sizes, targets in
// and out of the shard, ignored and masked rows, in-place gradients, strided
// merges. This checks the kernels' indexing, reductions and barriers without a
// GPU; it does not check what only a GPU shows (the memory model, speed).

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
// The kernels under test, as one translation unit with this test.
#include "kernels/cuda/attention.cu"
#include "kernels/cuda/cross_entropy.cu"

using tdx::kernels::ElementType;
namespace cpu = tdx::kernels::cpu;
namespace gpu = tdx::kernels::cuda;

namespace {

constexpr ElementType kAllTypes[] = {ElementType::kFloat32, ElementType::kFloat64, ElementType::kBFloat16,
                                     ElementType::kFloat16};

const char* name(ElementType type) {
  switch (type) {
    case ElementType::kFloat32: return "fp32";
    case ElementType::kFloat64: return "fp64";
    case ElementType::kBFloat16: return "bf16";
    case ElementType::kFloat16: return "fp16";
  }
  return "?";
}

// Values stored in one element type, readable back as double.
class Elements {
 public:
  Elements(ElementType type, const std::vector<double>& values) : type_(type), bytes_(values.size() * size()) {
    for (size_t i = 0; i < values.size(); ++i) set(i, values[i]);
  }

  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  size_t count() const { return bytes_.size() / size(); }
  bool operator==(const Elements& other) const { return bytes_ == other.bytes_; }

  double get(size_t i) const {
    switch (type_) {
      case ElementType::kFloat32: return as<float>()[i];
      case ElementType::kFloat64: return as<double>()[i];
      case ElementType::kBFloat16: return tdx::kernels::load(as<tdx::kernels::BFloat16>()[i]);
      case ElementType::kFloat16: return tdx::kernels::load(as<tdx::kernels::Float16>()[i]);
    }
    return NAN;
  }

 private:
  size_t size() const { return type_ == ElementType::kFloat64 ? 8 : type_ == ElementType::kFloat32 ? 4 : 2; }

  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(bytes_.data());
  }

  void set(size_t i, double v) {
    void* p = bytes_.data() + i * size();
    switch (type_) {
      case ElementType::kFloat32: *static_cast<float*>(p) = static_cast<float>(v); break;
      case ElementType::kFloat64: *static_cast<double*>(p) = v; break;
      case ElementType::kBFloat16:
        *static_cast<tdx::kernels::BFloat16*>(p) = tdx::kernels::to_bfloat16(static_cast<float>(v));
        break;
      case ElementType::kFloat16:
        *static_cast<tdx::kernels::Float16*>(p) = tdx::kernels::to_float16(static_cast<float>(v));
        break;
    }
  }

  ElementType type_;
  std::vector<unsigned char> bytes_;
};

// Relative tolerance between two implementations that both accumulate in Acc
// (summation order and exp differ), and of rounding once more to the element type.
template <typename Acc>
constexpr double kAccTolerance = std::is_same_v<Acc, double> ? 1e-12 : 2e-6;

double rounding_tolerance(ElementType type) {
  switch (type) {
    case ElementType::kBFloat16: return std::ldexp(1.0, -7);  // one unit in the last place, relative
    case ElementType::kFloat16: return std::ldexp(1.0, -10);
    default: return 0.0;
  }
}

// Equal as floating-point values within `relative`: NaN matches NaN, an infinity only itself.
::testing::AssertionResult close(double actual, double expected, double relative) {
  if (std::isnan(expected) ? std::isnan(actual)
                           : (std::isinf(expected) ? actual == expected
                                                   : std::abs(actual - expected) <=
                                                         relative * std::abs(expected) + 1e-30)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << actual << " vs " << expected << " (relative tolerance " << relative
                                       << ")";
}

std::vector<double> normal_values(size_t n, double stddev, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<double> values(n);
  for (double& v : values) v = normal(gen);
  return values;
}

// Logits of one vocab shard: rows of random values with, past row 3, a fully
// masked row (-inf), a row masked but for its last column, a row with a NaN,
// and a row that rises along the vocabulary (every column raises the maximum).
struct Shard {
  static constexpr int64_t kRows = 8;
  int64_t vocab_local;
  int64_t vocab_start;
  std::vector<double> logits;
  std::vector<int64_t> target;

  explicit Shard(int64_t vocab)
      : vocab_local(vocab), vocab_start(3 * vocab), logits(normal_values(kRows * vocab, 3.0, 7)) {
    double* masked = &logits[4 * vocab];
    double* masked_but_last = &logits[5 * vocab];
    for (int64_t v = 0; v < vocab; ++v) masked[v] = -INFINITY;
    for (int64_t v = 0; v + 1 < vocab; ++v) masked_but_last[v] = -INFINITY;
    logits[6 * vocab + vocab / 2] = NAN;
    for (int64_t v = 0; v < vocab; ++v) logits[7 * vocab + v] = 0.01 * v;
    const int64_t last = vocab_start + vocab - 1;
    // In the shard, at its first and last column, in another shard, ignored (the masked row too).
    target = {vocab_start + vocab / 3, vocab_start, last, 1, -100, last, -100, vocab_start + vocab / 2};
  }
};

// Row lengths: one element, under a warp, not a multiple of the warp, the block
// size and one past it, several elements per thread.
const std::vector<int64_t> kVocabSizes = {1, 31, 100, 256, 257, 3001};

// check(Acc{}, type, size) for every element type and size, with the kernels' accumulator type.
template <typename Check>
void for_each_type_and_size(const std::vector<int64_t>& sizes, Check check) {
  for (const int64_t size : sizes) {
    for (const ElementType type : kAllTypes) {
      if (type == ElementType::kFloat64) {
        check(double{}, type, size);
      } else {
        check(float{}, type, size);
      }
    }
  }
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

template <typename Acc>
void expect_stats_match_cpu(ElementType type, int64_t vocab) {
  SCOPED_TRACE(std::string(name(type)) + ", vocab_local " + std::to_string(vocab));
  const Shard shard(vocab);
  const Elements logits(type, shard.logits);
  const int64_t rows = Shard::kRows;
  std::vector<Acc> max(rows), sumexp(rows), target_logit(rows);
  std::vector<Acc> cpu_max(rows), cpu_sumexp(rows), cpu_target_logit(rows);
  gpu::vocab_shard_stats<Acc>(type, logits.data(), shard.target.data(), rows, vocab, shard.vocab_start, max.data(),
                              sumexp.data(), target_logit.data(), nullptr);
  cpu::vocab_shard_stats<Acc>(type, logits.data(), shard.target.data(), 0, rows, vocab, shard.vocab_start,
                              cpu_max.data(), cpu_sumexp.data(), cpu_target_logit.data());
  for (int64_t r = 0; r < rows; ++r) {
    // A NaN logit may or may not become a row's maximum, depending on the order of comparisons.
    if (r != 6) {
      EXPECT_TRUE(close(max[r], cpu_max[r], 0.0)) << "max, row " << r;
    }
    EXPECT_TRUE(close(sumexp[r], cpu_sumexp[r], kAccTolerance<Acc>)) << "sumexp, row " << r;
    EXPECT_TRUE(close(target_logit[r], cpu_target_logit[r], 0.0)) << "target logit, row " << r;
  }
  EXPECT_EQ(max[4], -INFINITY);  // fully masked: the sum is 0, the row's lse -inf
  EXPECT_EQ(sumexp[4], 0);
  EXPECT_EQ(sumexp[5], 1);  // one finite logit
  EXPECT_TRUE(std::isnan(sumexp[6])) << "a NaN logit reaches the sum";
}

TEST(CudaCrossEntropyStats, MatchesTheCpuKernelInEveryElementType) {
  for_each_type_and_size(kVocabSizes, [](auto acc, ElementType type, int64_t vocab) {
    expect_stats_match_cpu<decltype(acc)>(type, vocab);
  });
}

TEST(CudaCrossEntropyStats, NoRowsLaunchesNothing) {
  gpu::vocab_shard_stats<float>(ElementType::kFloat32, nullptr, nullptr, 0, 128, 0, nullptr, nullptr, nullptr,
                                nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

template <typename Acc>
void expect_grad_matches_cpu(ElementType type, int64_t vocab) {
  SCOPED_TRACE(std::string(name(type)) + ", vocab_local " + std::to_string(vocab));
  const Shard shard(vocab);
  const int64_t rows = Shard::kRows;
  const Elements logits(type, shard.logits);
  std::vector<double> upstream_values(rows);
  for (int64_t r = 0; r < rows; ++r) upstream_values[r] = 0.25 * (r + 1);
  const Elements upstream(type, upstream_values);
  // The lse the forward computes, from the CPU kernel's statistics.
  std::vector<Acc> max(rows), sumexp(rows), target_logit(rows), lse(rows);
  cpu::vocab_shard_stats<Acc>(type, logits.data(), shard.target.data(), 0, rows, vocab, shard.vocab_start,
                              max.data(), sumexp.data(), target_logit.data());
  for (int64_t r = 0; r < rows; ++r) lse[r] = max[r] + std::log(sumexp[r]);

  const std::vector<double> zeros(logits.count(), 0.0);
  Elements grad(type, zeros), cpu_grad(type, zeros);
  gpu::vocab_shard_grad<Acc>(type, upstream.data(), logits.data(), shard.target.data(), lse.data(), rows, vocab,
                             shard.vocab_start, -100, grad.data(), nullptr);
  cpu::vocab_shard_grad<Acc>(type, upstream.data(), logits.data(), shard.target.data(), lse.data(), 0, rows, vocab,
                             shard.vocab_start, -100, cpu_grad.data());
  // Both round the same Acc value to the element type: at most one rounding step apart.
  const double tolerance = 4 * kAccTolerance<Acc> + rounding_tolerance(type);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < vocab; ++v) {
      const size_t i = r * vocab + v;
      EXPECT_TRUE(close(grad.get(i), cpu_grad.get(i), tolerance)) << "row " << r << ", column " << v;
      if (shard.target[r] == -100) {
        EXPECT_EQ(grad.get(i), 0.0) << "ignored row " << r << ", column " << v;
      }
    }
  }

  Elements in_place = logits;
  gpu::vocab_shard_grad<Acc>(type, upstream.data(), in_place.data(), shard.target.data(), lse.data(), rows, vocab,
                             shard.vocab_start, -100, in_place.data(), nullptr);
  EXPECT_TRUE(in_place == grad) << "in place differs from out of place";
}

TEST(CudaCrossEntropyGrad, MatchesTheCpuKernelInEveryElementTypeInAndOutOfPlace) {
  for_each_type_and_size(kVocabSizes, [](auto acc, ElementType type, int64_t vocab) {
    expect_grad_matches_cpu<decltype(acc)>(type, vocab);
  });
}

// Three partial results merged one after another into an empty accumulator
// (lse -inf), by both kernels: `outer` groups of `rows` query rows of `dim`
// features, the accumulator and the blocks with padding between groups, some
// block rows without visible keys (lse -inf).
template <typename Acc>
void expect_merges_match_cpu(ElementType block_type, int64_t dim) {
  SCOPED_TRACE(std::string(name(block_type)) + ", dim " + std::to_string(dim));
  constexpr int64_t outer = 3, rows = 4, padding = 5;
  const int64_t out_stride = rows * dim + padding, lse_stride = rows + 1;
  std::vector<Acc> out(outer * out_stride, Acc(0)), lse(outer * lse_stride, -INFINITY);
  for (int64_t g = 0; g < outer; ++g) {
    for (int64_t p = 0; p < padding; ++p) out[g * out_stride + rows * dim + p] = Acc(99);
  }
  std::vector<Acc> cpu_out = out, cpu_lse = lse;
  for (unsigned block = 0; block < 3; ++block) {
    const Elements block_out(block_type, normal_values(outer * out_stride, 1.0, 10 + block));
    std::vector<Acc> block_lse(outer * lse_stride);
    const std::vector<double> lse_values = normal_values(block_lse.size(), 2.0, 20 + block);
    for (size_t i = 0; i < block_lse.size(); ++i) {
      block_lse[i] = (i + block) % 3 == 0 ? -INFINITY : static_cast<Acc>(lse_values[i]);
    }
    gpu::lse_merge<Acc>(block_type, out.data(), out_stride, lse.data(), lse_stride, block_out.data(), out_stride,
                        block_lse.data(), lse_stride, outer, rows, dim, nullptr);
    cpu::lse_merge<Acc>(block_type, cpu_out.data(), out_stride, cpu_lse.data(), lse_stride, block_out.data(),
                        out_stride, block_lse.data(), lse_stride, 0, outer, rows, dim);
  }
  for (size_t i = 0; i < out.size(); ++i) EXPECT_TRUE(close(out[i], cpu_out[i], kAccTolerance<Acc>)) << "out " << i;
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_TRUE(close(lse[i], cpu_lse[i], kAccTolerance<Acc>)) << "lse " << i;
  for (int64_t g = 0; g < outer; ++g) {
    for (int64_t p = 0; p < padding; ++p) EXPECT_EQ(out[g * out_stride + rows * dim + p], Acc(99)) << "padding";
  }
}

TEST(CudaLseMerge, MatchesTheCpuKernelForEveryBlockTypeAndStride) {
  // Features: one, under a warp, not a multiple of the warp, one block of threads, several per thread.
  for_each_type_and_size({1, 33, 64, 256, 300}, [](auto acc, ElementType type, int64_t dim) {
    expect_merges_match_cpu<decltype(acc)>(type, dim);
  });
}
