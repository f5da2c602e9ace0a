#include "kernels/cpu/attention.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "kernels/cpu/multiversion.h"

namespace tdx::kernels::cpu {
namespace {

template <typename T, typename Acc>
TDX_MULTIVERSION void merge_groups(Acc* out, int64_t out_outer_stride, Acc* lse, int64_t lse_outer_stride,
                                   const T* block_out, int64_t block_out_outer_stride, const Acc* block_lse,
                                   int64_t block_lse_outer_stride, int64_t outer_begin, int64_t outer_end,
                                   int64_t rows, int64_t dim) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  for (int64_t g = outer_begin; g < outer_end; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      Acc& acc_lse = lse[g * lse_outer_stride + i];
      const Acc block_lse_i = block_lse[g * block_lse_outer_stride + i];
      if (block_lse_i == kNegInf) continue;
      const Acc max = acc_lse > block_lse_i ? acc_lse : block_lse_i;
      const Acc weight_a = std::exp(acc_lse - max);  // 0 while the accumulator is empty
      const Acc weight_b = std::exp(block_lse_i - max);
      const Acc total = weight_a + weight_b;
      const Acc scale_a = weight_a / total;
      const Acc scale_b = weight_b / total;
      Acc* acc_row = out + g * out_outer_stride + i * dim;
      const T* block_row = block_out + g * block_out_outer_stride + i * dim;
      for (int64_t d = 0; d < dim; ++d) {
        acc_row[d] = scale_a * acc_row[d] + scale_b * static_cast<Acc>(load(block_row[d]));
      }
      acc_lse = max + std::log(total);
    }
  }
}

}  // namespace

template <typename Acc>
void lse_merge(ElementType block_type, Acc* out, int64_t out_outer_stride, Acc* lse, int64_t lse_outer_stride,
               const void* block_out, int64_t block_out_outer_stride, const Acc* block_lse,
               int64_t block_lse_outer_stride, int64_t outer_begin, int64_t outer_end, int64_t rows, int64_t dim) {
  auto run = [&](auto* typed) {
    merge_groups(out, out_outer_stride, lse, lse_outer_stride, typed, block_out_outer_stride, block_lse,
                 block_lse_outer_stride, outer_begin, outer_end, rows, dim);
  };
  switch (block_type) {
    case ElementType::kFloat32: return run(static_cast<const float*>(block_out));
    case ElementType::kFloat64: return run(static_cast<const double*>(block_out));
    case ElementType::kBFloat16: return run(static_cast<const BFloat16*>(block_out));
    case ElementType::kFloat16: return run(static_cast<const Float16*>(block_out));
  }
  throw std::invalid_argument("lse_merge: unknown element type");
}

template void lse_merge<float>(ElementType, float*, int64_t, float*, int64_t, const void*, int64_t, const float*,
                               int64_t, int64_t, int64_t, int64_t, int64_t);
template void lse_merge<double>(ElementType, double*, int64_t, double*, int64_t, const void*, int64_t,
                                const double*, int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace tdx::kernels::cpu
