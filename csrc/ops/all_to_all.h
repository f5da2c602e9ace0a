#pragma once
// Ulysses re-sharding: one all-to-all trades a sequence shard for a head shard
// (and back). The head/sequence re-layout is the pack into the per-destination
// send buffer and the unpack from the receive buffer: one copy each way, no
// other full copies. Device-generic (ATen + c10d alltoall_base).

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace tdx::ops {

// x [B, H, S/N, D], rank r holding sequence block r -> [B, H/N, S, D], rank r holding heads block r.
at::Tensor all_to_all_seq_to_heads(const at::Tensor& x, c10::string_view group_name);

// x [B, H/N, S, D] -> [B, H, S/N, D]: the inverse.
at::Tensor all_to_all_heads_to_seq(const at::Tensor& x, c10::string_view group_name);

}  // namespace tdx::ops
