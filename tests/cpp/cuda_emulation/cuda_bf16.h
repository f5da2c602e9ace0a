#pragma once
// Stand-in for CUDA's bfloat16: storage and the round-to-nearest-even
// conversions of kernels/dtype.h.
#include "cuda_runtime.h"
#include "kernels/dtype.h"

struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 v) { return tdx::kernels::load(tdx::kernels::BFloat16{v.bits}); }
inline __nv_bfloat16 __float2bfloat16(float v) { return __nv_bfloat16{tdx::kernels::to_bfloat16(v).bits}; }
