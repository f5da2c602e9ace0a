// CPU kernel of attention's log-sum-exp merge (contract: kernels/attention.h).

#include "kernels/attention.h"

#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/element.h"
#include "kernels/cpu/isa_clones.h"

namespace tdx::kernels {
namespace cpu {
namespace {

template <typename T, typename Acc>
void merge_groups(const MergeShape& shape, Acc* out, Acc* lse, const T* block_out, const Acc* block_lse,
                  int64_t group_begin, int64_t group_end) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  const int64_t dim = shape.dim;
  for (int64_t g = group_begin; g < group_end; ++g) {
    for (int64_t i = 0; i < shape.rows; ++i) {
      Acc& acc_lse = lse[g * shape.lse_group_stride + i];
      const Acc block_lse_i = block_lse[g * shape.block_lse_group_stride + i];
      if (block_lse_i == kNegInf) continue;
      const Acc max = acc_lse > block_lse_i ? acc_lse : block_lse_i;
      const Acc weight_a = std::exp(acc_lse - max);  // 0 while the accumulator is empty
      const Acc weight_b = std::exp(block_lse_i - max);
      const Acc total = weight_a + weight_b;
      const Acc scale_a = weight_a / total;
      const Acc scale_b = weight_b / total;
      Acc* acc_row = out + g * shape.out_group_stride + i * dim;
      const T* block_row = block_out + g * shape.block_out_group_stride + i * dim;
      for (int64_t d = 0; d < dim; ++d) {
        acc_row[d] = scale_a * acc_row[d] + scale_b * static_cast<Acc>(load(block_row[d]));
      }
      acc_lse = max + std::log(total);
    }
  }
}

void lse_merge(const LseMergeArgs& args, const Launch& launch) {
  visit_element_type(args.shape.block_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    merge_groups(args.shape, static_cast<Acc*>(args.out), static_cast<Acc*>(args.lse),
                 static_cast<const T*>(args.block_out), static_cast<const Acc*>(args.block_lse), launch.begin,
                 launch.end);
  });
}

}  // namespace
}  // namespace cpu

const AttentionKernels& AttentionKernels::cpu(CpuIsa isa) {
  return cpu_kernel_table<AttentionKernels, &cpu::lse_merge>(isa);
}

}  // namespace tdx::kernels
