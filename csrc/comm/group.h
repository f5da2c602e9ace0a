#pragma once
// Process groups by name: ops take torch.distributed's registered group name
// (`mesh.get_group().group_name`) and resolve it here, as torch's own
// functional collectives do.

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <c10/util/string_view.h>

namespace tdx::comm {

// The process group registered under `group_name`; fails with a message naming
// the group if none is.
c10::intrusive_ptr<c10d::ProcessGroup> group_by_name(c10::string_view group_name);

}  // namespace tdx::comm
