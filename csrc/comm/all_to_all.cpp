#include "comm/all_to_all.h"

#include <ATen/ATen.h>

#include "comm/agreement.h"

namespace tdx::comm {

at::Tensor all_to_all_equal_blocks(c10d::ProcessGroup& group, const char* op, const char* what,
                                   const at::Tensor& send) {
  TORCH_CHECK(
      send.dim() >= 1 && send.size(0) == group.getSize(), op, ": the ", what, " must be [group size = ",
      group.getSize(), ", ...], got ", send.sizes());
  check_ranks_agree(group, op, what, send);
  auto input = send.contiguous();
  auto received = at::empty_like(input);
  std::vector<int64_t> equal_splits;
  group.alltoall_base(received, input, equal_splits, equal_splits)->wait();
  return received;
}

}  // namespace tdx::comm
