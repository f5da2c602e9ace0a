#include "comm/ring_pipeline.h"

#include <ATen/ATen.h>

namespace tdx::comm {

void for_each_ring_block(Ring& ring, const at::Tensor& local,
                         const std::function<void(const at::Tensor& block, int source)>& consume) {
  const int n = ring.size();
  at::Tensor buffers[2];
  if (n > 1) {
    buffers[0] = at::empty_like(local);
    buffers[1] = at::empty_like(local);
  }
  at::Tensor current = local;
  for (int step = 0; step < n; ++step) {
    PendingExchange pending;
    at::Tensor incoming;
    if (step + 1 < n) {
      incoming = buffers[step % 2];
      pending = ring.exchange(current, incoming);
    }
    consume(current, (ring.rank() - step + n) % n);
    pending.wait();
    current = incoming;
  }
}

RingReduceScatter::RingReduceScatter(Ring& ring, at::IntArrayRef sizes,
                                     const at::TensorOptions& options, Order order)
    : ring_(ring), order_(order) {
  buffers_[0] = at::empty(sizes, options);
  if (ring.size() > 1) {
    buffers_[1] = at::empty(sizes, options);
    arriving_ = at::empty(sizes, options);
  }
}

int RingReduceScatter::block() const {
  const int n = ring_.size();
  const int offset = order_ == Order::kOwnBlockLast ? 1 : 0;
  return ((ring_.rank() - step_ - offset) % n + n) % n;
}

void RingReduceScatter::pass() {
  const int n = ring_.size();
  TORCH_CHECK(step_ < n, "RingReduceScatter: pass() called more than size() = ", n, " times");
  const auto& sum = contribution();
  if (step_ > 0) {
    pending_.wait();  // the sum of this block so far has arrived (and the last one has left)
    sum.add_(arriving_);
  }
  const bool complete = order_ == Order::kOwnBlockLast && step_ == n - 1;
  if (n > 1 && !complete) pending_ = ring_.exchange(sum, arriving_);
  ++step_;
}

at::Tensor RingReduceScatter::result() {
  const int n = ring_.size();
  TORCH_CHECK(step_ == n, "RingReduceScatter: result() needs size() = ", n, " passes, got ", step_);
  if (n == 1 || order_ == Order::kOwnBlockLast) return buffers_[(n - 1) % 2];
  pending_.wait();  // the last hop: this rank's complete block
  return arriving_;
}

}  // namespace tdx::comm
