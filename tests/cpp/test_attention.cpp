// CPU kernel of attention's log-sum-exp merge, every ISA clone, against a
// direct double-precision computation within the bounds of error_bounds.h.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpu_isa_test.h"
#include "error_bounds.h"
#include "kernel_checks.h"
#include "kernels/attention.h"

using tdx::kernels::AttentionKernels;
using tdx::kernels::BFloat16;
using tdx::kernels::ElementType;
using tdx::kernels::Launch;
using tdx::kernels::LseMergeArgs;
using tdx::kernels::MergeShape;

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

class LseMerge : public tdx::test::CpuIsaTest {
 protected:
  void merge(const MergeShape& shape, void* out, void* lse, const void* block_out, const void* block_lse) const {
    AttentionKernels::cpu(isa()).lse_merge(LseMergeArgs{shape, out, lse, block_out, block_lse},
                                          Launch{0, shape.groups, nullptr});
  }
};
TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(LseMerge);

TEST_P(LseMerge, TwoHalvesOfTheKeysMergeIntoAttentionOverAll) {
  constexpr int kRows = 3, kDim = 5, kKeys = 8;
  std::mt19937 gen(3);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<float> acc_out(kRows * kDim), block_out(kRows * kDim);
  std::vector<float> acc_lse(kRows), block_lse(kRows);
  std::vector<std::vector<double>> expected(kRows);
  tdx::test::MergeReference reference(kRows, kDim);  // the exact merge of the rounded halves, and its bound
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
    const std::vector<double> a(acc_out.begin() + i * kDim, acc_out.begin() + (i + 1) * kDim);
    const std::vector<double> b(block_out.begin() + i * kDim, block_out.begin() + (i + 1) * kDim);
    reference.merge<float>(i, a.data(), acc_lse[i]);
    reference.merge<float>(i, b.data(), block_lse[i]);
  }
  merge({ElementType::kFloat32, 1, kRows, kDim, kRows * kDim, kRows, kRows * kDim, kRows}, acc_out.data(),
        acc_lse.data(), block_out.data(), block_lse.data());
  // The kernel against the exact merge of its (float) inputs, within the merge's bound; and that
  // exact merge against attention over all keys, within the halves' rounding to float (u relative
  // for each of out and lse, carried through with weights <= 1 and lse sensitivity <= |A - B| / 4).
  const double u = tdx::test::unit_roundoff<float>();
  for (int i = 0; i < kRows; ++i) {
    for (int d = 0; d < kDim; ++d) {
      const int e = i * kDim + d;
      EXPECT_NEAR(acc_out[e], reference.out[e], reference.out_error[e]) << i << "," << d;
      EXPECT_NEAR(reference.out[e], expected[i][d], 8 * u * (1 + std::abs(expected[i][d]))) << i << "," << d;
    }
    EXPECT_NEAR(acc_lse[i], reference.lse[i], reference.lse_error[i]) << i;
    EXPECT_NEAR(reference.lse[i], expected[i][kDim], 8 * u * (1 + std::abs(expected[i][kDim]))) << i;
  }
}

TEST_P(LseMerge, SequencesOfMergesStayWithinTheirBoundForEveryBlockTypeAndStride) {
  // Features: none, one, under a warp, not a multiple of the warp, one GPU block of threads, several per thread.
  tdx::test::for_each_type_and_size({0, 1, 33, 64, 256, 300}, [&](auto acc, ElementType type, int64_t dim) {
    tdx::test::check_lse_merges<decltype(acc)>(AttentionKernels::cpu(isa()), type, dim);
  });
}

TEST_P(LseMerge, EmptyAccumulatorTakesTheBlockAndEmptyBlockChangesNothing) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> out = {9.0f, 9.0f, 1.0f, 2.0f};  // row 0: empty accumulator, row 1: holds (1, 2)
  std::vector<float> lse = {-inf, 0.5f};
  std::vector<BFloat16> block = {tdx::kernels::to_bfloat16(3.0f), tdx::kernels::to_bfloat16(4.0f),
                                 tdx::kernels::to_bfloat16(7.0f), tdx::kernels::to_bfloat16(8.0f)};
  std::vector<float> block_lse = {1.25f, -inf};
  merge({ElementType::kBFloat16, 1, 2, 2, 4, 2, 4, 2}, out.data(), lse.data(), block.data(), block_lse.data());
  EXPECT_EQ(out, (std::vector<float>{3.0f, 4.0f, 1.0f, 2.0f}));
  EXPECT_EQ(lse, (std::vector<float>{1.25f, 0.5f}));
}

TEST_P(LseMerge, GroupStridesSelectASliceOfRows) {
  // Two groups of 4 rows in the accumulator; merge a 2-row block into rows 2..3 of each group.
  std::vector<double> out(2 * 4, 1.0), lse(2 * 4, 0.0);
  std::vector<double> block = {5.0, 5.0, 5.0, 5.0}, block_lse(4, 0.0);  // equal weights: the mean
  merge({ElementType::kFloat64, 2, 2, 1, 4, 4, 2, 2}, out.data() + 2, lse.data() + 2, block.data(),
        block_lse.data());
  EXPECT_EQ(out, (std::vector<double>{1, 1, 3, 3, 1, 1, 3, 3}));
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(lse[g * 4], 0.0);
    EXPECT_NEAR(lse[g * 4 + 2], std::log(2.0), 4 * tdx::test::unit_roundoff<double>());
  }
}

}  // namespace
