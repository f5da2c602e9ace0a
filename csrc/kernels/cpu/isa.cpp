#include "kernels/cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace tdx::kernels {
namespace {

constexpr int kUnset = -1;

std::atomic<int>& active_slot() {
  static std::atomic<int> slot{kUnset};
  return slot;
}

CpuIsa from_environment() {
  const char* name = std::getenv("TDX_CPU_ISA");
  if (name == nullptr || *name == '\0') return best_cpu_isa();
  CpuIsa isa;
  if (!parse_cpu_isa(name, &isa)) {
    throw std::invalid_argument(std::string("TDX_CPU_ISA='") + name +
                                "' names no CPU kernel ISA; use baseline, avx2 or avx512");
  }
  if (!cpu_supports(isa)) {
    throw std::invalid_argument(std::string("TDX_CPU_ISA=") + name + ": this CPU does not support " + name +
                                " (the best it supports is " + cpu_isa_name(best_cpu_isa()) + ")");
  }
  return isa;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

bool parse_cpu_isa(std::string_view name, CpuIsa* isa) {
  for (const CpuIsa candidate : kCpuIsas) {
    if (name == cpu_isa_name(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

bool cpu_supports(CpuIsa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // Also checks that the OS saves the wide registers (XCR0), as libgcc's CPU model does.
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case CpuIsa::kBaseline: return true;
    case CpuIsa::kAvx2: return avx2;
    case CpuIsa::kAvx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return isa == CpuIsa::kBaseline;
#endif
}

CpuIsa best_cpu_isa() {
  if (cpu_supports(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (cpu_supports(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kBaseline;
}

CpuIsa active_cpu_isa() {
  int value = active_slot().load(std::memory_order_relaxed);
  if (value == kUnset) {
    int expected = kUnset;
    active_slot().compare_exchange_strong(expected, static_cast<int>(from_environment()));
    value = active_slot().load();
  }
  return static_cast<CpuIsa>(value);
}

void set_active_cpu_isa(CpuIsa isa) {
  if (!cpu_supports(isa)) {
    throw std::invalid_argument(std::string("this CPU does not support the ") + cpu_isa_name(isa) +
                                " kernels (the best it supports is " + cpu_isa_name(best_cpu_isa()) + ")");
  }
  active_slot().store(static_cast<int>(isa));
}

}  // namespace tdx::kernels
