#pragma once
// One clone of a CPU kernel per ISA (kernels/cpu/isa.h), and each ISA's table.
//
// IsaClone<isa>::of<kernel> is `kernel` compiled for `isa`: a wrapper with that
// ISA's target attribute that flattens (inlines) everything the kernel calls into
// itself, so that the kernel's loops and every helper they call use that ISA's
// vectors (and fused multiply-adds where it has FMA). Only calls into other
// libraries stay calls: libm's exp and log (the merge's scalar weights, the
// double-precision kernels), which libm dispatches by ISA itself.
//
//   const Table& table = cpu_kernel_table<Table, &kernel_a, &kernel_b>(isa);
//
// holds the clones of kernel_a and kernel_b for `isa`, in the order of Table's
// members. Kernels take (const Args&, const Launch&).

#include "kernels/cpu/isa.h"
#include "kernels/launch.h"

namespace tdx::kernels {

template <typename Args>
Args kernel_args(void (*)(const Args&, const Launch&));

// The argument struct of a kernel.
template <auto kKernel>
using KernelArgs = decltype(kernel_args(kKernel));

template <CpuIsa kIsa>
struct IsaClone;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TDX_ISA_TARGET(features) __attribute__((target(features), flatten))
#define TDX_BASELINE_TARGET __attribute__((flatten))
#else
#define TDX_ISA_TARGET(features)
#define TDX_BASELINE_TARGET
#endif

#define TDX_DEFINE_ISA_CLONE(isa, attributes)                             \
  template <>                                                             \
  struct IsaClone<isa> {                                                  \
    template <auto kKernel>                                               \
    attributes static void of(const KernelArgs<kKernel>& args, const Launch& launch) { \
      kKernel(args, launch);                                              \
    }                                                                     \
  };

TDX_DEFINE_ISA_CLONE(CpuIsa::kBaseline, TDX_BASELINE_TARGET)
TDX_DEFINE_ISA_CLONE(CpuIsa::kAvx2, TDX_ISA_TARGET("avx2,fma"))
TDX_DEFINE_ISA_CLONE(CpuIsa::kAvx512, TDX_ISA_TARGET("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))

#undef TDX_DEFINE_ISA_CLONE
#undef TDX_ISA_TARGET
#undef TDX_BASELINE_TARGET

template <typename Table, auto... kKernels>
const Table& cpu_kernel_table(CpuIsa isa) {
  static const Table tables[] = {
      Table{&IsaClone<CpuIsa::kBaseline>::template of<kKernels>...},
      Table{&IsaClone<CpuIsa::kAvx2>::template of<kKernels>...},
      Table{&IsaClone<CpuIsa::kAvx512>::template of<kKernels>...},
  };
  return tables[static_cast<int>(isa)];
}

}  // namespace tdx::kernels
