#pragma once
// All-to-all over a process group. The ops that call these check first that every
// rank agrees on the call (comm/agreement.h).

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace tdx::comm {

// `send` is [n, ...]: block j goes to rank j. Returns [n, ...] (same shape and
// dtype on every rank): block j came from rank j.
at::Tensor all_to_all_equal_blocks(c10d::ProcessGroup& group, const char* op, const char* what,
                                   const at::Tensor& send);

// All-to-all with uneven splits, of several tensors at once: rows
// [sum(send_rows[..j]), +send_rows[j]) of each tensor go to rank j, and the
// result holds rank j's rows at [sum(recv_rows[..j]), +recv_rows[j]). The
// tensors may differ in dtype and row shape; every rank passes the same list.
// All exchanges are in flight together. `what` names them in error messages.
std::vector<at::Tensor> all_to_all_rows(c10d::ProcessGroup& group, const char* op, const char* what,
                                        const std::vector<at::Tensor>& sends, const std::vector<int64_t>& send_rows,
                                        const std::vector<int64_t>& recv_rows);

}  // namespace tdx::comm
