// Ulysses re-sharding, host side for every device: one all-to-all trades a
// sequence shard for a head shard (and back). The head/sequence re-layout, and
// the zigzag chunk order (ops/sequence_order.h), are the pack into the
// per-destination send buffer and the unpack from the receive buffer: one copy
// each way, no other full copies. The head shard holds the sequence in order,
// whatever the cp order.

#include <ATen/ATen.h>

#include "comm/agreement.h"
#include "comm/all_to_all.h"
#include "comm/group.h"
#include "ops/device.h"
#include "ops/sequence_order.h"

namespace tdx::ops {
namespace {

constexpr const char* kSeqToHeads = "all_to_all_seq_to_heads";
constexpr const char* kHeadsToSeq = "all_to_all_heads_to_seq";

void check_4d(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, op, ": x must be [batch, heads, seq, head_dim], got ", x.sizes());
}

// x [B, H, S/N, D], rank r holding its `order` shard of the sequence -> [B, H/N, S, D], rank r holding
// heads block r of the whole sequence, in order.
at::Tensor all_to_all_seq_to_heads(const at::Tensor& x, c10::string_view group_name, c10::string_view order_name) {
  auto group = comm::group_by_name(group_name);
  const int64_t n = group->getSize();
  auto order = SequenceOrder::kContiguous;
  comm::Agreement(kSeqToHeads).tensor("x", x).text("order", order_name).check(*group, x.device(), [&] {
    check_4d(kSeqToHeads, x);
    order = parse_sequence_order(kSeqToHeads, order_name);
    TORCH_CHECK(x.size(1) % n == 0, kSeqToHeads, ": heads (", x.size(1), ") must be divisible by the group size ",
                n);
    TORCH_CHECK(
        order == SequenceOrder::kContiguous || x.size(2) % 2 == 0, kSeqToHeads,
        ": the zigzag order needs an even local sequence (two chunks per rank), got ", x.size(2));
  });
  const int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), dim = x.size(3);
  // pack: [N (destination = head block), B, H/N, S/N, D]
  const auto send = x.reshape({batch, n, heads / n, seq, dim}).permute({1, 0, 2, 3, 4}).contiguous();
  // [N (source = sequence shard), B, H/N, S/N, D]
  const auto received = comm::all_to_all_equal_blocks(*group, kSeqToHeads, "head blocks", send);
  if (order == SequenceOrder::kContiguous) {
    // unpack: [B, H/N, N, S/N, D] -> [B, H/N, S, D]
    return received.permute({1, 2, 0, 3, 4}).reshape({batch, heads / n, n * seq, dim}).contiguous();
  }
  // zigzag: source j's halves are chunks j and 2N-1-j of 2N.
  const auto halves = received.view({n, batch, heads / n, 2, seq / 2, dim});
  auto out = at::empty({batch, heads / n, 2 * n, seq / 2, dim}, x.options());
  out.narrow(2, 0, n).copy_(halves.select(3, 0).permute({1, 2, 0, 3, 4}));
  out.narrow(2, n, n).copy_(halves.select(3, 1).flip(0).permute({1, 2, 0, 3, 4}));
  return out.view({batch, heads / n, n * seq, dim});
}

// x [B, H/N, S, D] (the whole sequence in order) -> [B, H, S/N, D] in `order`: the inverse.
at::Tensor all_to_all_heads_to_seq(const at::Tensor& x, c10::string_view group_name, c10::string_view order_name) {
  auto group = comm::group_by_name(group_name);
  const int64_t n = group->getSize();
  auto order = SequenceOrder::kContiguous;
  comm::Agreement(kHeadsToSeq).tensor("x", x).text("order", order_name).check(*group, x.device(), [&] {
    check_4d(kHeadsToSeq, x);
    order = parse_sequence_order(kHeadsToSeq, order_name);
    const int64_t parts = order == SequenceOrder::kZigzag ? 2 * n : n;
    TORCH_CHECK(
        x.size(2) % parts == 0, kHeadsToSeq, ": seq (", x.size(2), ") must be divisible by ", parts,
        " (the group size ", n, order == SequenceOrder::kZigzag ? ", times 2 for the zigzag order)" : ")");
  });
  const int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), dim = x.size(3);
  const int64_t parts = order == SequenceOrder::kZigzag ? 2 * n : n;
  // pack: [N (destination = sequence shard), B, H/N, S/N, D]
  at::Tensor send;
  if (order == SequenceOrder::kContiguous) {
    send = x.reshape({batch, heads, n, seq / n, dim}).permute({2, 0, 1, 3, 4}).contiguous();
  } else {
    // zigzag: destination j gets chunks j and 2N-1-j of 2N.
    const auto chunks = x.reshape({batch, heads, 2 * n, seq / parts, dim});
    send = at::empty({n, batch, heads, 2, seq / parts, dim}, x.options());
    send.select(3, 0).copy_(chunks.narrow(2, 0, n).permute({2, 0, 1, 3, 4}));
    send.select(3, 1).copy_(chunks.narrow(2, n, n).flip(2).permute({2, 0, 1, 3, 4}));
    send = send.view({n, batch, heads, seq / n, dim});
  }
  // [N (source = head block), B, H/N, S/N, D]
  const auto received = comm::all_to_all_equal_blocks(*group, kHeadsToSeq, "sequence blocks", send);
  // unpack: [B, N, H/N, S/N, D] -> [B, H, S/N, D]
  return received.permute({1, 0, 2, 3, 4}).reshape({batch, n * heads, seq / n, dim}).contiguous();
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_all_to_all) {
  m.impl("all_to_all_seq_to_heads", &all_to_all_seq_to_heads);
  m.impl("all_to_all_heads_to_seq", &all_to_all_heads_to_seq);
}

}  // namespace tdx::ops
