#pragma once
// Ring neighbours inside a process group resolved by name: every rank sends to
// rank + 1 and receives from rank - 1 (group ranks, modulo the group size).

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <c10/util/string_view.h>
#include <vector>

namespace tdx::comm {

// The process group registered under `group_name` (torch.distributed's
// `group.group_name`); fails with a message naming the group if none is.
c10::intrusive_ptr<c10d::ProcessGroup> group_by_name(c10::string_view group_name);

// One send-to-next plus receive-from-previous, in flight until wait().
class PendingExchange {
 public:
  PendingExchange() = default;
  explicit PendingExchange(std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : works_(std::move(works)) {}
  // Blocks (CPU) or makes the current stream wait (CUDA) until both finished.
  void wait();

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

class Ring {
 public:
  explicit Ring(c10::string_view group_name);

  int rank() const { return rank_; }
  int size() const { return size_; }
  int next() const { return (rank_ + 1) % size_; }
  int prev() const { return (rank_ + size_ - 1) % size_; }

  // Starts sending `send` to next() and receiving prev()'s tensor into `recv`
  // (same shape and dtype on every rank). Neither may be touched until wait().
  // Backends that coalesce P2P (NCCL) get both in one group, so that a
  // two-rank ring cannot deadlock on a shared stream.
  PendingExchange exchange(const at::Tensor& send, const at::Tensor& recv, int tag);

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int size_;
};

}  // namespace tdx::comm
