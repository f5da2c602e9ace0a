#include "cpu_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace tdx {
namespace {

std::atomic<int64_t> allocated_bytes{0};
std::atomic<int64_t> peak_bytes{0};

void count(int64_t bytes) {
  const int64_t now = allocated_bytes.fetch_add(bytes) + bytes;
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
}

// Forwards to c10's CPU allocator. Its data pointers stay "simple" (the context is
// the data, as c10's own), so raw_allocate and copy-on-write clones keep working;
// the size of each live allocation is kept by address for the deleter.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner), inner_delete_(inner->raw_deleter()) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr data = inner_->allocate(n);
    if (data.get() == nullptr) return data;
    if (data.get() != data.get_context() || data.get_deleter() != inner_delete_) {
      return data;  // not the plain allocation c10's allocator makes: left uncounted
    }
    const auto device = data.device();
    void* ptr = data.release_context();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[ptr] = static_cast<int64_t>(n);
    }
    count(static_cast<int64_t>(n));
    return {ptr, ptr, &release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* ptr) {
    CountingCpuAllocator& self = *instance;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.sizes_.find(ptr);
      if (it != self.sizes_.end()) {
        bytes = it->second;
        self.sizes_.erase(it);
      }
    }
    count(-bytes);
    self.inner_delete_(ptr);
  }

  static CountingCpuAllocator* instance;

 private:
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_delete_;
  std::mutex mutex_;
  std::unordered_map<void*, int64_t> sizes_;
};

CountingCpuAllocator* CountingCpuAllocator::instance = nullptr;
std::mutex install_mutex;

}  // namespace

void track_cpu_memory() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (CountingCpuAllocator::instance != nullptr) return;
  c10::Allocator* inner = c10::GetCPUAllocator();
  if (inner->raw_deleter() == nullptr) {
    throw std::runtime_error("the CPU allocator in use has no raw deleter: its memory cannot be counted");
  }
  // Never freed: storages allocated through it may outlive every other object.
  CountingCpuAllocator::instance = new CountingCpuAllocator(inner);
  c10::SetCPUAllocator(CountingCpuAllocator::instance, /*priority=*/UINT8_MAX);
}

bool tracking_cpu_memory() { return CountingCpuAllocator::instance != nullptr; }

CpuMemoryStats cpu_memory_stats() { return {allocated_bytes.load(), peak_bytes.load()}; }

void reset_cpu_peak_memory() { peak_bytes.store(allocated_bytes.load()); }

}  // namespace tdx
