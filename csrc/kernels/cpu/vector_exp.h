#pragma once
// exp(x) for float written so that loops calling it auto-vectorize (compile
// with -fno-trapping-math): no branches, no libm calls. Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2,
// Cephes' degree-6 polynomial for e^r (relative error < 2e-7), then 2^n from
// the exponent bits. Inputs below -87.3 give 0 (e^-87.3 ~ 1.2e-38, the smallest
// normal float); inputs above 88 give e^88 ~ 1.7e38 (finite); NaN gives NaN.

#include <cstdint>
#include <cstring>

namespace tdx::kernels::cpu {

inline float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693359375f;
  constexpr float kLn2Low = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  constexpr float kLowest = -87.3f;
  constexpr float kHighest = 88.0f;
  // Selects, not branches: with -fno-trapping-math they become vector blends.
  float clamped = x > kLowest ? x : kLowest;
  clamped = clamped < kHighest ? clamped : kHighest;
  const float n = (clamped * kLog2e + kRound) - kRound;
  const float r = (clamped - n * kLn2High) - n * kLn2Low;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const float result = e_r * two_n;
  const float result_or_zero = x > kLowest ? result : 0.0f;
  return x == x ? result_or_zero : x;  // NaN stays NaN
}

}  // namespace tdx::kernels::cpu
