// The CPU ISA clones: names, what this CPU supports, switching, and that every
// family's table holds a distinct clone per ISA.

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>

#include "kernels/attention.h"
#include "kernels/cpu/isa.h"
#include "kernels/cross_entropy.h"

using tdx::kernels::CpuIsa;

TEST(CpuIsa, NamesRoundTrip) {
  for (const CpuIsa isa : tdx::kernels::kCpuIsas) {
    CpuIsa parsed;
    ASSERT_TRUE(tdx::kernels::parse_cpu_isa(tdx::kernels::cpu_isa_name(isa), &parsed));
    EXPECT_EQ(parsed, isa);
  }
  CpuIsa unused;
  EXPECT_FALSE(tdx::kernels::parse_cpu_isa("sse9", &unused));
}

TEST(CpuIsa, TheBestIsSupportedAndSoIsEveryNarrowerOne) {
  const CpuIsa best = tdx::kernels::best_cpu_isa();
  for (const CpuIsa isa : tdx::kernels::kCpuIsas) {
    EXPECT_EQ(tdx::kernels::cpu_supports(isa), static_cast<int>(isa) <= static_cast<int>(best))
        << tdx::kernels::cpu_isa_name(isa);
  }
  RecordProperty("best_cpu_isa", tdx::kernels::cpu_isa_name(best));
}

TEST(CpuIsa, SwitchingReachesEverySupportedIsaAndRefusesTheOthers) {
  const CpuIsa initial = tdx::kernels::active_cpu_isa();
  if (std::getenv("TDX_CPU_ISA") == nullptr) EXPECT_EQ(initial, tdx::kernels::best_cpu_isa());
  for (const CpuIsa isa : tdx::kernels::kCpuIsas) {
    if (tdx::kernels::cpu_supports(isa)) {
      tdx::kernels::set_active_cpu_isa(isa);
      EXPECT_EQ(tdx::kernels::active_cpu_isa(), isa);
    } else {
      EXPECT_THROW(tdx::kernels::set_active_cpu_isa(isa), std::invalid_argument);
    }
  }
  tdx::kernels::set_active_cpu_isa(initial);
}

TEST(CpuIsa, EveryTableHoldsOneClonePerIsa) {
  using tdx::kernels::AttentionKernels;
  using tdx::kernels::CrossEntropyKernels;
  const auto baseline = CpuIsa::kBaseline, avx2 = CpuIsa::kAvx2, avx512 = CpuIsa::kAvx512;
  EXPECT_NE(CrossEntropyKernels::cpu(baseline).shard_stats, CrossEntropyKernels::cpu(avx2).shard_stats);
  EXPECT_NE(CrossEntropyKernels::cpu(avx2).shard_grad, CrossEntropyKernels::cpu(avx512).shard_grad);
  EXPECT_NE(AttentionKernels::cpu(baseline).lse_merge, AttentionKernels::cpu(avx512).lse_merge);
  EXPECT_EQ(&CrossEntropyKernels::cpu(avx2), &CrossEntropyKernels::cpu(avx2));
}
