// CPU kernels of the vocab-parallel cross-entropy against a direct double-precision computation.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/vector_exp.h"

using tdx::kernels::ElementType;
namespace cpu = tdx::kernels::cpu;

namespace {

struct Problem {
  int64_t rows = 5;
  int64_t vocab_local = 37;
  int64_t vocab_start = 74;  // shard 2 (columns 74..110) of a 111-token vocabulary
  std::vector<float> logits;
  std::vector<int64_t> target;
};

// vocab_local above the kernels' 2048-element block makes rows span several blocks.
Problem make_problem(int64_t vocab_local = 37) {
  Problem p;
  p.vocab_local = vocab_local;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int64_t i = 0; i < p.rows * p.vocab_local; ++i) p.logits.push_back(normal(gen));
  // In this shard, in another shard, ignored, at the shard's first and last column.
  p.target = {80, 3, -100, 74, 110};
  return p;
}

}  // namespace

TEST(VocabShardStats, MatchesDirectComputation) {
  const Problem p = make_problem();
  std::vector<float> max(p.rows), sumexp(p.rows), target_logit(p.rows);
  cpu::vocab_shard_stats<float>(ElementType::kFloat32, p.logits.data(), p.target.data(), 0, p.rows, p.vocab_local,
                                p.vocab_start, max.data(), sumexp.data(), target_logit.data());
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.logits.data() + r * p.vocab_local;
    double m = -INFINITY;
    for (int64_t v = 0; v < p.vocab_local; ++v) m = std::max(m, double(x[v]));
    double s = 0;
    for (int64_t v = 0; v < p.vocab_local; ++v) s += std::exp(double(x[v]) - m);
    const int64_t local = p.target[r] - p.vocab_start;
    const double t = (local >= 0 && local < p.vocab_local) ? x[local] : 0.0;
    EXPECT_FLOAT_EQ(max[r], m) << "row " << r;
    EXPECT_NEAR(sumexp[r], s, 1e-5 * s) << "row " << r;
    EXPECT_FLOAT_EQ(target_logit[r], t) << "row " << r;
  }
}

TEST(VocabShardStats, RowRangesComposeAndLeaveOtherRowsUntouched) {
  const Problem p = make_problem();
  std::vector<double> logits(p.logits.begin(), p.logits.end());
  std::vector<double> whole_max(p.rows), whole_sum(p.rows), whole_t(p.rows);
  cpu::vocab_shard_stats<double>(ElementType::kFloat64, logits.data(), p.target.data(), 0, p.rows, p.vocab_local,
                                 p.vocab_start, whole_max.data(), whole_sum.data(), whole_t.data());
  std::vector<double> max(p.rows, -1), sum(p.rows, -1), t(p.rows, -1);
  cpu::vocab_shard_stats<double>(ElementType::kFloat64, logits.data(), p.target.data(), 1, 3, p.vocab_local,
                                 p.vocab_start, max.data(), sum.data(), t.data());
  cpu::vocab_shard_stats<double>(ElementType::kFloat64, logits.data(), p.target.data(), 3, p.rows, p.vocab_local,
                                 p.vocab_start, max.data(), sum.data(), t.data());
  EXPECT_EQ(max[0], -1);
  for (int64_t r = 1; r < p.rows; ++r) {
    EXPECT_EQ(max[r], whole_max[r]);
    EXPECT_EQ(sum[r], whole_sum[r]);
    EXPECT_EQ(t[r], whole_t[r]);
  }
}

// Rows longer than the kernels' 2048-element block, with logits that rise
// along the row so that every block raises the running maximum and the sum
// must be rescaled online; bf16 inputs are widened block by block.
TEST(VocabShardStats, LongRowsRescaleAcrossBlocksInEveryElementType) {
  const int64_t rows = 3, vocab = 5000;
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < vocab; ++v) logits.push_back(normal(gen) + (r == 1 ? -0.004f : 0.004f) * v);
  }
  std::vector<tdx::kernels::BFloat16> logits_bf16;
  std::vector<float> rounded;
  for (float x : logits) {
    logits_bf16.push_back(tdx::kernels::to_bfloat16(x));
    rounded.push_back(tdx::kernels::load(logits_bf16.back()));
  }
  const std::vector<int64_t> target = {4999, 2048, 0};
  struct Case {
    ElementType type;
    const void* data;
    const std::vector<float>* values;
  };
  for (const Case& c : {Case{ElementType::kFloat32, logits.data(), &logits},
                        Case{ElementType::kBFloat16, logits_bf16.data(), &rounded}}) {
    std::vector<float> max(rows), sumexp(rows), target_logit(rows);
    cpu::vocab_shard_stats<float>(c.type, c.data, target.data(), 0, rows, vocab, 0, max.data(), sumexp.data(),
                                  target_logit.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = c.values->data() + r * vocab;
      double m = -INFINITY, s = 0;
      for (int64_t v = 0; v < vocab; ++v) m = std::max(m, double(x[v]));
      for (int64_t v = 0; v < vocab; ++v) s += std::exp(double(x[v]) - m);
      EXPECT_FLOAT_EQ(max[r], m) << "row " << r;
      EXPECT_NEAR(sumexp[r], s, 1e-5 * s) << "row " << r;
      EXPECT_FLOAT_EQ(target_logit[r], x[target[r]]) << "row " << r;
    }
  }
}

// Masked logits (-inf) count for nothing, also when whole blocks of a row are
// masked before its first finite logit; a NaN logit makes the row's sum NaN
// (as F.cross_entropy's loss is), it is never dropped.
TEST(VocabShardStats, MaskedLogitsVanishAndNanPropagates) {
  const int64_t vocab = 5000, masked = 4500;  // row 0: columns [0, 4500) masked, past two blocks
  std::vector<float> logits(2 * vocab);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : logits) x = normal(gen);
  for (int64_t v = 0; v < masked; ++v) logits[v] = -INFINITY;
  logits[vocab + 3000] = NAN;
  const std::vector<int64_t> target = {4700, 7};
  std::vector<float> max(2), sumexp(2), target_logit(2);
  cpu::vocab_shard_stats<float>(ElementType::kFloat32, logits.data(), target.data(), 0, 2, vocab, 0, max.data(),
                                sumexp.data(), target_logit.data());
  double m = -INFINITY, s = 0;
  for (int64_t v = masked; v < vocab; ++v) m = std::max(m, double(logits[v]));
  for (int64_t v = masked; v < vocab; ++v) s += std::exp(double(logits[v]) - m);
  EXPECT_FLOAT_EQ(max[0], m);
  EXPECT_NEAR(sumexp[0], s, 1e-5 * s);
  EXPECT_TRUE(std::isnan(sumexp[1]));
}

TEST(VocabShardGrad, IsSoftmaxMinusOneHotTimesUpstream) {
  for (const int64_t vocab_local : {37, 4500}) {
    const Problem p = make_problem(vocab_local);
    std::vector<float> lse(p.rows), upstream(p.rows), grad(p.rows * p.vocab_local);
    for (int64_t r = 0; r < p.rows; ++r) {
      lse[r] = 3.0f + 0.5f * r;  // any value: the kernel must use it as given
      upstream[r] = 0.25f * (r + 1);
    }
    cpu::vocab_shard_grad<float>(ElementType::kFloat32, upstream.data(), p.logits.data(), p.target.data(), lse.data(),
                                 0, p.rows, p.vocab_local, p.vocab_start, -100, grad.data());
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t v = 0; v < p.vocab_local; ++v) {
        const double x = p.logits[r * p.vocab_local + v];
        double expected = upstream[r] * (std::exp(x - lse[r]) - (p.vocab_start + v == p.target[r] ? 1.0 : 0.0));
        if (p.target[r] == -100) expected = 0.0;
        EXPECT_NEAR(grad[r * p.vocab_local + v], expected, 1e-6 * (1 + std::abs(expected))) << r << "," << v;
      }
    }
  }
}

TEST(VocabShardGrad, BFloat16MatchesFloatWithinRounding) {
  for (const int64_t vocab_local : {37, 4500}) {
    const Problem p = make_problem(vocab_local);
    std::vector<tdx::kernels::BFloat16> logits, upstream;
    for (float x : p.logits) logits.push_back(tdx::kernels::to_bfloat16(x));
    std::vector<float> lse(p.rows, 5.0f), upstream_f(p.rows, 1.0f), rounded_logits;
    for (auto x : logits) rounded_logits.push_back(tdx::kernels::load(x));
    for (float u : upstream_f) upstream.push_back(tdx::kernels::to_bfloat16(u));
    std::vector<tdx::kernels::BFloat16> grad(p.rows * p.vocab_local);
    std::vector<float> grad_f(p.rows * p.vocab_local);
    cpu::vocab_shard_grad<float>(ElementType::kBFloat16, upstream.data(), logits.data(), p.target.data(), lse.data(),
                                 0, p.rows, p.vocab_local, p.vocab_start, -100, grad.data());
    cpu::vocab_shard_grad<float>(ElementType::kFloat32, upstream_f.data(), rounded_logits.data(), p.target.data(),
                                 lse.data(), 0, p.rows, p.vocab_local, p.vocab_start, -100, grad_f.data());
    for (size_t i = 0; i < grad.size(); ++i) {
      EXPECT_NEAR(tdx::kernels::load(grad[i]), grad_f[i], std::ldexp(1.0, -8) * std::abs(grad_f[i]) + 1e-30) << i;
    }
  }
}

TEST(VocabShardGrad, InPlaceEqualsOutOfPlace) {
  const Problem p = make_problem(4500);
  std::vector<float> lse(p.rows, 6.0f), upstream(p.rows, 0.5f), out_of_place(p.logits.size());
  cpu::vocab_shard_grad<float>(ElementType::kFloat32, upstream.data(), p.logits.data(), p.target.data(), lse.data(),
                               0, p.rows, p.vocab_local, p.vocab_start, -100, out_of_place.data());
  std::vector<float> in_place = p.logits;
  cpu::vocab_shard_grad<float>(ElementType::kFloat32, upstream.data(), in_place.data(), p.target.data(), lse.data(),
                               0, p.rows, p.vocab_local, p.vocab_start, -100, in_place.data());
  EXPECT_EQ(in_place, out_of_place);

  std::vector<tdx::kernels::BFloat16> logits, upstream_bf16, out_of_place_bf16(p.logits.size());
  for (float x : p.logits) logits.push_back(tdx::kernels::to_bfloat16(x));
  for (float u : upstream) upstream_bf16.push_back(tdx::kernels::to_bfloat16(u));
  cpu::vocab_shard_grad<float>(ElementType::kBFloat16, upstream_bf16.data(), logits.data(), p.target.data(),
                               lse.data(), 0, p.rows, p.vocab_local, p.vocab_start, -100, out_of_place_bf16.data());
  cpu::vocab_shard_grad<float>(ElementType::kBFloat16, upstream_bf16.data(), logits.data(), p.target.data(),
                               lse.data(), 0, p.rows, p.vocab_local, p.vocab_start, -100, logits.data());
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_EQ(logits[i].bits, out_of_place_bf16[i].bits) << i;
}

TEST(ExpApprox, WithinFewUlpOfStdExpAndZeroBelowTheNormalRange) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const double exact = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(tdx::kernels::cpu::exp_approx(x) - exact) / exact);
  }
  EXPECT_LT(worst, 4e-7);  // 2^-23 = 1.2e-7 is one float ulp
  EXPECT_EQ(tdx::kernels::cpu::exp_approx(0.0f), 1.0f);
  EXPECT_EQ(tdx::kernels::cpu::exp_approx(-100.0f), 0.0f);
  EXPECT_EQ(tdx::kernels::cpu::exp_approx(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isnan(tdx::kernels::cpu::exp_approx(NAN)));
  EXPECT_TRUE(std::isfinite(tdx::kernels::cpu::exp_approx(1000.0f)));
}
