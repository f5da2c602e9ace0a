#pragma once
// Element types of the CUDA kernels: loads and stores (16-bit floats are read
// as float and written from the accumulator with round-to-nearest-even), and
// the switch from a run-time element type to a kernel template's type.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <type_traits>

#include "kernels/cuda/launch.cuh"
#include "kernels/dtype.h"

namespace tdx::kernels::cuda {

__device__ __forceinline__ float load(float v) { return v; }
__device__ __forceinline__ double load(double v) { return v; }
__device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float load(__half v) { return __half2float(v); }

template <typename T, typename Acc>
__device__ __forceinline__ T store_as(Acc v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

// The element-type switch of the CUDA kernels (the one place it is written):
// calls visit(static_cast<T*>(nullptr)) with the device type T of `type`
// (float, double, __nv_bfloat16, __half); visit instantiates and launches its
// kernel for T.
template <typename Visit>
void visit_element_type(ElementType type, Visit&& visit) {
  switch (type) {
    case ElementType::kFloat32: return visit(static_cast<float*>(nullptr));
    case ElementType::kFloat64: return visit(static_cast<double*>(nullptr));
    case ElementType::kBFloat16: return visit(static_cast<__nv_bfloat16*>(nullptr));
    case ElementType::kFloat16: return visit(static_cast<__half*>(nullptr));
  }
  throw std::invalid_argument("unknown element type");
}

}  // namespace tdx::kernels::cuda
