#include "comm/all_to_all.h"

#include <ATen/ATen.h>
#include <torch/version.h>

namespace tdx::comm {
namespace {

// torch 2.13 renamed ProcessGroup's all-to-all-v from `alltoall_base` (kept as a
// deprecated alias) to `all_to_all_single`; the GPU images we check on may ship older torch.
c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_splits,
                                                 std::vector<int64_t>& input_splits) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
  return group.alltoall_base(output, input, output_splits, input_splits);
#else
  return group.all_to_all_single(output, input, output_splits, input_splits);
#endif
}

}  // namespace

at::Tensor all_to_all_equal_blocks(c10d::ProcessGroup& group, const char* op, const char* what,
                                   const at::Tensor& send) {
  TORCH_CHECK(
      send.dim() >= 1 && send.size(0) == group.getSize(), op, ": the ", what, " must be [group size = ",
      group.getSize(), ", ...], got ", send.sizes());
  auto input = send.contiguous();
  auto received = at::empty_like(input);
  std::vector<int64_t> equal_splits;
  all_to_all_single(group, received, input, equal_splits, equal_splits)->wait();
  return received;
}

std::vector<at::Tensor> all_to_all_rows(c10d::ProcessGroup& group, const char* op, const char* what,
                                        const std::vector<at::Tensor>& sends, const std::vector<int64_t>& send_rows,
                                        const std::vector<int64_t>& recv_rows) {
  const size_t n = static_cast<size_t>(group.getSize());
  TORCH_CHECK(
      send_rows.size() == n && recv_rows.size() == n, op, ": the ", what, " need one send and one receive count per ",
      "rank of the group (", n, "), got ", send_rows.size(), " and ", recv_rows.size());
  int64_t total = 0;
  for (const int64_t rows : recv_rows) total += rows;
  std::vector<at::Tensor> inputs, outputs;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& send : sends) {
    inputs.push_back(send.contiguous());
    auto sizes = send.sizes().vec();
    sizes[0] = total;
    outputs.push_back(at::empty(sizes, send.options()));
    std::vector<int64_t> in_splits = send_rows, out_splits = recv_rows;
    works.push_back(all_to_all_single(group, outputs.back(), inputs.back(), out_splits, in_splits));
  }
  for (auto& work : works) work->wait();
  return outputs;
}

}  // namespace tdx::comm
