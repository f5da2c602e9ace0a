#pragma once
// Per-GPU memory, communication and step time of a layout. Every assumption
// is written next to the formula that uses it (estimate.cpp).

#include <map>
#include <string>
#include <vector>

#include "planner/specs.h"

namespace tdx::planner {

struct AxisComm {
  double bytes = 0;        // sent per GPU per step
  double seconds = 0;      // at the axis's link bandwidth
  double exposed_seconds = 0;  // the part not hidden behind compute
  bool intra_domain = true;
};

// Memory of one GPU, bytes: activations are those held between passes at the rank's peak, backward what a B
// pass allocates on top of what the rank holds at that moment of the pass, at its largest: a recomputed layer's
// rerun (layer_rerun_bytes) and the gradients of the layer's backward (layer_backward_bytes; estimate.cpp).
struct RankMemory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, backward = 0, buffers = 0;
  double total() const { return params + grads + optimizer + activations + backward + buffers; }
};

struct Estimate {
  // memory, bytes per GPU: the fullest pipeline rank's (pipeline_ranks[fullest_pipeline_rank])
  double params = 0, grads = 0, optimizer = 0, activations = 0, backward = 0, buffers = 0;
  double total_memory() const { return params + grads + optimizer + activations + backward + buffers; }
  double gpu_memory = 0;  // the smallest GPU's
  bool fits() const { return total_memory() <= gpu_memory; }
  // Each pipeline rank's memory, in pipeline-rank order (one entry without pp): its own layers, the
  // embedding if it holds the first stage, the final norm, LM head and logits if it holds the last, and
  // the micro-batches its own order of passes holds at its peak.
  std::vector<RankMemory> pipeline_ranks;
  long fullest_pipeline_rank = 0;

  double params_per_gpu = 0;     // parameters held on the rank holding the most (before ZeRO sharding)
  double tokens_per_step = 0;
  double model_flops_per_step = 0;  // 6 N_active D + causal attention, without recomputation
  double compute_seconds = 0;       // busy time of one GPU, with recomputation
  double bubble = 0;                // idle fraction of the pipeline
  std::map<std::string, AxisComm> comm;  // tp, cp, ep, dp, pp (axes of size > 1)
  double step_seconds = 0;
  double mfu = 0;
  double tokens_per_second() const { return tokens_per_step / step_seconds; }
};

// The other ranks of an ep group a token is sent to, on average, when it picks top_k distinct experts
// uniformly among num_experts split evenly over ep ranks and goes once to each rank holding one:
// (ep - 1) (1 - C(E - E/ep, k) / C(E, k)). Without that deduplication it would be k (ep - 1) / ep.
double expected_remote_ranks(int64_t num_experts, int64_t top_k, int64_t ep);

// Whether every group of `axis` lies inside one NVLink domain.
bool axis_intra_domain(const Layout& layout, const ClusterSpec& cluster, const std::string& axis);

Estimate estimate(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout);

// 6 N D (Kaplan et al. 2020; Hoffmann et al. 2022): forward 2ND, backward 4ND.
double training_flops(double num_params, double num_tokens);

// GPU-hours to run `flops` at `mfu` of the cluster's slowest GPU's dense bf16 peak.
double gpu_hours(double flops, const ClusterSpec& cluster, double mfu);

}  // namespace tdx::planner
