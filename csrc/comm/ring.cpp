#include "comm/ring.h"

#include "comm/group.h"

#include <mutex>

namespace tdx::comm {
namespace {

// Keeps `works` (and so the buffers they hold) alive until the process exits.
void keep_until_exit(std::vector<c10::intrusive_ptr<c10d::Work>>&& works) {
  if (works.empty()) return;
  static std::mutex mutex;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Work>>();  // never destroyed, by design
  const std::lock_guard<std::mutex> lock(mutex);
  for (auto& work : works) kept->push_back(std::move(work));
  works.clear();
}

}  // namespace

PendingExchange& PendingExchange::operator=(PendingExchange&& other) noexcept {
  if (this != &other) {
    keep_until_exit(std::move(works_));
    works_ = std::move(other.works_);
    other.works_.clear();
  }
  return *this;
}

PendingExchange::~PendingExchange() { keep_until_exit(std::move(works_)); }

void PendingExchange::wait() {
  // Each work is dropped only once waited: if a wait throws, the rest stay in flight (and are kept).
  while (!works_.empty()) {
    works_.front()->wait();
    works_.erase(works_.begin());
  }
}

Ring::Ring(c10::string_view group_name)
    : group_(group_by_name(group_name)), rank_(group_->getRank()), size_(group_->getSize()) {}

PendingExchange Ring::exchange(const at::Tensor& send, const at::Tensor& recv) {
  const int tag = next_tag_++;
  std::vector<at::Tensor> send_list{send};
  std::vector<at::Tensor> recv_list{recv};
  const auto device = send.device().type();
  const bool coalesce = group_->getBackend(device)->supportsCoalescing();
  if (coalesce) {
    group_->startCoalescing(device);
  }
  // With an even rank sending first and an odd one receiving first, two ranks
  // that are each other's next and prev match their calls in order.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (rank_ % 2 == 0) {
    works.push_back(group_->send(send_list, next(), tag));
    works.push_back(group_->recv(recv_list, prev(), tag));
  } else {
    works.push_back(group_->recv(recv_list, prev(), tag));
    works.push_back(group_->send(send_list, next(), tag));
  }
  if (coalesce) {
    auto work = group_->endCoalescing(device);
    return PendingExchange(work ? std::vector{work} : std::vector<c10::intrusive_ptr<c10d::Work>>{});
  }
  return PendingExchange(std::move(works));
}

}  // namespace tdx::comm
