#pragma once
// Counter-based initialisation: the kernel table and argument struct shared by the host
// (csrc/ops/init.cpp), the CPU kernel (kernels/cpu/init.cpp) and the CUDA kernel (kernels/cuda/init.cu),
// and the function of an element's index both evaluate.
//
// Element i (its row-major index in the whole tensor) of a tensor initialised with (seed, key) is a function
// of (seed, key, i) alone: a block of the tensor, on any rank, holds exactly what the whole tensor holds
// there, whatever the layout that cut it (no generator state, no communication). The value is a normal
// N(mean, std^2) truncated to [a, b], by its inverse CDF: u uniform in (0, 1) from a 64-bit hash of the
// counter, p = low + u (high - low) with low, high the normal's CDF at a and b, and
// x = mean + std sqrt(2) erfinv(2 p - 1), clamped to [a, b] against rounding.

#include <math.h>

#include <cstdint>

#include "kernels/cpu/isa.h"
#include "kernels/dtype.h"
#include "kernels/host_device.h"
#include "kernels/launch.h"


namespace tdx::kernels {

constexpr int kMaxInitDims = 8;

// SplitMix64's finaliser: a bijection of 64-bit words whose output bits each depend on every input bit.
TDX_HOST_DEVICE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The stream of (seed, key): the host computes it once per tensor.
inline uint64_t counter_stream(uint64_t seed, uint64_t key) { return mix64(mix64(seed) ^ key); }

// u in (0, 1) for element `index` of `stream`: the top 24 bits of its hash, at the centre of their interval.
TDX_HOST_DEVICE float counter_uniform(uint64_t stream, uint64_t index) {
  const uint64_t bits = mix64(stream + (index + 1) * 0x9e3779b97f4a7c15ULL);
  return (static_cast<float>(bits >> 40) + 0.5f) * 5.9604644775390625e-8f;  // * 2^-24
}

// erfinv(y) for y in (-1, 1): Giles' single-precision approximation ("Approximating the erfinv function",
// GPU Computing Gems, 2011), relative error below 4e-7 (logf and sqrtf: the host's libm, CUDA's own).
TDX_HOST_DEVICE float erfinv_approx(float y) {
  float w = -logf((1.0f - y) * (1.0f + y));
  float p;
  if (w < 5.0f) {
    w = w - 2.5f;
    p = 2.81022636e-08f;
    p = 3.43273939e-07f + p * w;
    p = -3.5233877e-06f + p * w;
    p = -4.39150654e-06f + p * w;
    p = 0.00021858087f + p * w;
    p = -0.00125372503f + p * w;
    p = -0.00417768164f + p * w;
    p = 0.246640727f + p * w;
    p = 1.50140941f + p * w;
  } else {
    w = sqrtf(w) - 3.0f;
    p = -0.000200214257f;
    p = 0.000100950558f + p * w;
    p = 0.00134934322f + p * w;
    p = -0.00367342844f + p * w;
    p = 0.00573950773f + p * w;
    p = -0.0076224613f + p * w;
    p = 0.00943887047f + p * w;
    p = 1.00167406f + p * w;
    p = 2.83297682f + p * w;
  }
  return p * y;
}

// Element `index` of the truncated normal of `stream` (see the top of this file).
TDX_HOST_DEVICE float counter_trunc_normal(uint64_t stream, uint64_t index, float mean, float std, float a,
                                           float b, float low, float high) {
  const float p = low + counter_uniform(stream, index) * (high - low);
  const float x = mean + std * 1.41421356237f * erfinv_approx(2.0f * p - 1.0f);
  return x < a ? a : x > b ? b : x;
}

// A block of a row-major tensor of `ndim` dimensions (the whole tensor's strides `strides`), starting at
// `offsets` with shape `sizes`, written contiguously to `out` [rows, cols] (cols: the block's last dimension,
// rows: the product of the others). Work items: rows.
struct TruncNormalArgs {
  ElementType type;  // of out
  int ndim;          // 1 .. kMaxInitDims
  int64_t sizes[kMaxInitDims];
  int64_t offsets[kMaxInitDims];
  int64_t strides[kMaxInitDims];
  int64_t rows;
  int64_t cols;
  uint64_t stream;   // counter_stream(seed, key)
  float mean, std;   // of the normal before truncation
  float a, b;        // the truncation
  float low, high;   // the normal's CDF at a and b
  void* out;
};

// The whole tensor's row-major index of the first element of block row `row` (its last dimension's offset
// included).
TDX_HOST_DEVICE int64_t block_row_start(const TruncNormalArgs& args, int64_t row) {
  int64_t index = args.offsets[args.ndim - 1] * args.strides[args.ndim - 1];
  for (int d = args.ndim - 2; d >= 0; --d) {
    index += (args.offsets[d] + row % args.sizes[d]) * args.strides[d];
    row /= args.sizes[d];
  }
  return index;
}

struct InitKernels {
  void (*trunc_normal)(const TruncNormalArgs&, const Launch&);

  static const InitKernels& cpu(CpuIsa isa);  // kernels/cpu/init.cpp
  static const InitKernels& cuda();           // kernels/cuda/init.cu (CUDA builds)
};

}  // namespace tdx::kernels
