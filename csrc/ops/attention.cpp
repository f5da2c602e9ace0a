// Ring attention and lse_merge_, host side for every device.
//
// Each rank keeps its query block; key/value blocks (at kv heads, stacked into
// one [2, B, Hkv, S, D] buffer) travel the ring (comm::for_each_ring_block), so
// the transfer of the next block overlaps the attention of the current one.
// Partial results are merged by log-sum-exp (the lse_merge kernel). The backward
// sends the key/value blocks around again and the dK/dV sums travel with them
// (comm::RingReduceScatter): a rank adds its contribution to a block's running
// sum while the next one is in flight; one last hop returns each sum to its owner.
//
// The sequence is sharded in either layout of ops/sequence_layout.h. Causal blocks that are fully masked are skipped; only the diagonal block
// uses the causal kernel.

#include <ATen/ATen.h>

#include <limits>

#include "comm/ring_pipeline.h"
#include "kernels/attention.h"
#include "ops/device.h"
#include "ops/sequence_layout.h"

namespace tdx::ops {
namespace {

constexpr const char* kForward = "ring_attention_fwd";
constexpr const char* kBackward = "ring_attention_bwd";
constexpr const char* kMerge = "lse_merge_";

using Layout = SequenceLayout;

void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Layout layout) {
  TORCH_CHECK(
      q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be [batch, heads, seq, head_dim], got ",
      q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k ", k.sizes(), " and v ", v.sizes(), " must have the same shape");
  TORCH_CHECK(
      q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), op, ": q ", q.sizes(),
      " and k ", k.sizes(), " must agree in batch, local sequence and head_dim");
  TORCH_CHECK(
      k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": q heads (", q.size(1),
      ") must be a positive multiple of kv heads (", k.size(1), ")");
  TORCH_CHECK(q.size(3) > 0, op, ": head_dim must be positive, got ", q.size(3));
  TORCH_CHECK_TYPE(
      q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
      ": q, k, v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), op, ": q, k, v must be on one device");
  element_type(op, q.scalar_type());
  TORCH_CHECK(
      layout == Layout::kContiguous || q.size(2) % 2 == 0, op, ": the zigzag layout needs an even local ",
      "sequence (two chunks per rank), got ", q.size(2));
}

// ---- block attention: ATen's kernels that return log-sum-exp, by device ----
// CPU: the flash-attention kernel (it takes fewer kv heads than q heads).
// CUDA: the memory-efficient kernel, which needs q's head count: kv heads are
// expanded for the kernel only (they travel at kv heads) and the block's dK/dV
// summed back over each group. Its lse rows are padded to a multiple of 32.

constexpr int64_t kCudaLseAlignment = 32;

at::Tensor expand_heads(const at::Tensor& kv, int64_t q_heads) {
  const int64_t kv_heads = kv.size(1);
  return kv_heads == q_heads ? kv : kv.repeat_interleave(q_heads / kv_heads, 1);
}

at::Tensor sum_head_groups(const at::Tensor& grad, int64_t kv_heads) {
  const int64_t q_heads = grad.size(1);
  if (q_heads == kv_heads) return grad;
  return grad.unflatten(1, {kv_heads, q_heads / kv_heads}).sum(2);
}

void check_block_device(const at::Tensor& q) {
  TORCH_CHECK(q.is_cpu() || q.is_cuda(), "ring_attention: no block attention kernel for ", q.device(), " tensors");
  TORCH_CHECK_TYPE(
      q.is_cpu() || q.scalar_type() != at::kDouble, "ring_attention on CUDA: float64 is not supported by the ",
      "block kernels; use float32, bfloat16 or float16");
}

// (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] contiguous, in the accumulation dtype).
std::tuple<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 bool causal, double scale) {
  check_block_device(q);
  if (q.is_cpu()) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, std::nullopt, scale);
    return {out.contiguous(), lse.contiguous()};
  }
  const int64_t q_heads = q.size(1);
  auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(
      q, expand_heads(k, q_heads), expand_heads(v, q_heads), std::nullopt, /*compute_log_sumexp=*/true, 0.0, causal,
      scale);
  return {out.contiguous(), lse.narrow(2, 0, q.size(2)).contiguous()};
}

// (dq, dk, dv) of one block given the *global* out and lse of these query rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  check_block_device(q);
  if (q.is_cpu()) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        0.0, causal, std::nullopt, scale);
  }
  const int64_t q_heads = q.size(1);
  const int64_t rows = q.size(2);
  const int64_t padded = (rows + kCudaLseAlignment - 1) / kCudaLseAlignment * kCudaLseAlignment;
  auto lse_padded = at::zeros({lse.size(0), lse.size(1), padded}, lse.options().dtype(at::kFloat));
  lse_padded.narrow(2, 0, rows).copy_(lse);
  const auto unused_rng = at::empty({}, at::TensorOptions().dtype(at::kLong));  // dropout is 0
  auto [dq, dk, dv, dbias] = at::_scaled_dot_product_efficient_attention_backward(
      grad_out.contiguous(), q.contiguous(), expand_heads(k, q_heads).contiguous(),
      expand_heads(v, q_heads).contiguous(), at::Tensor(), out.contiguous(), lse_padded, unused_rng, unused_rng, 0.0,
      {true, true, true, false}, causal, scale);
  return {dq, sum_head_groups(dk, k.size(1)), sum_head_groups(dv, v.size(1))};
}

// ---- the merge ----

// The lse_merge_ operands as a kernels::MergeLayout: out [..., rows, dim] and lse [..., rows] in the
// accumulation dtype with dense rows and leading dims that collapse into one stride (a slice of rows
// of a contiguous tensor); block_out / block_lse contiguous, of the same shapes.
kernels::MergeLayout merge_layout(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                                  const at::Tensor& block_lse) {
  TORCH_CHECK(out.dim() >= 2, kMerge, ": out must be [..., rows, dim], got ", out.sizes());
  TORCH_CHECK(
      lse.sizes() == out.sizes().slice(0, out.dim() - 1), kMerge, ": lse ", lse.sizes(),
      " must be out's shape without its last dim, ", out.sizes());
  TORCH_CHECK(
      block_out.sizes() == out.sizes() && block_lse.sizes() == lse.sizes(), kMerge, ": block_out ",
      block_out.sizes(), " and block_lse ", block_lse.sizes(), " must match out ", out.sizes(), " and lse ",
      lse.sizes());
  const auto type = element_type(kMerge, block_out.scalar_type());
  const auto acc = accumulation_dtype(block_out.scalar_type());
  TORCH_CHECK_TYPE(
      out.scalar_type() == acc && lse.scalar_type() == acc && block_lse.scalar_type() == acc, kMerge,
      ": out, lse and block_lse must be ", acc, " for a ", block_out.scalar_type(), " block, got ",
      out.scalar_type(), ", ", lse.scalar_type(), ", ", block_lse.scalar_type());
  TORCH_CHECK(
      out.device() == lse.device() && out.device() == block_out.device() && out.device() == block_lse.device(),
      kMerge, ": out, lse, block_out and block_lse must be on one device");
  TORCH_CHECK(
      block_out.is_contiguous() && block_lse.is_contiguous(), kMerge, ": block_out and block_lse must be contiguous");
  const int64_t dim = out.size(-1);
  const int64_t rows = out.size(-2);
  TORCH_CHECK(
      out.stride(-1) == 1 && (rows <= 1 || out.stride(-2) == dim) && lse.stride(-1) == 1, kMerge,
      ": out rows must be dense (stride(-1) == 1, stride(-2) == dim) and lse rows contiguous");
  int64_t groups = 1;
  for (int64_t d = 0; d < out.dim() - 2; ++d) groups *= out.size(d);
  int64_t out_group_stride = rows * dim, lse_group_stride = rows;
  if (out.dim() > 2) {
    out_group_stride = out.stride(-3);
    lse_group_stride = lse.stride(-2);
    for (int64_t d = 0; d + 3 < out.dim(); ++d) {
      TORCH_CHECK(
          out.stride(d) == out.stride(d + 1) * out.size(d + 1) && lse.stride(d) == lse.stride(d + 1) * lse.size(d + 1),
          kMerge, ": the leading dims of out and lse must be collapsible (a slice of rows of a contiguous tensor)");
    }
  }
  return {type, groups, rows, dim, out_group_stride, lse_group_stride, rows * dim, rows};
}

void lse_merge_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                const at::Tensor& block_lse) {
  const auto layout = merge_layout(out, lse, block_out, block_lse);
  const kernels::LseMergeArgs args{layout, out.data_ptr(), lse.data_ptr(), block_out.data_ptr(),
                                   block_lse.data_ptr()};
  launch(kernels_for<kernels::AttentionKernels>(kMerge, out.device()).lse_merge, args, out.device(), layout.groups,
         16384 / std::max<int64_t>(1, layout.rows * layout.dim));
}

// ---- the ring ----

// Which query rows attend to which key rows of the block that came from rank
// `source`, and whether with the causal kernel.
struct BlockPlan {
  bool skip = false;
  int64_t q_start = 0, q_len = 0, kv_start = 0, kv_len = 0;
  bool causal = false;
};

BlockPlan plan_block(bool causal, Layout layout, int rank, int source, int64_t seq) {
  BlockPlan all{false, 0, seq, 0, seq, false};
  if (!causal) return all;
  if (source == rank) {
    all.causal = true;  // the local chunks in sequence order: causal on their concatenation
    return all;
  }
  const int64_t half = seq / 2;
  if (layout == Layout::kContiguous) {
    if (source < rank) return all;  // an earlier chunk: fully visible
    return BlockPlan{true};         // a later chunk: fully masked
  }
  // zigzag: this rank holds chunks (r, 2N-1-r), the source (j, 2N-1-j).
  if (source < rank) return BlockPlan{false, 0, seq, 0, half, false};  // every query sees chunk j only
  return BlockPlan{false, half, half, 0, seq, false};                   // only chunk 2N-1-r sees both
}

std::tuple<at::Tensor, at::Tensor> ring_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      c10::string_view group_name, bool causal, double scale,
                                                      c10::string_view layout_name) {
  const Layout layout = parse_sequence_layout(kForward, layout_name);
  check_qkv(kForward, q, k, v, layout);
  const int64_t seq = q.size(2);
  const auto acc_options = q.options().dtype(accumulation_dtype(q.scalar_type()));
  auto out = at::zeros(q.sizes(), acc_options);
  auto lse = at::full({q.size(0), q.size(1), seq}, -std::numeric_limits<double>::infinity(), acc_options);
  if (q.numel() == 0) return {out.to(q.scalar_type()), lse};  // no rows (the ATen kernels reject them)
  comm::Ring ring(group_name);
  comm::for_each_ring_block(ring, kForward, "k/v block", at::stack({k, v}), [&](const at::Tensor& kv, int source) {
    const auto plan = plan_block(causal, layout, ring.rank(), source, seq);
    if (plan.skip) return;
    auto [block_out, block_lse] = block_forward(
        q.narrow(2, plan.q_start, plan.q_len), kv[0].narrow(2, plan.kv_start, plan.kv_len),
        kv[1].narrow(2, plan.kv_start, plan.kv_len), plan.causal, scale);
    lse_merge_(out.narrow(2, plan.q_start, plan.q_len), lse.narrow(2, plan.q_start, plan.q_len), block_out,
               block_lse);
  });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::string_view group_name, bool causal, double scale, c10::string_view layout_name) {
  const Layout layout = parse_sequence_layout(kBackward, layout_name);
  check_qkv(kBackward, q, k, v, layout);
  TORCH_CHECK(
      grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), kBackward, ": grad_out ", grad_out.sizes(),
      " and out ", out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(
      lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2), kBackward,
      ": lse ", lse.sizes(), " must be [batch, q heads, seq] = [", q.size(0), ", ", q.size(1), ", ", q.size(2), "]");
  if (q.numel() == 0) return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v)};
  comm::Ring ring(group_name);
  const int64_t seq = q.size(2);
  const auto acc_options = q.options().dtype(accumulation_dtype(q.scalar_type()));
  auto dq = at::zeros(q.sizes(), acc_options);
  const auto kv_local = at::stack({k, v});
  comm::RingReduceScatter dkv(ring, kBackward, "dk/dv sum", kv_local.sizes(), acc_options,
                              comm::RingReduceScatter::Order::kOwnBlockFirst);
  comm::for_each_ring_block(ring, kBackward, "k/v block", kv_local, [&](const at::Tensor& kv, int source) {
    const auto& partial = dkv.contribution();
    partial.zero_();
    const auto plan = plan_block(causal, layout, ring.rank(), source, seq);
    if (!plan.skip) {
      const auto rows = [&](const at::Tensor& t) { return t.narrow(2, plan.q_start, plan.q_len); };
      const auto keys = [&](const at::Tensor& t) { return t.narrow(2, plan.kv_start, plan.kv_len); };
      auto [dq_block, dk_block, dv_block] = block_backward(rows(grad_out), rows(q), keys(kv[0]), keys(kv[1]),
                                                           rows(out), rows(lse), plan.causal, scale);
      rows(dq).add_(dq_block);
      keys(partial[0]).add_(dk_block);
      keys(partial[1]).add_(dv_block);
    }
    dkv.pass();
  });
  const auto dkv_own = dkv.result();
  // dK and dV are copied out of the shared buffer so that the outputs do not alias.
  return {dq.to(q.scalar_type()), dkv_own[0].to(k.scalar_type(), false, /*copy=*/true),
          dkv_own[1].to(v.scalar_type(), false, /*copy=*/true)};
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_attention) {
  m.impl("ring_attention_fwd", &ring_attention_fwd);
  m.impl("ring_attention_bwd", &ring_attention_bwd);
  m.impl("lse_merge_", &lse_merge_);
}

}  // namespace tdx::ops
