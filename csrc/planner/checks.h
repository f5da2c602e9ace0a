#pragma once
// The classic failure modes of a layout, as findings with stable codes.
//   TDX001 error    tensor parallelism across NVLink domains (all-reduces on the inter-node link)
//   TDX002 warning  too few micro-batches for the pipeline (m < 4p)
//   TDX003          DistributedSampler without set_epoch          (training code: lint only)
//   TDX004          manual no_sync accumulation under FSDP/ZeRO-3  (training code: lint only)
//   TDX005          gradient clipping on local shard norms         (training code: lint only)
//   TDX006 error    mixed GPU types inside a tensor- or pipeline-parallel group
//   TDX007 warning  fp8 settings prone to loss spikes
//   TDX008 error    a layout that cannot run: sizes that do not multiply to the cluster or divide the model,
//                   a schedule without the micro-batches it needs (Layout::problems_for)

#include <string>
#include <vector>

#include "planner/specs.h"

namespace tdx::planner {

struct Finding {
  std::string code;
  std::string severity;  // "error" | "warning"
  std::string message;   // what is wrong and what to do
};

std::vector<Finding> check(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout);

}  // namespace tdx::planner
