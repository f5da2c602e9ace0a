// CPU kernels of the FP8 casts (contracts: kernels/fp8.h).

#include "kernels/fp8.h"

#include <cmath>
#include <type_traits>

#include "kernels/cpu/element.h"
#include "kernels/cpu/isa_clones.h"

namespace tdx::kernels {
namespace cpu {
namespace {

void cast_amax(const CastAmaxArgs& args, const Launch& launch) {
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(args.x);
    const float scale = *args.scale;
    for (int64_t item = launch.begin; item < launch.end; ++item) {
      const int64_t begin = item * args.chunk;
      const int64_t end = begin + args.chunk < args.count ? begin + args.chunk : args.count;
      float amax = 0;
      bool nan = false;
      for (int64_t i = begin; i < end; ++i) {
        const float v = static_cast<float>(load(x[i]));
        const float magnitude = std::fabs(v);
        amax = magnitude > amax ? magnitude : amax;
        nan |= v != v;
        args.out[i] = to_fp8(v * scale, args.format);
      }
      args.partial_amax[item] = nan ? NAN : amax;
    }
  });
}

}  // namespace
}  // namespace cpu

const Fp8Kernels& Fp8Kernels::cpu(CpuIsa isa) { return cpu_kernel_table<Fp8Kernels, &cpu::cast_amax>(isa); }

}  // namespace tdx::kernels
