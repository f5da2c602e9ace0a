#pragma once
// The host layer's bridge to the devices, so that every op's host function is
// written once for all of them:
//   element_type        at::ScalarType -> the torch-free kernels' ElementType
//   accumulation_dtype  what kernels accumulate a dtype in (fp64 for fp64, else fp32)
//   kernels_for<Table>  a family's kernel table (kernels/<family>.h) for a device:
//                       the active CPU ISA's table on the CPU, the CUDA table on a GPU
//   launch              runs one kernel of a table over work items on a device
//   TDX_IMPL_ON_EVERY_DEVICE  registers one host function per op for every
//                       device this build has kernels for

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "kernels/cpu/isa.h"
#include "kernels/dtype.h"
#include "kernels/launch.h"

namespace tdx::ops {

inline kernels::ElementType element_type(const char* op, c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return kernels::ElementType::kFloat32;
    case c10::ScalarType::Double: return kernels::ElementType::kFloat64;
    case c10::ScalarType::BFloat16: return kernels::ElementType::kBFloat16;
    case c10::ScalarType::Half: return kernels::ElementType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, op, ": expected float32, float64, bfloat16 or float16, got ", type);
  }
}

// The dtype of kernels::accumulator_t for elements of `type`.
inline c10::ScalarType accumulation_dtype(c10::ScalarType type) {
  return type == c10::ScalarType::Double ? c10::ScalarType::Double : c10::ScalarType::Float;
}

template <typename Table>
const Table& kernels_for(const char* op, const c10::Device& device) {
  if (device.is_cpu()) return Table::cpu(kernels::active_cpu_isa());
#ifdef TDX_WITH_CUDA
  if (device.is_cuda()) return Table::cuda();
#endif
  TORCH_CHECK(false, op, ": this build of torchdist_ext has no kernels for ", device.type(),
              " tensors (CUDA kernels are built when torch is a CUDA build and a CUDA toolkit is found)");
}

// Runs kernel(args, launch) over work items [0, items) on `device`. The CPU
// splits the items over at::parallel_for tasks of at least `cpu_grain` items
// (one kernel call per task); a GPU gets one call for all items, enqueued on
// the device's current stream (under a guard for the device).
template <typename Args>
void launch(void (*kernel)(const Args&, const kernels::Launch&), const Args& args, const c10::Device& device,
            int64_t items, int64_t cpu_grain) {
  if (items == 0) return;
  if (device.is_cpu()) {
    at::parallel_for(0, items, std::max<int64_t>(1, cpu_grain), [&](int64_t begin, int64_t end) {
      kernel(args, kernels::Launch{begin, end, nullptr});
    });
    return;
  }
  const c10::DeviceGuard guard(device);
  const auto stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  kernel(args, kernels::Launch{0, items, stream.native_handle()});
}

}  // namespace tdx::ops

#ifdef TDX_WITH_CUDA
#define TDX_IMPL_ON_CUDA(register_ops) \
  TORCH_LIBRARY_IMPL(tdx, CUDA, m) { register_ops(m); }
#else
#define TDX_IMPL_ON_CUDA(register_ops)
#endif

// TDX_IMPL_ON_EVERY_DEVICE(register_family) { m.impl("op", &host_function); ... }
// defines register_family(torch::Library& m) and registers its ops for the CPU
// and, in CUDA builds, for CUDA: one host function per op, for every device.
#define TDX_IMPL_ON_EVERY_DEVICE(register_ops)                  \
  static void register_ops(torch::Library& m);                  \
  TORCH_LIBRARY_IMPL(tdx, CPU, m) { register_ops(m); }          \
  TDX_IMPL_ON_CUDA(register_ops)                                \
  static void register_ops(torch::Library& m)
