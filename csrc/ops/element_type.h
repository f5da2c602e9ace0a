#pragma once
// at::ScalarType -> the torch-free kernels' ElementType.

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "kernels/dtype.h"

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

}  // namespace tdx::ops
