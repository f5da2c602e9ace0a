#pragma once
// FP8 casting: the kernel table and argument structs shared by the host
// (csrc/ops/fp8.cpp), the CPU kernels (kernels/cpu/fp8.cpp) and the CUDA kernels
// (kernels/cuda/fp8.cu), and the one float -> fp8 conversion both devices use.
//
// A cast scales each element by `scale` in fp32 and saturates every finite
// element to the format's largest finite value (+-448 for e4m3, +-57344 for e5m2),
// also where the product overflows fp32; an inf or NaN element becomes NaN (so a
// non-finite input always reaches the loss). Rounding is to nearest even. The amax is the largest |x| before scaling, NaN if any element is
// NaN and inf if any is infinite: it ignores nothing.

#include <cstdint>
#include <cstring>

#include "kernels/cpu/isa.h"
#include "kernels/dtype.h"
#include "kernels/host_device.h"
#include "kernels/launch.h"


namespace tdx::kernels {

enum class Fp8Format { kE4M3, kE5M2 };  // torch.float8_e4m3fn, torch.float8_e5m2

TDX_HOST_DEVICE uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
#endif
}

TDX_HOST_DEVICE float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

// Round to nearest even from a value already saturated to the format's range, or NaN: c10's
// fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value on that range (so the bytes equal torch's
// .to(float8_*)), written with selects instead of branches so that the CPU loops vectorize.
// mantissa_bits 3 (e4m3, bias 7, normals from 2^-6) or 2 (e5m2, bias 15, normals from 2^-14).
template <int kMantissaBits, int kBias>
TDX_HOST_DEVICE uint8_t fp8_from_saturated(float v) {
  constexpr int kShift = 23 - kMantissaBits;
  constexpr uint32_t kSmallestNormal = static_cast<uint32_t>(127 - kBias + 1) << 23;
  constexpr uint32_t kDenormMask = static_cast<uint32_t>(127 - kBias + kShift + 1) << 23;
  uint32_t bits = float_bits(v);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  // Below the smallest normal: the fp32 add rounds the value onto the subnormal grid.
  const uint32_t subnormal = float_bits(bits_float(bits) + bits_float(kDenormMask)) - kDenormMask;
  const uint32_t odd = (bits >> kShift) & 1u;
  const uint32_t normal =
      (bits + (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (kShift - 1)) - 1u) + odd) >> kShift;
  const uint32_t magnitude = bits > 0x7F800000u ? 0x7fu : bits < kSmallestNormal ? subnormal : normal;
  return static_cast<uint8_t>(magnitude | (sign >> 24));
}

TDX_HOST_DEVICE float fp8_max(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

// The cast of one element x: x * scale saturated when x is finite (an overflowing product saturates
// too), NaN when x is inf or NaN.
TDX_HOST_DEVICE uint8_t to_fp8(float x, float scale, Fp8Format format) {
  const float limit = fp8_max(format);
  const bool finite = (float_bits(x) & 0x7FFFFFFFu) < 0x7F800000u;  // false for inf and NaN
  const float scaled = x * scale;
  float v = scaled > limit ? limit : scaled < -limit ? -limit : scaled;
  if (!finite) v = bits_float(0x7FC00000u);
  return format == Fp8Format::kE4M3 ? fp8_from_saturated<3, 7>(v) : fp8_from_saturated<2, 15>(v);
}

// out[i] = to_fp8(x[i], *scale); partial_amax[item] = max |x[i]| over the item's
// elements (NaN if one is NaN). Work items: chunks of `chunk` elements (the last
// may be shorter).
struct CastAmaxArgs {
  ElementType type;  // of x: fp32, bf16 or fp16
  Fp8Format format;
  int64_t count;
  int64_t chunk;
  const void* x;
  const float* scale;    // one value, on the device
  uint8_t* out;          // [count]
  float* partial_amax;   // [ceil(count / chunk)]
};

// The cast of a matrix in both orientations, for the fp8 GEMMs' operands (torch._scaled_mm takes its second
// operand column-major): x [rows, cols] row-major -> out [rows, cols] as cast_amax writes it, and
// out_t [cols, ld_t] with out_t[c * ld_t + r] = out[r * cols + c] (ld_t >= rows; columns r >= rows of
// out_t are not written), partial_amax[item] = max |x| over the item's tile (NaN if one is NaN). Work
// items: tiles of kFp8Tile x kFp8Tile elements, row-major over the tile grid (ceil(cols / kFp8Tile) per
// tile row). One read of x, both orientations written from it.
constexpr int64_t kFp8Tile = 32;

struct CastTransposeAmaxArgs {
  ElementType type;  // of x: fp32, bf16 or fp16
  Fp8Format format;
  int64_t rows;
  int64_t cols;
  int64_t ld_t;  // out_t's row length
  const void* x;
  const float* scale;   // one value, on the device
  uint8_t* out;         // [rows, cols]
  uint8_t* out_t;       // [cols, ld_t]
  float* partial_amax;  // [tiles]
};

// The scale of one block of a blockwise cast: fp8_max / max(amax, eps) (FLT_MAX where that overflows),
// rounded down to a power of two when power_of_2 (the scale then multiplies exactly); 1 where the amax is
// inf or NaN (the cast then carries the NaN on, as a tensorwise current scale does).
TDX_HOST_DEVICE float block_scale(float amax, float eps, Fp8Format format, bool power_of_2) {
  if (!(amax <= 3.402823466e38f)) return 1.0f;  // inf, or NaN (every comparison with NaN is false)
  float scale = fp8_max(format) / (amax > eps ? amax : eps);
  if (!(scale <= 3.402823466e38f)) scale = 3.402823466e38f;
  if (power_of_2) scale = bits_float(float_bits(scale) & 0xFF800000u);  // positive: keep the exponent
  return scale;
}

// A cast with one scale per block of block_rows x block_cols elements of x [rows, cols] (row-major; the
// blocks at the bottom and right edges may be smaller): rowwise scaling is 1 x cols blocks, columnwise
// rows x 1, DeepSeek-V3's 1 x 128 activation tiles and 128 x 128 weight blocks. Each block: its amax (NaN
// wins), its block_scale, every element to_fp8 with it into out [rows, cols]; inverse_scale[block] =
// 1 / scale, the block grid row-major ([ceil(rows / block_rows), ceil(cols / block_cols)]). Work items:
// blocks, row-major over the grid.
struct CastBlockwiseArgs {
  ElementType type;  // of x: fp32, bf16 or fp16
  Fp8Format format;
  int64_t rows;
  int64_t cols;
  int64_t block_rows;
  int64_t block_cols;
  float eps;
  bool power_of_2;
  const void* x;
  uint8_t* out;           // [rows, cols]
  float* inverse_scale;   // [ceil(rows / block_rows), ceil(cols / block_cols)]
};

struct Fp8Kernels {
  void (*cast_amax)(const CastAmaxArgs&, const Launch&);
  void (*cast_transpose_amax)(const CastTransposeAmaxArgs&, const Launch&);
  void (*cast_blockwise)(const CastBlockwiseArgs&, const Launch&);

  static const Fp8Kernels& cpu(CpuIsa isa);  // kernels/cpu/fp8.cpp
  static const Fp8Kernels& cuda();           // kernels/cuda/fp8.cu (CUDA builds)
};

}  // namespace tdx::kernels
