// CPU kernels of the vocab-parallel cross-entropy, every ISA clone, against a
// direct double-precision computation within the bounds of error_bounds.h:
// the checks every implementation passes (kernel_checks.h), and the CPU
// kernels' own blocks (rows past 2048 columns, rescaled online) and vector exp.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cpu_isa_test.h"
#include "error_bounds.h"
#include "kernel_checks.h"
#include "kernels/cpu/isa_clones.h"
#include "kernels/cpu/vector_exp.h"
#include "kernels/cross_entropy.h"

using tdx::kernels::BFloat16;
using tdx::kernels::CrossEntropyKernels;
using tdx::kernels::ElementType;
using tdx::kernels::Launch;
using tdx::kernels::ShardStatsArgs;
using tdx::kernels::VocabShard;

namespace {

// The CPU kernels' summation path for a row of n logits (kernels/cpu/cross_entropy.cpp):
// 16 lanes over blocks of 2048, the lanes summed in turn, one rescale and add per block.
tdx::test::SumexpPath cpu_sumexp_path(int64_t n) {
  const double blocks = std::ceil(n / 2048.0);
  const double per_lane = std::ceil(std::min<int64_t>(n, 2048) / 16.0);
  return {per_lane + 15 + 16 + 2 * blocks, blocks};
}

class VocabShardStats : public tdx::test::CpuIsaTest {
 protected:
  // stats [3, rows] of the logits, rows [begin, end) written by one kernel call.
  template <typename Acc>
  void stats(ElementType type, const void* logits, const int64_t* target, int64_t rows, int64_t vocab_local,
             int64_t vocab_start, std::vector<Acc>& out, int64_t begin, int64_t end) const {
    const ShardStatsArgs args{{type, rows, vocab_local, vocab_start}, logits, target, out.data()};
    CrossEntropyKernels::cpu(isa()).shard_stats(args, Launch{begin, end, nullptr});
  }
};
TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(VocabShardStats);

TEST_P(VocabShardStats, MatchDirectComputationInEveryElementTypeAndRowLength) {
  tdx::test::for_each_type_and_size(tdx::test::kVocabSizes, [&](auto acc, ElementType type, int64_t vocab) {
    tdx::test::check_shard_stats<decltype(acc)>(CrossEntropyKernels::cpu(isa()), &cpu_sumexp_path, type, vocab);
  });
}

// Rows longer than the kernels' 2048-element block, with logits that rise
// along the row so that every block raises the running maximum and the sum
// must be rescaled online; bf16 inputs are widened block by block.
TEST_P(VocabShardStats, LongRowsRescaleAcrossBlocksInEveryElementType) {
  const int64_t rows = 3, vocab = 5000;
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < vocab; ++v) logits.push_back(normal(gen) + (r == 1 ? -0.004f : 0.004f) * v);
  }
  std::vector<BFloat16> logits_bf16;
  std::vector<float> rounded;
  for (float x : logits) {
    logits_bf16.push_back(tdx::kernels::to_bfloat16(x));
    rounded.push_back(tdx::kernels::load(logits_bf16.back()));
  }
  const std::vector<int64_t> target = {4999, 2048, 0};
  struct Case {
    ElementType type;
    const void* data;
    const std::vector<float>* values;  // as the kernel reads them
  };
  for (const Case& c : {Case{ElementType::kFloat32, logits.data(), &logits},
                        Case{ElementType::kBFloat16, logits_bf16.data(), &rounded}}) {
    std::vector<float> out(3 * rows);
    stats(c.type, c.data, target.data(), rows, vocab, 0, out, 0, rows);
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<double> row(c.values->begin() + r * vocab, c.values->begin() + (r + 1) * vocab);
      EXPECT_EQ(out[r], tdx::test::row_max(row)) << "row " << r;
      EXPECT_NEAR(out[rows + r], tdx::test::row_sumexp(row), tdx::test::sumexp_bound<float>(row, cpu_sumexp_path(vocab)))
          << "row " << r;
      EXPECT_EQ(out[2 * rows + r], row[target[r]]) << "row " << r;
    }
  }
}

// Masked logits (-inf) count for nothing, also when whole blocks of a row are
// masked before its first finite logit; a NaN logit makes the row's sum NaN
// (as F.cross_entropy's loss is), it is never dropped.
TEST_P(VocabShardStats, MaskedLogitsVanishAndNanPropagates) {
  const int64_t vocab = 5000, masked = 4500;  // row 0: columns [0, 4500) masked, past two blocks
  std::vector<float> logits(2 * vocab);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : logits) x = normal(gen);
  for (int64_t v = 0; v < masked; ++v) logits[v] = -INFINITY;
  logits[vocab + 3000] = NAN;
  const std::vector<int64_t> target = {4700, 7};
  std::vector<float> out(6);
  stats(ElementType::kFloat32, logits.data(), target.data(), 2, vocab, 0, out, 0, 2);
  const std::vector<double> row(logits.begin(), logits.begin() + vocab);
  EXPECT_EQ(out[0], tdx::test::row_max(row));
  EXPECT_NEAR(out[2], tdx::test::row_sumexp(row), tdx::test::sumexp_bound<float>(row, cpu_sumexp_path(vocab)));
  EXPECT_TRUE(std::isnan(out[3]));
}

class VocabShardGrad : public tdx::test::CpuIsaTest {};
TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(VocabShardGrad);

TEST_P(VocabShardGrad, IsSoftmaxMinusOneHotTimesUpstreamInEveryElementTypeInAndOutOfPlace) {
  tdx::test::for_each_type_and_size({1, 31, 257, 4500}, [&](auto acc, ElementType type, int64_t vocab) {
    tdx::test::check_shard_grad<decltype(acc)>(CrossEntropyKernels::cpu(isa()), type, vocab);
  });
}

// exp_approx over an array, as a kernel the ISA clones compile (with each ISA's
// vector width and FMA contraction), so that every clone's vector exp is checked.
struct ExpArgs {
  const float* x;
  float* y;
};
struct ExpKernels {
  void (*exp_rows)(const ExpArgs&, const Launch&);
};
void exp_rows(const ExpArgs& args, const Launch& launch) {
  for (int64_t i = launch.begin; i < launch.end; ++i) args.y[i] = tdx::kernels::cpu::exp_approx(args.x[i]);
}

class ExpApprox : public tdx::test::CpuIsaTest {
 protected:
  std::vector<float> exp(const std::vector<float>& x) const {
    std::vector<float> y(x.size());
    tdx::kernels::cpu_kernel_table<ExpKernels, &exp_rows>(isa()).exp_rows(
        ExpArgs{x.data(), y.data()}, Launch{0, static_cast<int64_t>(x.size()), nullptr});
    return y;
  }
};
TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(ExpApprox);

// The accuracy error_bounds.h assumes of the vector exp (kExpLogError = 8 u = 4.8e-7).
TEST_P(ExpApprox, WithinFewUlpOfStdExpAndZeroBelowTheNormalRange) {
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.001953125f) x.push_back(v);
  const std::vector<float> y = exp(x);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double exact = std::exp(static_cast<double>(x[i]));
    worst = std::max(worst, std::abs(y[i] - exact) / exact);
  }
  EXPECT_LT(worst, 4e-7);  // 2^-23 = 1.2e-7 is one float ulp
  const std::vector<float> special = exp({0.0f, -100.0f, -INFINITY, NAN, 1000.0f});
  EXPECT_EQ(special[0], 1.0f);
  EXPECT_EQ(special[1], 0.0f);
  EXPECT_EQ(special[2], 0.0f);
  EXPECT_TRUE(std::isnan(special[3]));
  EXPECT_TRUE(std::isfinite(special[4]));
}

}  // namespace
