#pragma once
// The two exchange patterns of the ring ops, written once. Both are double-
// buffered: while the caller computes on the current block, the next block
// (or the running sum it just passed on) is in flight between neighbours.
//
//   for_each_ring_block   all-gather as a ring: every rank's block visits every
//                         rank (all_gather_matmul, all_gather_weight_grad, the
//                         K/V blocks of ring attention)
//   RingReduceScatter     reduce-scatter as a ring: each block's running sum
//                         travels the ring and every rank adds its contribution
//                         as it passes (matmul_reduce_scatter, ring attention's
//                         dK/dV)
//
// The ops that call them check first that every rank agrees on the call
// (comm/agreement.h).

#include <ATen/core/Tensor.h>

#include <functional>

#include "comm/ring.h"

namespace tdx::comm {

// Calls consume(block, source) once for every rank's `local` block (same shape
// and dtype on every rank): this rank's own first (source = rank), then those
// of rank - 1, rank - 2, ... as they arrive from prev(). The next block travels
// while consume() works on the current one; a block is valid only during its
// call.
void for_each_ring_block(Ring& ring, const at::Tensor& local,
                         const std::function<void(const at::Tensor& block, int source)>& consume);

// Sums, over all ranks, one contribution per block, and leaves each rank with
// its own block's sum. Per step: write this rank's contribution to block()
// into contribution(), then pass(); after size() steps, result() is the sum.
//
// Order of the blocks a rank contributes to:
//   kOwnBlockLast   rank - 1, rank - 2, ..., rank: the sum in hand after the
//                   last step is complete (no extra hop)
//   kOwnBlockFirst  rank, rank - 1, ..., rank + 1: for callers that can compute
//                   a block's contribution only when it arrives (ring attention:
//                   when the K/V block of that rank does); one last hop returns
//                   each sum to its owner
class RingReduceScatter {
 public:
  enum class Order { kOwnBlockLast, kOwnBlockFirst };

  // Sums have `sizes` and `options` on every rank.
  RingReduceScatter(Ring& ring, at::IntArrayRef sizes,
                    const at::TensorOptions& options, Order order);

  // The rank whose block the next contribution is for.
  int block() const;

  // Where the next contribution goes: fill it (its old contents are garbage).
  const at::Tensor& contribution() const { return buffers_[step_ % 2]; }

  // Adds the sum arriving from prev() to the contribution and, unless it is
  // complete, sends the result on to next().
  void pass();

  // This rank's block summed over every rank (after size() passes).
  at::Tensor result();

 private:
  Ring& ring_;
  Order order_;
  int step_ = 0;
  at::Tensor buffers_[2];
  at::Tensor arriving_;
  PendingExchange pending_;
};

}  // namespace tdx::comm
