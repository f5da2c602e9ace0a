#pragma once
// Element loads and stores of the CUDA kernels: 16-bit floats are read as
// float and written from the accumulator with round-to-nearest-even.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

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

}  // namespace tdx::kernels::cuda
