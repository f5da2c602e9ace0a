#pragma once
// Attention's partial-result merge: the kernel table and argument shape shared
// by the host (csrc/ops/attention.cpp), the CPU kernels (kernels/cpu/attention.cpp)
// and the CUDA kernels (kernels/cuda/attention.cu).
//
// Softmax attention over a union of key blocks equals the per-block results
// weighted by their log-sum-exp: with m = max(lse_a, lse_b),
//   lse = m + log(e^(lse_a - m) + e^(lse_b - m))
//   out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse).

#include <cstdint>

#include "kernels/cpu/isa.h"
#include "kernels/dtype.h"
#include "kernels/launch.h"

namespace tdx::kernels {

// `groups` independent groups (batch x heads) of `rows` query rows of `dim`
// features. Row i of group g of the accumulator starts at
// out + g * out_group_stride + i * dim (rows are dense within a group), its lse at
// lse + g * lse_group_stride + i; the block is laid out the same way with its
// own group strides. A launch's work items are groups.
struct MergeShape {
  ElementType block_type;  // of block_out; out, lse and block_lse are its accumulator type
  int64_t groups;
  int64_t rows;
  int64_t dim;
  int64_t out_group_stride;
  int64_t lse_group_stride;
  int64_t block_out_group_stride;
  int64_t block_lse_group_stride;
};

// Merges the block into the accumulator in place. An accumulator row with
// lse = -inf (nothing merged yet) takes the block as is; a block row with
// lse = -inf (no visible keys) leaves the accumulator unchanged.
struct LseMergeArgs {
  MergeShape shape;
  void* out;
  void* lse;
  const void* block_out;
  const void* block_lse;
};

struct AttentionKernels {
  void (*lse_merge)(const LseMergeArgs&, const Launch&);

  static const AttentionKernels& cpu(CpuIsa isa);  // kernels/cpu/attention.cpp
  static const AttentionKernels& cuda();           // kernels/cuda/attention.cu (CUDA builds)
};

}  // namespace tdx::kernels
