// Ring attention, document attention and lse_merge_, host side for every device.
//
// Each rank keeps its query block; key/value blocks (at kv heads, stacked into
// one [2, B, Hkv, S, D] buffer) travel the ring (comm::for_each_ring_block), so
// the transfer of the next block overlaps the attention of the current one.
// Partial results are merged by log-sum-exp (the lse_merge kernel). The backward
// sends the key/value blocks around again and the dK/dV sums travel with them
// (comm::RingReduceScatter): a rank adds its contribution to a block's running
// sum while the next one is in flight; one last hop returns each sum to its owner.
//
// The sequence is sharded in either order of ops/sequence_order.h. Each block
// is attended as the tasks of ops/attention_plan.h: fully masked causal blocks
// are skipped and only the diagonal block uses the causal kernel. With
// document_ids (packed sequences, padding) every rank all-gathers the ring's
// ids once per op (a few bytes per token) and each block is cut into the
// rectangles where query and key documents agree: blocks no document spans are
// skipped, padding rows are never touched (their output and gradients are 0).
// document_attention_fwd / _bwd run the same tasks on one rank's whole sequence
// (Ulysses' local attention). With positions (a balanced sequence plan's shards,
// ops/sequence_plan.h) the rows carry their global positions, gathered like the
// ids, and the causal mask compares them (plan_by_position).

#include <ATen/ATen.h>

#include <limits>
#include <string>
#include <vector>

#include "comm/agreement.h"
#include "comm/ring_pipeline.h"
#include "kernels/attention.h"
#include "ops/attention_plan.h"
#include "ops/device.h"
#include "ops/sequence_order.h"
#include "ops/sequence_plan.h"

namespace tdx::ops {
namespace {

constexpr const char* kForward = "ring_attention_fwd";
constexpr const char* kBackward = "ring_attention_bwd";
constexpr const char* kMerge = "lse_merge_";
constexpr const char* kDocumentForward = "document_attention_fwd";
constexpr const char* kDocumentBackward = "document_attention_bwd";

using Order = SequenceOrder;

void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Order order) {
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
      order == Order::kContiguous || q.size(2) % 2 == 0, op, ": the zigzag order needs an even local ",
      "sequence (two chunks per rank), got ", q.size(2));
}

// ---- block attention: ATen's kernels that return log-sum-exp, by device ----
// CPU: the flash-attention kernel (it takes fewer kv heads than q heads).
// CUDA: flash attention for float16 / bfloat16 and the memory-efficient kernel
// for float32 (flash has no float32); both are given q's head count: kv heads
// are expanded for the kernel only (they travel at kv heads) and the block's
// dK/dV summed back over each group. The memory-efficient kernel's lse rows are
// padded to a multiple of 32 (and it serves head sizes flash does not). (On an H200 with torch 2.11, half-precision
// gradients of these ops through the memory-efficient backward were wrong, by up
// to 5 where the values are ~0.1, while the same ATen calls made directly from
// Python were right; the cause was not found. Through flash they pass
// tests/ops/test_cuda.py.)

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
  TORCH_CHECK(q.is_cpu() || q.is_cuda(), "ring_attention / document_attention: no block attention kernel for ",
              q.device(), " tensors");
  TORCH_CHECK_TYPE(
      q.is_cpu() || q.scalar_type() != at::kDouble, "ring_attention / document_attention on CUDA: float64 is not ",
      "supported by the block kernels; use float32, bfloat16 or float16");
}

// Flash attention's own limits (ATen's flash kernel pads nothing): head_dim a multiple of 8, at most 256; it
// also needs an Ampere or newer GPU, which our CUDA builds target (setup.py: 8.0 and up).
bool uses_flash(const at::Tensor& q) {
  const int64_t head_dim = q.size(-1);
  return q.is_cuda() && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) && head_dim % 8 == 0 &&
         head_dim <= 256;
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
  if (uses_flash(q)) {
    // Flash aligns a causal mask bottom-right, the memory-efficient kernel top-left: the same on the square
    // blocks the plan gives causal tasks (ops/attention_plan.h).
    TORCH_CHECK(!causal || q.size(2) == k.size(2), "block attention: a causal block must be square, got ",
                q.size(2), " query and ", k.size(2), " key rows");
    auto result = at::_scaled_dot_product_flash_attention(q, expand_heads(k, q_heads), expand_heads(v, q_heads), 0.0,
                                                          causal, /*return_debug_mask=*/false, scale);
    return {std::get<0>(result).contiguous(), std::get<1>(result).narrow(2, 0, q.size(2)).contiguous()};
  }
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
  const auto unused_rng = at::empty({}, at::TensorOptions().dtype(at::kLong));  // dropout is 0
  if (uses_flash(q)) {
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(), q.contiguous(), expand_heads(k, q_heads).contiguous(),
        expand_heads(v, q_heads).contiguous(), out.contiguous(), lse.contiguous(), /*cum_seq_q=*/at::Tensor(),
        /*cum_seq_k=*/at::Tensor(), rows, k.size(2), 0.0, causal, unused_rng, unused_rng, scale);
    return {dq, sum_head_groups(dk, k.size(1)), sum_head_groups(dv, v.size(1))};
  }
  const int64_t padded = (rows + kCudaLseAlignment - 1) / kCudaLseAlignment * kCudaLseAlignment;
  auto lse_padded = at::zeros({lse.size(0), lse.size(1), padded}, lse.options().dtype(at::kFloat));
  lse_padded.narrow(2, 0, rows).copy_(lse);
  auto [dq, dk, dv, dbias] = at::_scaled_dot_product_efficient_attention_backward(
      grad_out.contiguous(), q.contiguous(), expand_heads(k, q_heads).contiguous(),
      expand_heads(v, q_heads).contiguous(), at::Tensor(), out.contiguous(), lse_padded, unused_rng, unused_rng, 0.0,
      {true, true, true, false}, causal, scale);
  return {dq, sum_head_groups(dk, k.size(1)), sum_head_groups(dv, v.size(1))};
}

// ---- the merge ----

// The lse_merge_ operands as a kernels::MergeShape: out [..., rows, dim] and lse [..., rows] in the
// accumulation dtype with dense rows and leading dims that collapse into one stride (a slice of rows
// of a contiguous tensor); block_out / block_lse contiguous, of the same shapes.
kernels::MergeShape merge_shape(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
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
  const auto shape = merge_shape(out, lse, block_out, block_lse);
  const kernels::LseMergeArgs args{shape, out.data_ptr(), lse.data_ptr(), block_out.data_ptr(),
                                   block_lse.data_ptr()};
  launch(kernels_for<kernels::AttentionKernels>(kMerge, out.device()).lse_merge, args, out.device(), shape.groups,
         16384 / std::max<int64_t>(1, shape.rows * shape.dim));
}

// ---- tasks: block attention over row rectangles (ops/attention_plan.h) ----

at::Tensor query_rows(const at::Tensor& t, const AttentionTask& task) {
  const auto rows = task.batch < 0 ? t : t.narrow(0, task.batch, 1);
  return rows.narrow(2, task.q_start, task.q_len);
}

at::Tensor key_rows(const at::Tensor& t, const AttentionTask& task) {
  const auto rows = task.batch < 0 ? t : t.narrow(0, task.batch, 1);
  return rows.narrow(2, task.kv_start, task.kv_len);
}

// Merges the task's attention into the accumulators out / lse (fp32 or fp64, like q's rows).
void attend(const AttentionTask& task, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& out, const at::Tensor& lse, double scale) {
  auto [block_out, block_lse] =
      block_forward(query_rows(q, task), key_rows(k, task), key_rows(v, task), task.causal, scale);
  lse_merge_(query_rows(out, task), query_rows(lse, task), block_out, block_lse);
}

// Adds the task's gradients to dq (at q's rows) and dk / dv (at k's rows).
void attend_backward(const AttentionTask& task, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq,
                     const at::Tensor& dk, const at::Tensor& dv, double scale) {
  const auto rows = [&](const at::Tensor& t) { return query_rows(t, task); };
  auto [dq_block, dk_block, dv_block] = block_backward(rows(grad_out), rows(q), key_rows(k, task),
                                                       key_rows(v, task), rows(out), rows(lse), task.causal, scale);
  rows(dq).add_(dq_block);
  key_rows(dk, task).add_(dk_block);
  key_rows(dv, task).add_(dv_block);
}

// ---- document ids ----

// document_ids and positions: [batch, seq_local] integers on q's device.
void check_token_rows(const char* op, const char* name, const at::Tensor& rows, const at::Tensor& q) {
  TORCH_CHECK_TYPE(
      at::isIntegralType(rows.scalar_type(), /*includeBool=*/false), op, ": ", name,
      " must be an integer tensor, got ", rows.scalar_type());
  TORCH_CHECK(
      rows.dim() == 2 && rows.size(0) == q.size(0) && rows.size(1) == q.size(2), op, ": ", name, " ", rows.sizes(),
      " must be [batch, seq_local] = [", q.size(0), ", ", q.size(2), "]");
  TORCH_CHECK(rows.device() == q.device(), op, ": ", name, " must be on q's device (", q.device(), "), got ",
              rows.device());
}

void check_document_ids(const char* op, const at::Tensor& ids, const at::Tensor& q) {
  check_token_rows(op, "document_ids", ids, q);
}

void check_positions(const char* op, const std::optional<at::Tensor>& positions, const at::Tensor& q,
                     Order order) {
  if (!positions) return;
  check_token_rows(op, "positions", *positions, q);
  TORCH_CHECK_VALUE(order == Order::kContiguous, op, ": with positions the order must be 'contiguous' (the ",
                    "positions replace it), got 'zigzag'");
}

// The rows' document ids and positions of every ring rank: each [ring size, batch, seq_local] int64 on the host,
// undefined when not given (one small all-gather; a GPU's are copied to the host, which waits for them).
struct RingRows {
  at::Tensor ids, positions;
};

// positions [ranks, batch, seq_local] (host, int64): per batch row, the ranks' positions together must hold
// each of 0 .. ranks * seq_local - 1 once (a SequencePlan's shards). Every rank sees the same gathered
// positions, so every rank refuses alike: shards of plans made from different document ids on different
// ranks, or positions not from a plan, would otherwise attend silently wrong.
void check_positions_cover(const char* op, const at::Tensor& positions) {
  const int64_t ranks = positions.size(0), batch = positions.size(1), seq = positions.size(2);
  const int64_t total = ranks * seq;
  const int64_t* data = positions.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<char> seen(total, 0);
    for (int64_t r = 0; r < ranks; ++r) {
      for (int64_t i = 0; i < seq; ++i) {
        const int64_t p = data[(r * batch + b) * seq + i];
        TORCH_CHECK_VALUE(
            p >= 0 && p < total && !seen[p], op, ": positions of batch row ", b, " must hold each position 0..",
            total - 1, " exactly once over the ", ranks, " rank(s), but ", p, " (rank ", r, ", row ", i, ") is ",
            p < 0 || p >= total ? "out of range" : "held twice",
            ": pass the shards of one SequencePlan, made from the same document_ids on every rank");
        seen[p] = 1;
      }
    }
  }
}

RingRows gather_ring_rows(comm::Ring& ring, const std::optional<at::Tensor>& ids,
                          const std::optional<at::Tensor>& positions, const char* op) {
  std::vector<at::Tensor> given;
  if (ids) given.push_back(ids->to(at::kLong));
  if (positions) given.push_back(positions->to(at::kLong));
  if (given.empty()) return {};
  auto local = at::stack(given).contiguous();  // [fields, batch, seq_local]
  auto all = at::empty({ring.size() * local.size(0), local.size(1), local.size(2)}, local.options());  // rank-major
  ring.group()._allgather_base(all, local)->wait();
  all = all.to(at::kCPU).view({ring.size(), local.size(0), local.size(1), local.size(2)});
  RingRows rows;
  int64_t field = 0;
  if (ids) rows.ids = all.select(1, field++).contiguous();
  if (positions) {
    rows.positions = all.select(1, field).contiguous();
    check_positions_cover(op, rows.positions);
  }
  return rows;
}

// What every rank of the ring must agree on: every argument but the tensors' values.
comm::Agreement ring_call(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                          double scale, c10::string_view order, const std::optional<at::Tensor>& document_ids,
                          const std::optional<at::Tensor>& positions) {
  comm::Agreement call(op);
  call.tensor("q", q).tensor("k", k).tensor("v", v).flag("causal", causal).value("scale", scale);
  call.text("order", order).tensor("document_ids", document_ids).tensor("positions", positions);
  return call;
}

const int64_t* row_data(const at::Tensor& gathered, int rank) {
  return gathered.defined() ? gathered[rank].const_data_ptr<int64_t>() : nullptr;
}

// The tasks of the key block of ring rank `source`: by the gathered positions when given, else by the order,
// cut by the gathered documents when given.
std::vector<AttentionTask> ring_block_tasks(const comm::Ring& ring, int source, bool causal, Order order,
                                            int64_t batch, int64_t seq, const RingRows& rows) {
  if (rows.positions.defined()) {
    return plan_by_position(row_data(rows.positions, ring.rank()), row_data(rows.positions, source),
                            row_data(rows.ids, ring.rank()), row_data(rows.ids, source), batch, seq, causal);
  }
  auto tasks = plan_ring_block(causal, order == Order::kZigzag, ring.rank(), source, seq);
  if (!rows.ids.defined()) return tasks;
  return split_by_document(tasks, row_data(rows.ids, ring.rank()), row_data(rows.ids, source), batch, seq);
}

// ---- the ring ----

std::tuple<at::Tensor, at::Tensor> ring_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      c10::string_view group_name, bool causal, double scale,
                                                      c10::string_view order_name,
                                                      const std::optional<at::Tensor>& document_ids,
                                                      const std::optional<at::Tensor>& positions) {
  comm::Ring ring(group_name);
  Order order = Order::kContiguous;
  auto call = ring_call(kForward, q, k, v, causal, scale, order_name, document_ids, positions);
  call.check(ring.group(), q.device(), [&] {
    order = parse_sequence_order(kForward, order_name);
    check_qkv(kForward, q, k, v, order);
    if (document_ids) check_document_ids(kForward, *document_ids, q);
    check_positions(kForward, positions, q, order);
  });
  const int64_t seq = q.size(2);
  const auto acc_options = q.options().dtype(accumulation_dtype(q.scalar_type()));
  auto out = at::zeros(q.sizes(), acc_options);
  auto lse = at::full({q.size(0), q.size(1), seq}, -std::numeric_limits<double>::infinity(), acc_options);
  if (q.numel() == 0) return {out.to(q.scalar_type()), lse};  // no rows (the ATen kernels reject them)
  const auto rows = gather_ring_rows(ring, document_ids, positions, kForward);
  comm::for_each_ring_block(ring, at::stack({k, v}), [&](const at::Tensor& kv, int source) {
    for (const auto& task : ring_block_tasks(ring, source, causal, order, q.size(0), seq, rows)) {
      attend(task, q, kv[0], kv[1], out, lse, scale);
    }
  });
  return {out.to(q.scalar_type()), lse};
}

void check_backward_operands(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& out,
                             const at::Tensor& lse) {
  TORCH_CHECK(
      grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), op, ": grad_out ", grad_out.sizes(), " and out ",
      out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(
      lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2), op,
      ": lse ", lse.sizes(), " must be [batch, q heads, seq] = [", q.size(0), ", ", q.size(1), ", ", q.size(2), "]");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::string_view group_name, bool causal, double scale, c10::string_view order_name,
    const std::optional<at::Tensor>& document_ids, const std::optional<at::Tensor>& positions) {
  comm::Ring ring(group_name);
  Order order = Order::kContiguous;
  auto call = ring_call(kBackward, q, k, v, causal, scale, order_name, document_ids, positions);
  call.tensor("grad_out", grad_out).tensor("out", out).tensor("lse", lse).check(ring.group(), q.device(), [&] {
    order = parse_sequence_order(kBackward, order_name);
    check_qkv(kBackward, q, k, v, order);
    check_backward_operands(kBackward, grad_out, q, out, lse);
    if (document_ids) check_document_ids(kBackward, *document_ids, q);
    check_positions(kBackward, positions, q, order);
  });
  if (q.numel() == 0) return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v)};
  const auto rows = gather_ring_rows(ring, document_ids, positions, kBackward);
  const int64_t seq = q.size(2);
  const auto acc_options = q.options().dtype(accumulation_dtype(q.scalar_type()));
  auto dq = at::zeros(q.sizes(), acc_options);
  const auto kv_local = at::stack({k, v});
  comm::RingReduceScatter dkv(ring, kv_local.sizes(), acc_options,
                              comm::RingReduceScatter::Order::kOwnBlockFirst);
  comm::for_each_ring_block(ring, kv_local, [&](const at::Tensor& kv, int source) {
    const auto& partial = dkv.contribution();
    partial.zero_();
    for (const auto& task : ring_block_tasks(ring, source, causal, order, q.size(0), seq, rows)) {
      attend_backward(task, grad_out, q, kv[0], kv[1], out, lse, dq, partial[0], partial[1], scale);
    }
    dkv.pass();
  });
  const auto dkv_own = dkv.result();
  // dK and dV are copied out of the shared buffer so that the outputs do not alias.
  return {dq.to(q.scalar_type()), dkv_own[0].to(k.scalar_type(), false, /*copy=*/true),
          dkv_own[1].to(v.scalar_type(), false, /*copy=*/true)};
}

// ---- document attention on one rank (the Ulysses path: every token of the sequence, a head shard) ----

std::vector<AttentionTask> document_tasks(const char* op, const at::Tensor& document_ids,
                                          const std::optional<at::Tensor>& positions, bool causal) {
  const auto ids = document_ids.to(at::kCPU, at::kLong).contiguous();
  const int64_t seq = ids.size(1);
  if (positions) {
    const auto pos = positions->to(at::kCPU, at::kLong).contiguous();
    check_positions_cover(op, pos.unsqueeze(0));
    return plan_by_position(pos.const_data_ptr<int64_t>(), pos.const_data_ptr<int64_t>(), ids.const_data_ptr<int64_t>(),
                            ids.const_data_ptr<int64_t>(), ids.size(0), seq, causal);
  }
  return split_by_document(plan_ring_block(causal, false, 0, 0, seq), ids.const_data_ptr<int64_t>(),
                           ids.const_data_ptr<int64_t>(), ids.size(0), seq);
}

std::tuple<at::Tensor, at::Tensor> document_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const at::Tensor& document_ids,
                                                          bool causal, double scale,
                                                          const std::optional<at::Tensor>& positions) {
  check_qkv(kDocumentForward, q, k, v, Order::kContiguous);
  check_document_ids(kDocumentForward, document_ids, q);
  check_positions(kDocumentForward, positions, q, Order::kContiguous);
  const auto acc_options = q.options().dtype(accumulation_dtype(q.scalar_type()));
  auto out = at::zeros(q.sizes(), acc_options);
  auto lse = at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(), acc_options);
  if (q.numel() == 0) return {out.to(q.scalar_type()), lse};
  for (const auto& task : document_tasks(kDocumentForward, document_ids, positions, causal)) {
    attend(task, q, k, v, out, lse, scale);
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> document_attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& document_ids, bool causal, double scale,
    const std::optional<at::Tensor>& positions) {
  check_qkv(kDocumentBackward, q, k, v, Order::kContiguous);
  check_backward_operands(kDocumentBackward, grad_out, q, out, lse);
  check_document_ids(kDocumentBackward, document_ids, q);
  check_positions(kDocumentBackward, positions, q, Order::kContiguous);
  const auto acc_options = q.options().dtype(accumulation_dtype(q.scalar_type()));
  auto dq = at::zeros(q.sizes(), acc_options);
  auto dk = at::zeros(k.sizes(), acc_options);
  auto dv = at::zeros(v.sizes(), acc_options);
  if (q.numel() != 0) {
    for (const auto& task : document_tasks(kDocumentBackward, document_ids, positions, causal)) {
      attend_backward(task, grad_out, q, k, v, out, lse, dq, dk, dv, scale);
    }
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

// ---- the work report ----

at::Tensor context_attention_work(const at::Tensor& document_ids, int64_t ranks, c10::string_view order_name,
                                  bool causal) {
  constexpr const char* op = "context_attention_work";
  const Order order = parse_sequence_order(op, order_name);
  TORCH_CHECK_TYPE(
      at::isIntegralType(document_ids.scalar_type(), /*includeBool=*/false), op,
      ": document_ids must be an integer tensor, got ", document_ids.scalar_type());
  TORCH_CHECK_VALUE(document_ids.dim() == 2, op, ": document_ids must be [batch, seq], got ", document_ids.sizes());
  TORCH_CHECK_VALUE(ranks > 0, op, ": ranks must be positive, got ", ranks);
  const int64_t parts = order == Order::kZigzag ? 2 * ranks : ranks;
  TORCH_CHECK_VALUE(
      document_ids.size(1) % parts == 0, op, ": the sequence (", document_ids.size(1), ") must split into ", parts,
      " equal chunks for the ", std::string(order_name), " order over ", ranks, " ranks");
  const auto ids = document_ids.to(at::kCPU, at::kLong).contiguous();
  const auto work = ring_attention_work(ids.const_data_ptr<int64_t>(), ids.size(0), ids.size(1),
                                        static_cast<int>(ranks), order == Order::kZigzag, causal);
  return at::tensor(work, at::kLong).view({ranks, ranks});
}

// ---- the balanced sequence plan ----

std::tuple<at::Tensor, at::Tensor> balanced_sequence_plan(const at::Tensor& document_ids, int64_t ranks) {
  constexpr const char* op = "balanced_sequence_plan";
  TORCH_CHECK_TYPE(
      at::isIntegralType(document_ids.scalar_type(), /*includeBool=*/false), op,
      ": document_ids must be an integer tensor, got ", document_ids.scalar_type());
  TORCH_CHECK_VALUE(document_ids.dim() == 2, op, ": document_ids must be [batch, seq], got ", document_ids.sizes());
  TORCH_CHECK_VALUE(ranks > 0, op, ": ranks must be positive, got ", ranks);
  const int64_t batch = document_ids.size(0), seq = document_ids.size(1);
  TORCH_CHECK_VALUE(seq % ranks == 0, op, ": the sequence (", seq, ") must split into ", ranks,
                    " equal shards, one per rank");
  const auto ids = document_ids.to(at::kCPU, at::kLong).contiguous();
  auto indices = at::empty({batch, ranks, seq / ranks}, ids.options());
  auto costs = at::empty({batch, ranks}, ids.options());
  for (int64_t b = 0; b < batch; ++b) {
    const auto plan = balanced_row_plan(ids.const_data_ptr<int64_t>() + b * seq, seq, static_cast<int>(ranks));
    std::copy(plan.indices.begin(), plan.indices.end(), indices.mutable_data_ptr<int64_t>() + b * seq);
    std::copy(plan.costs.begin(), plan.costs.end(), costs.mutable_data_ptr<int64_t>() + b * ranks);
  }
  return {indices, costs};
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_attention) {
  m.impl("ring_attention_fwd", &ring_attention_fwd);
  m.impl("ring_attention_bwd", &ring_attention_bwd);
  m.impl("lse_merge_", &lse_merge_);
  m.impl("document_attention_fwd", &document_attention_fwd);
  m.impl("document_attention_bwd", &document_attention_bwd);
  m.impl("context_attention_work", &context_attention_work);  // the plan runs on the host: a CPU result
  m.impl("balanced_sequence_plan", &balanced_sequence_plan);  // likewise
}

}  // namespace tdx::ops
