// CPU kernel of the counter-based initialisation (contract: kernels/init.h).

#include "kernels/init.h"

#include <type_traits>

#include "kernels/cpu/element.h"

namespace tdx::kernels {
namespace cpu {
namespace {

// One clone for every ISA: the values must not depend on the CPU (an FMA-contracted polynomial would round
// differently from the baseline's), and initialisation is not on a training step's path.
void trunc_normal(const TruncNormalArgs& args, const Launch& launch) {
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* out = static_cast<T*>(args.out);
    for (int64_t row = launch.begin; row < launch.end; ++row) {
      const int64_t start = block_row_start(args, row);
      T* out_row = out + row * args.cols;
      for (int64_t col = 0; col < args.cols; ++col) {
        const float value = counter_trunc_normal(args.stream, static_cast<uint64_t>(start + col), args.mean,
                                                 args.std, args.a, args.b, args.low, args.high);
        store(out_row[col], value);
      }
    }
  });
}

}  // namespace
}  // namespace cpu

const InitKernels& InitKernels::cpu(CpuIsa) {
  static const InitKernels table{&cpu::trunc_normal};
  return table;
}

}  // namespace tdx::kernels
