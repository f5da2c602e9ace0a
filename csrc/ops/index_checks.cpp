#include "ops/index_checks.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace tdx::ops {
namespace {

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> flag{[] {
    const char* value = std::getenv("TDX_INDEX_CHECKS");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }()};
  return flag;
}

}  // namespace

bool index_checks_enabled() { return enabled_flag().load(std::memory_order_relaxed); }

void set_index_checks(bool enabled) { enabled_flag().store(enabled); }

}  // namespace tdx::ops
