// The kernels' own 16-bit float conversions against known IEEE bit patterns.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/dtype.h"

using tdx::kernels::BFloat16;
using tdx::kernels::Float16;
using tdx::kernels::load;
using tdx::kernels::to_bfloat16;
using tdx::kernels::to_float16;

namespace {

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

TEST(Float16, KnownValuesRoundTrip) {
  EXPECT_EQ(to_float16(1.0f).bits, 0x3c00);
  EXPECT_EQ(to_float16(-2.0f).bits, 0xc000);
  EXPECT_EQ(to_float16(65504.0f).bits, 0x7bff);  // largest finite half
  EXPECT_EQ(to_float16(0.0f).bits, 0x0000);
  EXPECT_EQ(to_float16(-0.0f).bits, 0x8000);
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -14)).bits, 0x0400);  // smallest normal
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -24)).bits, 0x0001);  // smallest subnormal
  EXPECT_FLOAT_EQ(load(Float16{0x3555}), 0.333251953125f);
  EXPECT_FLOAT_EQ(load(Float16{0x0001}), std::ldexp(1.0f, -24));
}

TEST(Float16, RoundsToNearestEvenAndSaturatesToInfinity) {
  EXPECT_EQ(to_float16(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00);      // halfway, even stays
  EXPECT_EQ(to_float16(1.0f + 3 * std::ldexp(1.0f, -11)).bits, 0x3c02);  // halfway, odd rounds up
  EXPECT_EQ(to_float16(65520.0f).bits, 0x7c00);                          // rounds past the max
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -25)).bits, 0x0000);             // halfway to 0 and 2^-24
  EXPECT_EQ(to_float16(std::numeric_limits<float>::infinity()).bits, 0x7c00);
  EXPECT_TRUE(std::isnan(load(to_float16(std::nanf("")))));
}

TEST(Float16, EveryHalfSurvivesARoundTrip) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const Float16 h{static_cast<uint16_t>(bits)};
    const float f = load(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(to_float16(f).bits, h.bits) << "bits=" << bits;
  }
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(to_bfloat16(1.0f).bits, 0x3f80);
  EXPECT_EQ(to_bfloat16(from_bits(0x3f808000)).bits, 0x3f80);  // halfway, even stays
  EXPECT_EQ(to_bfloat16(from_bits(0x3f818000)).bits, 0x3f82);  // halfway, odd rounds up
  EXPECT_EQ(to_bfloat16(from_bits(0x3f808001)).bits, 0x3f81);  // above halfway
  EXPECT_FLOAT_EQ(load(BFloat16{0x4049}), 3.140625f);
  EXPECT_TRUE(std::isnan(load(to_bfloat16(std::nanf("")))));
}
