// CPU kernel of attention's log-sum-exp merge against a direct double-precision computation.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"

using tdx::kernels::ElementType;
namespace cpu = tdx::kernels::cpu;

namespace {

// Softmax attention of one query row over `scores` / `values` (the reference for a merge).
void attend(const std::vector<double>& scores, const std::vector<std::vector<double>>& values, double& lse,
            std::vector<double>& out) {
  double max = -INFINITY;
  for (double s : scores) max = std::max(max, s);
  double sum = 0;
  for (double s : scores) sum += std::exp(s - max);
  lse = max + std::log(sum);
  out.assign(values[0].size(), 0.0);
  for (size_t j = 0; j < scores.size(); ++j) {
    for (size_t d = 0; d < out.size(); ++d) out[d] += std::exp(scores[j] - lse) * values[j][d];
  }
}

}  // namespace

TEST(LseMerge, TwoHalvesOfTheKeysMergeIntoAttentionOverAll) {
  constexpr int kRows = 3, kDim = 5, kKeys = 8;
  std::mt19937 gen(3);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<float> acc_out(kRows * kDim), block_out(kRows * kDim);
  std::vector<float> acc_lse(kRows), block_lse(kRows);
  std::vector<std::vector<double>> expected(kRows);
  for (int i = 0; i < kRows; ++i) {
    std::vector<double> scores(kKeys);
    std::vector<std::vector<double>> values(kKeys, std::vector<double>(kDim));
    for (auto& s : scores) s = normal(gen);
    for (auto& v : values)
      for (auto& x : v) x = normal(gen);
    double lse_all, lse_a, lse_b;
    std::vector<double> out_a, out_b;
    attend(scores, values, lse_all, expected[i]);
    attend({scores.begin(), scores.begin() + 3}, {values.begin(), values.begin() + 3}, lse_a, out_a);
    attend({scores.begin() + 3, scores.end()}, {values.begin() + 3, values.end()}, lse_b, out_b);
    acc_lse[i] = lse_a;
    block_lse[i] = lse_b;
    for (int d = 0; d < kDim; ++d) {
      acc_out[i * kDim + d] = out_a[d];
      block_out[i * kDim + d] = out_b[d];
    }
    expected[i].push_back(lse_all);
  }
  cpu::lse_merge<float>(ElementType::kFloat32, acc_out.data(), kRows * kDim, acc_lse.data(), kRows, block_out.data(),
                        kRows * kDim, block_lse.data(), kRows, 0, 1, kRows, kDim);
  for (int i = 0; i < kRows; ++i) {
    for (int d = 0; d < kDim; ++d) EXPECT_NEAR(acc_out[i * kDim + d], expected[i][d], 1e-5) << i << "," << d;
    EXPECT_NEAR(acc_lse[i], expected[i][kDim], 1e-5) << i;
  }
}

TEST(LseMerge, EmptyAccumulatorTakesTheBlockAndEmptyBlockChangesNothing) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> out = {9.0f, 9.0f, 1.0f, 2.0f};  // row 0: empty accumulator, row 1: holds (1, 2)
  std::vector<float> lse = {-inf, 0.5f};
  std::vector<tdx::kernels::BFloat16> block = {tdx::kernels::to_bfloat16(3.0f), tdx::kernels::to_bfloat16(4.0f),
                                               tdx::kernels::to_bfloat16(7.0f), tdx::kernels::to_bfloat16(8.0f)};
  std::vector<float> block_lse = {1.25f, -inf};
  cpu::lse_merge<float>(ElementType::kBFloat16, out.data(), 4, lse.data(), 2, block.data(), 4, block_lse.data(), 2,
                        0, 1, 2, 2);
  EXPECT_EQ(out, (std::vector<float>{3.0f, 4.0f, 1.0f, 2.0f}));
  EXPECT_EQ(lse, (std::vector<float>{1.25f, 0.5f}));
}

TEST(LseMerge, OuterStridesSelectASliceOfRows) {
  // Two groups of 4 rows in the accumulator; merge a 2-row block into rows 2..3 of each group.
  std::vector<double> out(2 * 4, 1.0), lse(2 * 4, 0.0);
  std::vector<double> block = {5.0, 5.0, 5.0, 5.0}, block_lse(4, 0.0);  // equal weights: the mean
  cpu::lse_merge<double>(ElementType::kFloat64, out.data() + 2, 4, lse.data() + 2, 4, block.data(), 2,
                         block_lse.data(), 2, 0, 2, 2, 1);
  EXPECT_EQ(out, (std::vector<double>{1, 1, 3, 3, 1, 1, 3, 3}));
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(lse[g * 4], 0.0);
    EXPECT_NEAR(lse[g * 4 + 2], std::log(2.0), 1e-15);
  }
}
