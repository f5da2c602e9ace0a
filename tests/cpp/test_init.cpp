// CPU kernel of the counter-based initialisation through the checks every implementation passes
// (kernel_checks.h), and the inverse error function it evaluates against std::erf.

#include <gtest/gtest.h>

#include <cmath>

#include "cpu_isa_test.h"
#include "kernel_checks.h"
#include "kernels/init.h"

namespace {

class TruncNormal : public tdx::test::CpuIsaTest {};
TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(TruncNormal);

TEST_P(TruncNormal, FillsEachBlockWithTheWholeTensorsValuesInEveryElementType) {
  for (const auto type : tdx::test::kAllTypes) {
    tdx::test::check_trunc_normal(tdx::kernels::InitKernels::cpu(isa()), type);
  }
}

// Giles' approximation against the exact inverse of the same float y (Newton's method on std::erf in double),
// over (-1, 1) up to 1 - 2^-24 (the uniforms' range): within the 4e-7 relative error init.h states.
TEST(CounterInit, ErfinvApproximationInvertsErf) {
  for (int i = -999; i <= 999; ++i) {
    for (const double wide : {i / 1000.0, std::copysign(1.0 - std::ldexp(1.0, -(3 + std::abs(i) % 22)), i)}) {
      const float y = static_cast<float>(wide);
      if (y == 0) continue;
      double x = 0;
      for (int step = 0; step < 100; ++step) {
        x -= (std::erf(x) - y) / (2 / std::sqrt(M_PI) * std::exp(-x * x));
      }
      const double got = tdx::kernels::erfinv_approx(y);
      EXPECT_NEAR(got, x, 4e-7 * std::abs(x)) << "y = " << y;
    }
  }
}

}  // namespace
