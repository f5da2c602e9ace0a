#include "comm/group.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace tdx::comm {

c10::intrusive_ptr<c10d::ProcessGroup> group_by_name(c10::string_view group_name) {
  try {
    return c10d::resolve_process_group(std::string(group_name));
  } catch (const std::exception& e) {
    TORCH_CHECK(
        false, "group_name '", group_name,
        "' names no registered process group (pass mesh.get_group().group_name): ", e.what());
  }
}

}  // namespace tdx::comm
