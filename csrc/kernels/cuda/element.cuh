#pragma once
// Element types of the CUDA kernels: loads and stores (16-bit floats are read
// as float and written from the accumulator with round-to-nearest-even), and
// the launch of a kernel template for a run-time element type.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// Calls launch(static_cast<T*>(nullptr)) with the device type T of `type`
// (launch instantiates and launches its kernel for T), then check_launch.
template <typename Launch>
void launch_for(ElementType type, const char* kernel_name, Launch&& launch) {
  switch (type) {
    case ElementType::kFloat32: launch(static_cast<float*>(nullptr)); break;
    case ElementType::kFloat64: launch(static_cast<double*>(nullptr)); break;
    case ElementType::kBFloat16: launch(static_cast<__nv_bfloat16*>(nullptr)); break;
    case ElementType::kFloat16: launch(static_cast<__half*>(nullptr)); break;
  }
  check_launch(kernel_name);
}

}  // namespace tdx::kernels::cuda
