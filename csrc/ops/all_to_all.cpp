#include "ops/all_to_all.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "comm/ring.h"

namespace tdx::ops {
namespace {

// Sends block j of `send` ([N, ...], block per destination) to rank j; returns [N, ...] by source.
at::Tensor exchange_blocks(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor& send) {
  auto received = at::empty_like(send);
  std::vector<int64_t> equal_splits;
  group->alltoall_base(received, send, equal_splits, equal_splits)->wait();
  return received;
}

void check_4d(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, op, ": x must be [batch, heads, seq, head_dim], got ", x.sizes());
}

}  // namespace

at::Tensor all_to_all_seq_to_heads(const at::Tensor& x, c10::string_view group_name) {
  constexpr const char* op = "all_to_all_seq_to_heads";
  check_4d(op, x);
  auto group = comm::group_by_name(group_name);
  const int64_t n = group->getSize();
  const int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), dim = x.size(3);
  TORCH_CHECK(heads % n == 0, op, ": heads (", heads, ") must be divisible by the group size ", n);
  // pack: [N (destination = head block), B, H/N, S/N, D]
  auto send = x.reshape({batch, n, heads / n, seq, dim}).permute({1, 0, 2, 3, 4}).contiguous();
  auto received = exchange_blocks(group, send);  // [N (source = sequence block), B, H/N, S/N, D]
  // unpack: [B, H/N, N, S/N, D] -> [B, H/N, S, D]
  return received.permute({1, 2, 0, 3, 4}).reshape({batch, heads / n, n * seq, dim}).contiguous();
}

at::Tensor all_to_all_heads_to_seq(const at::Tensor& x, c10::string_view group_name) {
  constexpr const char* op = "all_to_all_heads_to_seq";
  check_4d(op, x);
  auto group = comm::group_by_name(group_name);
  const int64_t n = group->getSize();
  const int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), dim = x.size(3);
  TORCH_CHECK(seq % n == 0, op, ": seq (", seq, ") must be divisible by the group size ", n);
  // pack: [N (destination = sequence block), B, H/N, S/N, D]
  auto send = x.reshape({batch, heads, n, seq / n, dim}).permute({2, 0, 1, 3, 4}).contiguous();
  auto received = exchange_blocks(group, send);  // [N (source = head block), B, H/N, S/N, D]
  // unpack: [B, N, H/N, S/N, D] -> [B, H, S/N, D]
  return received.permute({1, 0, 2, 3, 4}).reshape({batch, n * heads, seq / n, dim}).contiguous();
}

TORCH_LIBRARY_IMPL(tdx, CPU, m) {
  m.impl("all_to_all_seq_to_heads", &all_to_all_seq_to_heads);
  m.impl("all_to_all_heads_to_seq", &all_to_all_heads_to_seq);
}

}  // namespace tdx::ops
