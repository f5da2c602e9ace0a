#include "ops/attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#include "comm/ring.h"
#include "kernels/cpu/attention.h"
#include "ops/element_type.h"

namespace tdx::ops {
namespace {

enum class Layout { kContiguous, kZigzag };

Layout parse_layout(const char* op, c10::string_view name) {
  if (name == "contiguous") return Layout::kContiguous;
  if (name == "zigzag") return Layout::kZigzag;
  TORCH_CHECK(false, op, ": layout must be 'contiguous' or 'zigzag', got '", std::string(name), "'");
}

c10::ScalarType accumulation_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(
      q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be [batch, heads, seq, head_dim], got ",
      q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k ", k.sizes(), " and v ", v.sizes(), " must have the same shape");
  TORCH_CHECK(
      q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), op, ": q ", q.sizes(),
      " and k ", k.sizes(), " must agree in batch, local sequence and head_dim");
  TORCH_CHECK(
      k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": q heads (", q.size(1),
      ") must be a multiple of kv heads (", k.size(1), ")");
  TORCH_CHECK(
      q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
      ": q, k, v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(
      q.device() == k.device() && q.device() == v.device(), op, ": q, k, v must be on one device");
  element_type(op, q.scalar_type());
}

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

void check_forward_args(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        Layout layout) {
  check_qkv(op, q, k, v);
  TORCH_CHECK(
      layout == Layout::kContiguous || q.size(2) % 2 == 0, op, ": the zigzag layout needs an even local ",
      "sequence (two chunks per rank), got ", q.size(2));
}

}  // namespace

MergeShape check_lse_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                           const at::Tensor& block_lse) {
  constexpr const char* op = "lse_merge_";
  TORCH_CHECK(out.dim() >= 2, op, ": out must be [..., rows, dim], got ", out.sizes());
  TORCH_CHECK(
      lse.sizes() == out.sizes().slice(0, out.dim() - 1), op, ": lse ", lse.sizes(),
      " must be out's shape without its last dim, ", out.sizes());
  TORCH_CHECK(
      block_out.sizes() == out.sizes() && block_lse.sizes() == lse.sizes(), op, ": block_out ",
      block_out.sizes(), " and block_lse ", block_lse.sizes(), " must match out and lse");
  const auto acc = accumulation_dtype(block_out);
  TORCH_CHECK_TYPE(
      out.scalar_type() == acc && lse.scalar_type() == acc && block_lse.scalar_type() == acc, op,
      ": out, lse and block_lse must be ", acc, " for a ", block_out.scalar_type(), " block");
  element_type(op, block_out.scalar_type());
  TORCH_CHECK(block_out.is_contiguous() && block_lse.is_contiguous(), op, ": block_out and block_lse must be contiguous");
  const int64_t dim = out.size(-1);
  const int64_t rows = out.size(-2);
  TORCH_CHECK(
      out.stride(-1) == 1 && (rows <= 1 || out.stride(-2) == dim) && lse.stride(-1) == 1, op,
      ": out rows must be dense (stride(-1) == 1, stride(-2) == dim) and lse rows contiguous");
  int64_t outer = 1;
  for (int64_t d = 0; d < out.dim() - 2; ++d) outer *= out.size(d);
  // The leading dims must collapse into one stride (true for a slice of rows of a contiguous tensor).
  int64_t out_outer_stride = rows * dim, lse_outer_stride = rows;
  if (out.dim() > 2) {
    out_outer_stride = out.stride(-3);
    lse_outer_stride = lse.stride(-2);
    for (int64_t d = 0; d + 3 < out.dim(); ++d) {
      TORCH_CHECK(
          out.stride(d) == out.stride(d + 1) * out.size(d + 1) && lse.stride(d) == lse.stride(d + 1) * lse.size(d + 1),
          op, ": the leading dims of out and lse must be collapsible (a slice of rows of a contiguous tensor)");
    }
  }
  return {outer, rows, dim, out_outer_stride, lse_outer_stride};
}

std::tuple<at::Tensor, at::Tensor> ring_attention_forward(
    const BlockAttention& block, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    c10::string_view group_name, bool causal, double scale, c10::string_view layout_name) {
  constexpr const char* op = "ring_attention_fwd";
  const Layout layout = parse_layout(op, layout_name);
  check_forward_args(op, q, k, v, layout);
  comm::Ring ring(group_name);
  const int n = ring.size();
  const int64_t seq = q.size(2);
  const auto acc_options = q.options().dtype(accumulation_dtype(q));
  auto out = at::zeros(q.sizes(), acc_options);
  auto lse = at::full({q.size(0), q.size(1), seq}, -std::numeric_limits<double>::infinity(), acc_options);
  at::Tensor kv[2] = {at::stack({k, v}), at::Tensor()};
  if (n > 1) kv[1] = at::empty_like(kv[0]);
  for (int step = 0; step < n; ++step) {
    const int source = (ring.rank() - step + n) % n;
    const auto& current = kv[step % 2];
    comm::PendingExchange pending;
    if (step + 1 < n) pending = ring.exchange(current, kv[(step + 1) % 2], step);
    const auto plan = plan_block(causal, layout, ring.rank(), source, seq);
    if (!plan.skip) {
      auto [block_out, block_lse] = block.forward(
          q.narrow(2, plan.q_start, plan.q_len), current[0].narrow(2, plan.kv_start, plan.kv_len),
          current[1].narrow(2, plan.kv_start, plan.kv_len), plan.causal, scale);
      block.merge(out.narrow(2, plan.q_start, plan.q_len), lse.narrow(2, plan.q_start, plan.q_len), block_out,
                  block_lse);
    }
    pending.wait();
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_attention_backward(
    const BlockAttention& block, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name, bool causal,
    double scale, c10::string_view layout_name) {
  constexpr const char* op = "ring_attention_bwd";
  const Layout layout = parse_layout(op, layout_name);
  check_forward_args(op, q, k, v, layout);
  TORCH_CHECK(
      grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), op, ": grad_out ", grad_out.sizes(), " and out ",
      out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(
      lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2), op,
      ": lse ", lse.sizes(), " must be [batch, q heads, seq]");
  comm::Ring ring(group_name);
  const int n = ring.size();
  const int64_t seq = q.size(2);
  const auto acc_options = q.options().dtype(accumulation_dtype(q));
  auto dq = at::zeros(q.sizes(), acc_options);
  at::Tensor kv[2] = {at::stack({k, v}), at::Tensor()};
  if (n > 1) kv[1] = at::empty_like(kv[0]);
  const auto dkv_sizes = kv[0].sizes();
  // `arriving` receives the running dK/dV sum of the next block (and, after
  // the last step, this rank's own complete dK/dV); `leaving` keeps the sum
  // in flight alive until its exchange completes.
  auto arriving = at::empty(dkv_sizes, acc_options);
  at::Tensor leaving;
  comm::PendingExchange dkv_pending;
  for (int step = 0; step < n; ++step) {
    const int source = (ring.rank() - step + n) % n;
    const auto& current = kv[step % 2];
    comm::PendingExchange kv_pending;
    if (step + 1 < n) kv_pending = ring.exchange(current, kv[(step + 1) % 2], 2 * step);
    auto partial = at::zeros(dkv_sizes, acc_options);
    const auto plan = plan_block(causal, layout, ring.rank(), source, seq);
    if (!plan.skip) {
      const auto rows = [&](const at::Tensor& t) { return t.narrow(2, plan.q_start, plan.q_len); };
      auto [dq_block, dk_block, dv_block] = block.backward(
          rows(grad_out), rows(q), current[0].narrow(2, plan.kv_start, plan.kv_len),
          current[1].narrow(2, plan.kv_start, plan.kv_len), rows(out), rows(lse), plan.causal, scale);
      rows(dq).add_(dq_block);
      partial[0].narrow(2, plan.kv_start, plan.kv_len).add_(dk_block);
      partial[1].narrow(2, plan.kv_start, plan.kv_len).add_(dv_block);
    }
    if (n == 1) {
      arriving = partial;
    } else {
      if (step > 0) {
        dkv_pending.wait();
        partial.add_(arriving);
      }
      leaving = partial;
      dkv_pending = ring.exchange(leaving, arriving, 2 * step + 1);
    }
    kv_pending.wait();
  }
  dkv_pending.wait();
  // dK and dV are copied out of the shared buffer so that the outputs do not alias.
  return {dq.to(q.scalar_type()), arriving[0].to(k.scalar_type(), false, /*copy=*/true),
          arriving[1].to(v.scalar_type(), false, /*copy=*/true)};
}

namespace {

std::tuple<at::Tensor, at::Tensor> cpu_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, double scale) {
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, std::nullopt, scale);
  return {out.contiguous(), lse.contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_block_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(
      grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
      0.0, causal, std::nullopt, scale);
}

void cpu_merge(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
               const at::Tensor& block_lse) {
  const auto shape = check_lse_merge(out, lse, block_out, block_lse);
  const auto type = element_type("lse_merge_", block_out.scalar_type());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, shape.rows * shape.dim));
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "lse_merge_", [&] {
    at::parallel_for(0, shape.outer, grain, [&](int64_t begin, int64_t end) {
      kernels::cpu::lse_merge<scalar_t>(
          type, out.data_ptr<scalar_t>(), shape.out_outer_stride, lse.data_ptr<scalar_t>(), shape.lse_outer_stride,
          block_out.data_ptr(), shape.rows * shape.dim, block_lse.data_ptr<scalar_t>(), shape.rows, begin, end,
          shape.rows, shape.dim);
    });
  });
}

const BlockAttention kCpuBlock{&cpu_block_forward, &cpu_block_backward, &cpu_merge};

std::tuple<at::Tensor, at::Tensor> cpu_ring_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    c10::string_view group_name, bool causal, double scale,
                                                    c10::string_view layout) {
  return ring_attention_forward(kCpuBlock, q, k, v, group_name, causal, scale, layout);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_ring_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::string_view group_name, bool causal, double scale, c10::string_view layout) {
  return ring_attention_backward(kCpuBlock, grad_out, q, k, v, out, lse, group_name, causal, scale, layout);
}

}  // namespace

TORCH_LIBRARY_IMPL(tdx, CPU, m) {
  m.impl("ring_attention_fwd", &cpu_ring_forward);
  m.impl("ring_attention_bwd", &cpu_ring_backward);
  m.impl("lse_merge_", &cpu_merge);
}

}  // namespace tdx::ops
