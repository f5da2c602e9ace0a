// CPU kernels of the FP8 casts, every ISA clone, through the checks every implementation passes
// (kernel_checks.h).

#include <gtest/gtest.h>

#include "cpu_isa_test.h"
#include "kernel_checks.h"
#include "kernels/fp8.h"

namespace {

class Fp8Cast : public tdx::test::CpuIsaTest {};
TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(Fp8Cast);

TEST_P(Fp8Cast, RoundsToTheNearestFp8ValueAndFindsTheAmaxOfEveryChunk) {
  for (const auto type : {tdx::kernels::ElementType::kFloat32, tdx::kernels::ElementType::kBFloat16,
                          tdx::kernels::ElementType::kFloat16}) {
    tdx::test::check_fp8_cast_amax(tdx::kernels::Fp8Kernels::cpu(isa()), type);
  }
}

TEST_P(Fp8Cast, CastsAMatrixInBothLayoutsAndFindsTheAmaxOfEveryTile) {
  for (const auto type : {tdx::kernels::ElementType::kFloat32, tdx::kernels::ElementType::kBFloat16,
                          tdx::kernels::ElementType::kFloat16}) {
    tdx::test::check_fp8_cast_transpose_amax(tdx::kernels::Fp8Kernels::cpu(isa()), type);
  }
}

TEST_P(Fp8Cast, CastsEachBlockWithTheScaleOfItsOwnAmax) {
  for (const auto type : {tdx::kernels::ElementType::kFloat32, tdx::kernels::ElementType::kBFloat16,
                          tdx::kernels::ElementType::kFloat16}) {
    tdx::test::check_fp8_cast_blockwise(tdx::kernels::Fp8Kernels::cpu(isa()), type);
  }
}

}  // namespace
