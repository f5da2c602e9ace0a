#pragma once
// All-to-all over a process group, with the agreement check of comm/agreement.h.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace tdx::comm {

// `send` is [n, ...]: block j goes to rank j. Returns [n, ...] (same shape and
// dtype on every rank): block j came from rank j.
at::Tensor all_to_all_equal_blocks(c10d::ProcessGroup& group, const char* op, const char* what,
                                   const at::Tensor& send);

}  // namespace tdx::comm
