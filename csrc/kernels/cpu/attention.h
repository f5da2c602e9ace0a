#pragma once
// Torch-free CPU kernel of attention's partial-result merge. Softmax attention
// over a union of key blocks equals the per-block results weighted by their
// log-sum-exp: with m = max(lse_a, lse_b),
//   lse = m + log(e^(lse_a - m) + e^(lse_b - m))
//   out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse).
//
// Layout: `outer` independent groups (batch x heads) of `rows` query rows of
// `dim` features. Row i of group g of the accumulator starts at
// out + g * out_outer_stride + i * dim (rows are contiguous within a group);
// its lse at lse + g * lse_outer_stride + i. The block is laid out the same
// way with its own outer strides. Acc is float, or double for fp64 blocks.

#include <cstdint>

#include "kernels/dtype.h"

namespace tdx::kernels::cpu {

// Merges the block into the accumulator in place for groups [outer_begin, outer_end).
// An accumulator row with lse = -inf (nothing merged yet) takes the block as is;
// a block row with lse = -inf (no visible keys) leaves the accumulator unchanged.
template <typename Acc>
void lse_merge(ElementType block_type, Acc* out, int64_t out_outer_stride, Acc* lse, int64_t lse_outer_stride,
               const void* block_out, int64_t block_out_outer_stride, const Acc* block_lse,
               int64_t block_lse_outer_stride, int64_t outer_begin, int64_t outer_end, int64_t rows, int64_t dim);

}  // namespace tdx::kernels::cpu
