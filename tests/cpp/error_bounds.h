#pragma once
// Error bounds of the kernels' floating-point arithmetic. Every tolerance of
// the kernel tests comes from these (never from what one machine printed):
// each kernel is compared with a direct double-precision computation on the
// same (rounded) inputs, within the bound of its sequence of operations.
//
// Model, first order in the accumulator's unit roundoff u (2^-24 float,
// 2^-53 double):
//   * every +, -, *, / and fused multiply-add rounds once: relative error <= u.
//     A clone that contracts a*b + c into an FMA (AVX2, AVX-512, CUDA) rounds
//     once where the baseline rounds twice; the bounds count two roundings.
//   * every exp and log a kernel calls is within kExpLogError = 8 u of the exact
//     value: the CPU's vector exp < 4e-7 = 6.7 u (ExpApprox asserts it), glibc's
//     exp/log < 1 ulp = 2 u, CUDA's expf/logf <= 2 ulp = 4 u. Rounding exp's
//     argument x adds u |x| to its relative error. An exp below the normal range
//     may flush to 0: an absolute error up to kTiny per exp (the CPU's vector exp
//     flushes below -87.3, where e^x < 1.05 x 2^-126; kTiny is 2^-125).
//   * storing an accumulator into a 16-bit element rounds once more: relative
//     2^-8 (bf16) or 2^-11 (fp16), plus half the smallest subnormal.

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/dtype.h"

namespace tdx::test {

constexpr double kExpLogError = 8;  // in units of u

template <typename Acc>
constexpr double unit_roundoff() {
  return std::is_same_v<Acc, double> ? 0x1p-53 : 0x1p-24;
}

template <typename Acc>
constexpr double kTiny = 2 * std::numeric_limits<Acc>::min();

// Relative rounding of a store into an element of `type` (0: the accumulator itself).
inline double store_roundoff(kernels::ElementType type) {
  switch (type) {
    case kernels::ElementType::kBFloat16: return 0x1p-8;
    case kernels::ElementType::kFloat16: return 0x1p-11;
    default: return 0;
  }
}

// Absolute rounding of a store near 0 (half the element type's smallest subnormal).
inline double store_underflow(kernels::ElementType type) {
  switch (type) {
    case kernels::ElementType::kBFloat16: return 0x1p-134;
    case kernels::ElementType::kFloat16: return 0x1p-25;
    default: return 0;
  }
}

// How a term exp(x_i - shift) reaches a kernel's row sum: through at most
// `adds` roundings of the partial sums it joins, and `rescales` multiplications
// by exp(old shift - new shift) as the running maximum rises (an exp and a
// product each). The shifts rise from x_i to the row's max m, so the rounding
// of all these exp arguments adds u (m - x_i) in all.
struct SumexpPath {
  double adds;
  double rescales;
};

// Bound on |computed - sum_i exp(x_i - m)|, m = max_i x_i, for a row of values
// (as the kernel reads them) summed along `path`. -inf values count for nothing.
template <typename Acc>
double sumexp_bound(const std::vector<double>& row, SumexpPath path) {
  const double u = unit_roundoff<Acc>();
  double m = -INFINITY;
  for (double x : row) m = std::max(m, x);
  double bound = 0;
  for (double x : row) {
    if (x == -INFINITY) continue;
    const double term = std::exp(x - m);
    const double relative = (1 + path.rescales) * kExpLogError + path.rescales + path.adds + (m - x);
    bound += u * term * relative + (1 + path.rescales) * kTiny<Acc>;
  }
  return bound;
}

// Bound on |computed - exact| for one gradient element
// g * (exp(x - lse) - onehot), rounded into an element of `type`.
template <typename Acc>
double grad_bound(double g, double x, double lse, double onehot, kernels::ElementType type) {
  const double u = unit_roundoff<Acc>();
  const double e = std::exp(x - lse);
  const double exact = g * (e - onehot);
  const double exp_error = e == 0 ? 0 : (kExpLogError + std::abs(x - lse)) * e;  // e == 0: a masked logit, exact
  const double in_acc = u * std::abs(g) * (exp_error + 2 * std::abs(e - onehot)) + std::abs(g) * kTiny<Acc>;
  return (1 + store_roundoff(type)) * in_acc + store_roundoff(type) * std::abs(exact) + store_underflow(type);
}

// The exact result of merging partial attention results one after another,
// with the bound on each element's error that a kernel may accumulate on the
// way (kernels/attention.h's formulas). Merging block (B, b) into (A, a), with
// m = max(a, b), weights s_a = e^(a-m) / (e^(a-m) + e^(b-m)), s_b = 1 - s_a:
//   lse: sum rounds (kExpLogError + 2) u with the exp in it, log kExpLogError u
//        of |log total| <= ln 2, the final add u |lse|; an earlier error e_a in a
//        propagates as s_a e_a.
//   out: each weight within u (2 (kExpLogError + 1) s + 1) (the argument of the
//        small weight's exp is rounded too, but d e^-d <= 1/e), two products and
//        a sum 2 u (s_a |A| + s_b |B|); earlier errors propagate as s_a e_A and,
//        through the weights' dependence on a, s_a s_b |A - B| e_a.
struct MergeReference {
  std::vector<double> out, out_error;  // per element
  std::vector<double> lse, lse_error;  // per row

  MergeReference(size_t rows, size_t dim)
      : out(rows * dim, 0.0), out_error(rows * dim, 0.0), lse(rows, -INFINITY), lse_error(rows, 0.0) {}

  template <typename Acc>
  void merge(size_t row, const double* block_row, double block_lse) {
    if (block_lse == -INFINITY) return;
    const double u = unit_roundoff<Acc>();
    const size_t dim = out.size() / lse.size();
    const double a = lse[row], m = std::max(a, block_lse);
    const double wa = std::exp(a - m), wb = std::exp(block_lse - m), total = wa + wb;
    const double sa = wa / total, sb = wb / total;
    const double new_lse = m + std::log(total);
    const double weight_error_a = 2 * (kExpLogError + 1) * sa + 1, weight_error_b = 2 * (kExpLogError + 1) * sb + 1;
    for (size_t d = 0; d < dim; ++d) {
      double& acc = out[row * dim + d];
      const double b = block_row[d];
      out_error[row * dim + d] = sa * out_error[row * dim + d] + sa * sb * std::abs(acc - b) * lse_error[row] +
                                 u * (weight_error_a * std::abs(acc) + weight_error_b * std::abs(b)) +
                                 2 * u * (sa * std::abs(acc) + sb * std::abs(b));
      acc = sa * acc + sb * b;
    }
    lse_error[row] = sa * lse_error[row] + u * ((kExpLogError + 2) + kExpLogError * std::log(2.0) + std::abs(new_lse));
    lse[row] = new_lse;
  }
};

}  // namespace tdx::test
