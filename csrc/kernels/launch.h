#pragma once
// One call of a kernel from a family's table (kernels/<family>.h): the work
// items it takes (rows, or groups of rows: the family's header says which) and,
// for a GPU kernel, the stream it is enqueued on. The host layer makes the calls:
// on the CPU one per at::parallel_for task, on a GPU one for all items.

#include <cstdint>

namespace tdx::kernels {

struct Launch {
  int64_t begin;  // the first work item
  int64_t end;    // one past the last
  void* stream;   // a cudaStream_t for CUDA kernels; unused (nullptr) by CPU kernels
};

}  // namespace tdx::kernels
