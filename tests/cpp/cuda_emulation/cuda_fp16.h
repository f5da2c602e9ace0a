#pragma once
// Stand-in for CUDA's half: storage and the round-to-nearest-even conversions
// of kernels/dtype.h.
#include "cuda_runtime.h"
#include "kernels/dtype.h"

struct __half {
  uint16_t bits;
};

inline float __half2float(__half v) { return tdx::kernels::load(tdx::kernels::Float16{v.bits}); }
inline __half __float2half(float v) { return __half{tdx::kernels::to_float16(v).bits}; }
