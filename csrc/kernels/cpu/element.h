#pragma once
// The element-type switch of the CPU kernels (the one place it is written).

#include <stdexcept>

#include "kernels/dtype.h"

namespace tdx::kernels::cpu {

// Calls visit(static_cast<T*>(nullptr)) with the storage type T of `type`:
// float, double, BFloat16 or Float16 (load() them, store() into them).
template <typename Visit>
inline void visit_element_type(ElementType type, Visit&& visit) {
  switch (type) {
    case ElementType::kFloat32: return visit(static_cast<float*>(nullptr));
    case ElementType::kFloat64: return visit(static_cast<double*>(nullptr));
    case ElementType::kBFloat16: return visit(static_cast<BFloat16*>(nullptr));
    case ElementType::kFloat16: return visit(static_cast<Float16*>(nullptr));
  }
  throw std::invalid_argument("unknown element type");
}

}  // namespace tdx::kernels::cpu
