#include "planner/checks.h"

#include <cstdio>
#include <set>
#include <string>

#include "planner/estimate.h"
#include "planner/pipeline.h"

namespace tdx::planner {
namespace {

std::string format(const char* pattern, double a, double b = 0, double c = 0) {
  char buffer[512];
  std::snprintf(buffer, sizeof(buffer), pattern, a, b, c);
  return buffer;
}

// The GPU types in any group of `axis` (ranks `stride` apart, `size` of them, in every position).
bool axis_mixes_gpu_types(const Layout& l, const ClusterSpec& cluster, const std::string& axis, int64_t size) {
  if (cluster.one_gpu_type()) return false;
  const int64_t stride = l.stride(axis);
  for (int64_t rank = 0; rank < l.world_size(); ++rank) {
    if ((rank / stride) % size != 0) continue;  // not the first rank of its group
    std::set<std::string> types;
    for (int64_t i = 0; i < size; ++i) types.insert(cluster.gpu_of_rank(rank + i * stride).name);
    if (types.size() > 1) return true;
  }
  return false;
}

}  // namespace

std::vector<Finding> check(const ModelSpec& model, const ClusterSpec& cluster, const Layout& l) {
  l.validate();
  model.validate();
  cluster.validate();
  std::vector<Finding> findings;
  for (const std::string& problem : l.problems_for(model, cluster)) {
    findings.push_back({"TDX008", "error", problem + ": this layout cannot run. Change the sizes."});
  }
  if (!findings.empty()) return findings;  // the checks below assume a layout that runs
  if (l.tp > 1 && !axis_intra_domain(l, cluster, "tp")) {
    findings.push_back({"TDX001", "error",
                        format("tensor parallelism of %g spans NVLink domains of %g GPUs: its per-layer "
                               "all-reduces would run on the inter-node link (10-20x slower). Keep tp within a "
                               "domain (tp <= %g) and move the rest to pp or dp.",
                               l.tp, cluster.gpus_per_domain, cluster.gpus_per_domain)});
  }
  if (l.pp > 1 && l.num_microbatches < 4 * l.pp) {
    const double bubble = bubble_fraction(l.pp, l.num_microbatches, l.schedule, l.virtual_stages);
    findings.push_back({"TDX002", "warning",
                        format("%g micro-batches for %g pipeline stages (fewer than 4p): the pipeline idles "
                               "%.0f%% of each step. Use at least 4p micro-batches, or an interleaved or "
                               "zero-bubble schedule.",
                               l.num_microbatches, l.pp, 100 * bubble)});
  }
  for (const auto& [axis, size] : {std::pair<std::string, int64_t>{"tp", l.tp}, {"pp", l.pp}}) {
    if (size > 1 && axis_mixes_gpu_types(l, cluster, axis, size)) {
      findings.push_back({"TDX006", "error",
                          "a " + axis + " group mixes GPU types: the slowest GPU paces every step of the "
                          "group (an H100 waits ~3x on an A100). Put one GPU type per " + axis + " group and "
                          "mix types only across data-parallel replicas."});
    }
  }
  if (uses_fp8_gemms(l.precision)) {
    if (l.fp8_amax_history < 16) {
      findings.push_back({"TDX007", "warning",
                          format("fp8 amax history of %g steps: one outlier step sets the scale of the next "
                                 "ones and overflows. Use a longer history (DelayedScaling amax_history_len "
                                 ">= 16, e.g. 1024) with the max of it.",
                                 l.fp8_amax_history)});
    }
    if (l.fp8_grad_format == Fp8GradFormat::kE4M3) {
      findings.push_back({"TDX007", "warning",
                          "gradients in E4M3 (range 448): small gradients underflow and large ones clip. "
                          "Use E5M2 for gradients (the HYBRID format: E4M3 forward, E5M2 backward)."});
    }
    if (l.fp8_attention) {
      findings.push_back({"TDX007", "warning",
                          "fp8 around the attention softmax: the scores' dynamic range exceeds fp8 and loss "
                          "spikes follow. Keep attention (and the casts to and from fp8) in bf16, outside the "
                          "fp8 region of the linear layers."});
    }
  }
  return findings;
}

}  // namespace tdx::planner
