#pragma once
// The instruction sets the CPU kernels are compiled for. Every CPU kernel has
// one clone per ISA (kernels/cpu/isa_clones.h) and each family one kernel table
// per ISA. The host runs the active ISA's table: the best one this CPU
// supports, or the one the environment variable TDX_CPU_ISA names. Tests
// switch it to run every clone the CPU supports, whatever the machine.
//
//   baseline  x86-64 (SSE2), or the compiler's default off x86-64
//   avx2      AVX2 + FMA (x86-64-v3's vector part: every AVX2 CPU has FMA)
//   avx512    AVX-512 F/BW/DQ/VL + AVX2 + FMA (x86-64-v4's vector part)
//
// The clones may round differently (FMA contraction, vector width): tests bound
// every kernel's error analytically, not by one clone's output.

#include <string_view>

namespace tdx::kernels {

enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline constexpr CpuIsa kCpuIsas[] = {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512};

// "baseline", "avx2", "avx512".
const char* cpu_isa_name(CpuIsa isa);

// The ISA called `name`; false if none is.
bool parse_cpu_isa(std::string_view name, CpuIsa* isa);

// True if this CPU (and its OS) runs code compiled for `isa`.
bool cpu_supports(CpuIsa isa);

// The widest ISA this CPU supports.
CpuIsa best_cpu_isa();

// The ISA whose kernels the host runs. The first call reads TDX_CPU_ISA and
// throws std::invalid_argument if it names no ISA or one this CPU lacks.
CpuIsa active_cpu_isa();

// Makes `isa` the active ISA for every later kernel call of this process;
// throws std::invalid_argument if this CPU lacks it.
void set_active_cpu_isa(CpuIsa isa);

}  // namespace tdx::kernels
