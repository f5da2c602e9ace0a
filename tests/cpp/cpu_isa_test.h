#pragma once
// CPU kernel tests run once per ISA clone (kernels/cpu/isa.h): a test of the
// suite TEST_P(SomeSuite, ...) reads its clone as isa(). Clones this CPU lacks
// are skipped with the reason, and ctest lists them as skipped.
//
//   class SomeSuite : public tdx::test::CpuIsaTest {};
//   TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(SomeSuite);

#include <gtest/gtest.h>

#include "kernels/cpu/isa.h"

namespace tdx::test {

class CpuIsaTest : public ::testing::TestWithParam<kernels::CpuIsa> {
 protected:
  void SetUp() override {
    if (!kernels::cpu_supports(isa())) {
      GTEST_SKIP() << "this CPU lacks " << kernels::cpu_isa_name(isa()) << " (best: "
                   << kernels::cpu_isa_name(kernels::best_cpu_isa()) << "); its clone is not run here";
    }
  }
  kernels::CpuIsa isa() const { return GetParam(); }
};

inline std::string isa_test_name(const ::testing::TestParamInfo<kernels::CpuIsa>& info) {
  return kernels::cpu_isa_name(info.param);
}

}  // namespace tdx::test

#define TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(suite) \
  INSTANTIATE_TEST_SUITE_P(EveryIsa, suite, ::testing::ValuesIn(tdx::kernels::kCpuIsas), tdx::test::isa_test_name)
