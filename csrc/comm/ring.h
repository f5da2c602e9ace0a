#pragma once
// Ring neighbours inside a process group: every rank sends to rank + 1 and
// receives from rank - 1 (group ranks, modulo the group size). The exchange
// patterns built on it are in comm/ring_pipeline.h.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <c10/util/string_view.h>
#include <vector>

namespace tdx::comm {

// One send-to-next plus receive-from-previous, in flight until wait().
//
// An exchange left unwaited (an exception between posting and waiting) is
// never freed: its works, which hold the send and receive buffers, are kept
// for the rest of the process. Gloo reads into a receive buffer from its own
// thread through a raw pointer; freeing the buffer while the peer's data may
// still arrive would let that thread write into freed memory, or wedge the
// link for every later message if the data arrives after the free.
class PendingExchange {
 public:
  PendingExchange() = default;
  explicit PendingExchange(std::vector<c10::intrusive_ptr<c10d::Work>> works) : works_(std::move(works)) {}
  PendingExchange(PendingExchange&& other) noexcept : works_(std::move(other.works_)) { other.works_.clear(); }
  PendingExchange& operator=(PendingExchange&& other) noexcept;
  PendingExchange(const PendingExchange&) = delete;
  PendingExchange& operator=(const PendingExchange&) = delete;
  ~PendingExchange();

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
  c10d::ProcessGroup& group() const { return *group_; }

  // Starts sending `send` to next() and receiving prev()'s tensor into `recv`
  // (same shape and dtype on every rank). Neither may be touched until wait().
  // Every exchange of a Ring gets the next message tag, so that several
  // pipelines may be in flight at once: every rank makes the same sequence of
  // exchanges, so the tags match. Backends that coalesce P2P (NCCL) get both
  // in one group, so that a two-rank ring cannot deadlock on a shared stream.
  PendingExchange exchange(const at::Tensor& send, const at::Tensor& recv);

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int size_;
  int next_tag_ = 0;
};

}  // namespace tdx::comm
