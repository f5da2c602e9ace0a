#pragma once
// Torch-free element types shared by the CPU and CUDA kernels. The ops layer
// maps at::ScalarType onto ElementType and passes raw pointers.

#include <cstdint>
#include <cstring>

namespace tdx::kernels {

enum class ElementType { kFloat32, kFloat64, kBFloat16, kFloat16 };

// What kernels accumulate elements of type T in (on either side: T may be a
// device type such as __nv_bfloat16): double for double, float otherwise.
template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};
template <typename T>
using accumulator_t = typename Accumulator<T>::type;

// Storage-only 16-bit floats (bit-compatible with at::BFloat16 / at::Half):
// kernels load() them as float and store() from float.
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

inline float load(float v) { return v; }
inline double load(double v) { return v; }

inline float load(BFloat16 v) {
  const uint32_t word = static_cast<uint32_t>(v.bits) << 16;
  float out;
  std::memcpy(&out, &word, sizeof(out));
  return out;
}

// IEEE 754 binary16 -> binary32, exact (normals, subnormals, inf, nan), with
// selects instead of branches so that loops over it vectorize.
inline float load(Float16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const uint32_t mantissa = v.bits & 0x3ffu;
  const uint32_t finite_word = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  const uint32_t special_word = sign | 0x7f800000u | (mantissa << 13);
  const uint32_t word = exponent == 0x1fu ? special_word : finite_word;
  float normal;
  std::memcpy(&normal, &word, sizeof(normal));
  const float subnormal = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // mantissa * 2^-24
  return exponent == 0 ? (sign ? -subnormal : subnormal) : normal;
}

// Round to nearest even; nan stays nan.
inline BFloat16 to_bfloat16(float v) {
  uint32_t word;
  std::memcpy(&word, &v, sizeof(word));
  const uint32_t rounded = (word + 0x7fffu + ((word >> 16) & 1u)) >> 16;
  const bool nan = (word & 0x7fffffffu) > 0x7f800000u;
  return BFloat16{static_cast<uint16_t>(nan ? 0x7fc0u : rounded)};  // a select, so loops vectorize
}

// Round to nearest even, overflow to inf, underflow through subnormals.
inline Float16 to_float16(float v) {
  uint32_t word;
  std::memcpy(&word, &v, sizeof(word));
  const uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  const uint32_t magnitude = word & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Float16{static_cast<uint16_t>(sign | 0x7e00u)};
  if (magnitude >= 0x477ff000u) return Float16{static_cast<uint16_t>(sign | 0x7c00u)};
  if (magnitude < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (magnitude < 0x33000000u) return Float16{sign};
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t half_mantissa = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u))) ++half_mantissa;
    return Float16{static_cast<uint16_t>(sign | half_mantissa)};
  }
  uint32_t rebased = magnitude - 0x38000000u;  // exponent bias 127 -> 15
  rebased += 0xfffu + ((rebased >> 13) & 1u);
  return Float16{static_cast<uint16_t>(sign | (rebased >> 13))};
}

// store(dst, value): writes an accumulator value into an element, rounding to
// the element type.
inline void store(float& dst, double v) { dst = static_cast<float>(v); }
inline void store(double& dst, double v) { dst = v; }
inline void store(BFloat16& dst, float v) { dst = to_bfloat16(v); }
inline void store(Float16& dst, float v) { dst = to_float16(v); }

}  // namespace tdx::kernels
