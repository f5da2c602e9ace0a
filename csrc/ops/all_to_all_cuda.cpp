// CUDA registration of the Ulysses all-to-alls: the device-generic host code
// of all_to_all.cpp (ATen re-layout on the current stream, NCCL all-to-all).

#include <torch/library.h>

#include "ops/all_to_all.h"

namespace tdx::ops {

TORCH_LIBRARY_IMPL(tdx, CUDA, m) {
  m.impl("all_to_all_seq_to_heads", &all_to_all_seq_to_heads);
  m.impl("all_to_all_heads_to_seq", &all_to_all_heads_to_seq);
}

}  // namespace tdx::ops
