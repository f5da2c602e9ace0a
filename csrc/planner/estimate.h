#pragma once
// Per-GPU memory, communication and step time of a layout. Every assumption
// is written next to the formula that uses it (estimate.cpp). estimate() composes
// the parts declared below it: rank_memory, step_flops and compute_time, and one
// *_bytes per parallel axis. The parts take a layout valid for the model and
// cluster (Layout::validate_for; estimate() checks it) and do not check it again.

#include <map>
#include <string>
#include <vector>

#include "planner/compute.h"
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
  ComputeTime compute;              // busy time of one GPU (with recomputation) and its parts
  double bubble = 0;                // idle fraction of the pipeline
  double attention_spread = 0;      // the ring ranks' attention work, max / mean - 1 (documents.h)
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

// Parameters one GPU holds before ZeRO sharding, a count (not bytes), per pipeline rank: its stage's share of the
// layers (dense parameters split over tp, routed experts over ep) and the ends of the model it holds (the input
// embedding on the first stage, the final norm and LM head on the last; split over tp).
struct RankParams {
  double dense_layers = 0;   // the layers' dense parameters, the same on every pipeline rank
  double experts = 0;        // the layers' routed-expert parameters, the same on every pipeline rank
  std::vector<double> ends;  // the ends each pipeline rank holds, in pipeline-rank order
  long busiest = 0;          // the (first) pipeline rank holding the most: the communication prices it
  double dense(long rank) const { return dense_layers + ends.at(static_cast<size_t>(rank)); }
  double total(long rank) const { return dense(rank) + experts; }  // Estimate::params_per_gpu at `busiest`
};
RankParams rank_params(const ModelSpec& model, const Layout& layout);

// Activation bytes per GPU of each pipeline rank, in pipeline-rank order (RankMemory's activations and backward).
struct RankActivations {
  std::vector<double> activations;  // held between passes at the rank's peak
  std::vector<double> backward;     // what a B pass adds on top of that peak, at its largest
};
RankActivations rank_activations(const ModelSpec& model, const Layout& layout);

// Memory of one GPU of each pipeline rank, bytes, in pipeline-rank order (Estimate::pipeline_ranks): model
// states (ZeRO), rank_activations and the buffers (ZeRO-3's unsharded parameters, the framework reserve).
std::vector<RankMemory> rank_memory(const ModelSpec& model, const Layout& layout);

// FLOPs of one step, summed over all GPUs.
struct StepFlops {
  double tokens = 0;               // tokens per step (a count, not FLOPs)
  double gemm = 0;                 // 6 N_active per token
  double attention = 0;            // causal attention, 6 L s h per token
  double model() const { return gemm + attention; }  // Estimate::model_flops_per_step
};
StepFlops step_flops(const ModelSpec& model, const Layout& layout);

// Bytes one GPU (of the busiest pipeline rank) sends per step over each parallel axis: Estimate::comm's bytes.
// 0 where the axis has size 1.
// tp: the tensor-parallel collectives of the stage's layers and of the ends the rank holds.
double tp_bytes(const ModelSpec& model, const Layout& layout);
// cp: ring attention's K/V and dK/dV passes and Ulysses' all-to-alls.
struct CpBytes {
  double total = 0;  // ring and Ulysses
  double ring = 0;   // of it, the ring's (hidden behind the attention compute)
};
CpBytes cp_bytes(const ModelSpec& model, const Layout& layout);
// ep: the MoE layers' dispatch and combine all-to-alls, forward and backward.
double ep_bytes(const ModelSpec& model, const Layout& layout);
// dp: the gradients' all-reduce (ZeRO 0-2) or reduce-scatter and the parameters' all-gathers (ZeRO-3), over the
// replicas of dense (dp x cp x ep) and expert (dp x cp) parameters; 0 when neither has more than one.
double dp_bytes(const ModelSpec& model, const Layout& layout);
// pp: activations and their gradients at the stage boundaries.
double pp_bytes(const ModelSpec& model, const Layout& layout);
// HSDP's all-reduce of each rank's gradient shard across the dp_replicate replicas, per step (0 without HSDP).
double dp_replicate_bytes(const ModelSpec& model, const Layout& layout);

// 6 N D (Kaplan et al. 2020; Hoffmann et al. 2022): forward 2ND, backward 4ND.
double training_flops(double num_params, double num_tokens);

// GPU-hours to run `flops` at `mfu` of the cluster's slowest GPU's dense bf16 peak.
double gpu_hours(double flops, const ClusterSpec& cluster, double mfu);

}  // namespace tdx::planner
