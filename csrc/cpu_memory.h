#pragma once
// Counting CPU tensor memory, as CUDA's caching allocator counts GPU memory.
//
// track_cpu_memory() installs, once per process, an allocator in front of
// c10's CPU allocator that forwards every allocation to it and keeps the bytes
// of live CPU tensor storages allocated since then, and their peak: what
// torch.cuda.memory_allocated / max_memory_allocated report for a GPU. Storages
// allocated before it was installed are not counted.

#include <cstdint>

namespace tdx {

// Installs the counting allocator (a no-op if it is); throws std::runtime_error
// if c10's CPU allocator cannot be wrapped (it has no raw deleter).
void track_cpu_memory();
bool tracking_cpu_memory();

struct CpuMemoryStats {
  int64_t allocated = 0;  // bytes of live storages counted
  int64_t peak = 0;       // the largest `allocated` since the last reset
};
CpuMemoryStats cpu_memory_stats();

// Sets the peak to the bytes allocated now.
void reset_cpu_peak_memory();

}  // namespace tdx
