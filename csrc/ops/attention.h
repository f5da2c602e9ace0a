#pragma once
// Ring attention, host side shared by CPU and CUDA. Each rank keeps its query
// block; key/value blocks (at kv_heads, stacked into one [2, B, Hkv, S, D]
// buffer) travel the ring double-buffered, so the transfer of the next block
// overlaps the attention of the current one. Partial results are merged by
// log-sum-exp. The backward sends the key/value blocks around again and the
// dK/dV accumulators travel with them, as in the reduce-scatter ring: a rank
// computes its contribution while the running sum is in flight, adds it, and
// passes it on; one last hop returns each block's gradient to its owner.
//
// Layouts of the sequence over the N ranks (shards of S_local = S / N tokens):
//   contiguous  rank r holds chunk r of N.
//   zigzag      rank r holds chunks r and 2N-1-r of 2N (each S_local / 2 tokens),
//               which gives every rank the same causal work.
// Causal blocks that are fully masked are skipped; only the diagonal block
// uses the causal kernel.

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace tdx::ops {

// Attention of one query block against one key/value block (kv heads may be
// fewer than query heads), with the device's kernels.
struct BlockAttention {
  // (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] contiguous, fp32 or fp64 for fp64 inputs).
  std::tuple<at::Tensor, at::Tensor> (*forward)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool causal, double scale);
  // (dq, dk, dv) of this block given the *global* out and lse of these query rows.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*backward)(
      const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const at::Tensor& out, const at::Tensor& lse, bool causal, double scale);
  // Merges (block_out, block_lse) into the accumulator views (out [B, H, Sq, D], lse [B, H, Sq]).
  void (*merge)(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                const at::Tensor& block_lse);
};

std::tuple<at::Tensor, at::Tensor> ring_attention_forward(
    const BlockAttention& block, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    c10::string_view group_name, bool causal, double scale, c10::string_view layout);

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_attention_backward(
    const BlockAttention& block, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name, bool causal,
    double scale, c10::string_view layout);

// The lse_merge_ operands seen as `outer` groups of `rows` x `dim`: out [..., rows, dim] and
// lse [..., rows] in the accumulation dtype with dense rows and leading dims that collapse into
// one stride (a slice of rows of a contiguous tensor); block_out / block_lse contiguous, same shapes.
struct MergeShape {
  int64_t outer, rows, dim, out_outer_stride, lse_outer_stride;
};
MergeShape check_lse_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                           const at::Tensor& block_lse);

}  // namespace tdx::ops
