// CPU kernels of the MoE token exchange and permutation, every ISA clone, through the checks every implementation
// passes (kernel_checks.h).

#include <gtest/gtest.h>

#include "cpu_isa_test.h"
#include "kernel_checks.h"
#include "kernels/moe.h"

namespace {

class MoePermutation : public tdx::test::CpuIsaTest {};
TDX_INSTANTIATE_FOR_EVERY_CPU_ISA(MoePermutation);

TEST_P(MoePermutation, SortsSlotsExpertMajorAndMovesRowsBothWaysInEveryElementType) {
  tdx::test::for_each_type_and_size({1, 7, 300}, [&](auto acc, tdx::kernels::ElementType type, int64_t dim) {
    tdx::test::check_moe_permutation<decltype(acc)>(tdx::kernels::MoeKernels::cpu(isa()), type, dim);
  });
}

TEST_P(MoePermutation, RoutesPacksAndSumsTheExchangedRowsInEveryElementType) {
  tdx::test::for_each_type_and_size({1, 7, 300}, [&](auto acc, tdx::kernels::ElementType type, int64_t dim) {
    tdx::test::check_moe_exchange<decltype(acc)>(tdx::kernels::MoeKernels::cpu(isa()), type, dim);
  });
}

TEST_P(MoePermutation, RanksRoutedByPartialLaunchesAgreeWithOneLaunch) {
  const std::vector<int64_t> ids = {2, 0, -1, 1, 2, 3, 0, 1, -1, -1};  // 5 tokens, top 2, 2 ranks of 2 experts
  const std::vector<int64_t> starts = {0, 10}, ends = {4, 11};  // rank 1's block holds one of its two tokens
  constexpr int64_t full = tdx::kernels::kOverflowRow;           // its other token: the block is full
  std::vector<int64_t> whole(10), parts(10, -7);
  const auto& table = tdx::kernels::MoeKernels::cpu(isa());
  table.route_tokens({ids.data(), 5, 2, 2, 2, starts.data(), ends.data(), whole.data()}, {0, 2, nullptr});
  table.route_tokens({ids.data(), 5, 2, 2, 2, starts.data(), ends.data(), parts.data()}, {0, 1, nullptr});
  table.route_tokens({ids.data(), 5, 2, 2, 2, starts.data(), ends.data(), parts.data()}, {1, 2, nullptr});
  EXPECT_EQ(parts, whole);
  EXPECT_EQ(whole, (std::vector<int64_t>{0, 10, 1, -1, -1, full, 2, -1, -1, -1}));
}

TEST_P(MoePermutation, ExpertsSortedByPartialLaunchesAgreeWithOneLaunch) {
  const std::vector<int64_t> ids = {2, 0, -1, 1, 2, 0, 0, 1, -1, 2};  // 5 rows, top 2, 3 experts
  const std::vector<int64_t> starts = {0, 3, 5}, ends = {3, 4, 8};  // expert 1's segment holds one of its two slots
  std::vector<int64_t> whole(ids.size()), parts(ids.size(), -7);
  std::vector<float> sorted(8, 9.0f);  // one feature per row
  std::vector<int64_t> scratch(tdx::kernels::sort_scratch_size(ids.size(), 3));
  std::vector<int32_t> segment_ends(3);
  const auto& table = tdx::kernels::MoeKernels::cpu(isa());
  table.sort_slots({ids.data(), 5, 2, 3, -1, starts.data(), ends.data(), whole.data(), sorted.data(), 4, scratch.data(), segment_ends.data()}, {0, 3, nullptr});
  table.sort_slots({ids.data(), 5, 2, 3, -1, starts.data(), ends.data(), parts.data(), sorted.data(), 4, scratch.data(), segment_ends.data()}, {0, 1, nullptr});
  table.sort_slots({ids.data(), 5, 2, 3, -1, starts.data(), ends.data(), parts.data(), sorted.data(), 4, scratch.data(), segment_ends.data()}, {1, 3, nullptr});
  EXPECT_EQ(parts, whole);
  EXPECT_EQ(whole, (std::vector<int64_t>{5, 0, -1, 3, 6, 1, 2, -1, -1, 7}));
  EXPECT_EQ(segment_ends, (std::vector<int32_t>{3, 4, 8}));
}

}  // namespace
