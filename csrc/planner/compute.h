#pragma once
// Busy time of one GPU per step, op by op (compute.cpp has every count): each GEMM by its shape (a roofline
// of its FLOPs at the GPU's sustained GEMM rate and its bytes at the memory's), the attention by its
// FLOPs at a flash kernel's sustained rate, the memory-bound ops (norms, RoPE, activations, residuals,
// fp8 casts, the loss) by the bytes they move, eagerly (each op its own kernel) or compiled (fused), and
// the optimizer's step by its bytes; an eager op costs at least a kernel launch.

#include "planner/specs.h"

namespace tdx::planner {

struct ComputeTime {
  double seconds = 0;            // the sum of the parts below
  double gemm_seconds = 0;       // the linears' and the LM head's GEMMs: forward, backward and reruns
  double attention_seconds = 0;  // the attention kernels' (what hides the cp ring)
  double memory_seconds = 0;     // memory-bound ops (at least their launches when eager)
  double optimizer_seconds = 0;  // AdamW over the rank's shard of the parameters
};

// The busiest GPU type's (the cluster's slowest) time, for the pipeline rank that holds the average share
// of the layers and ends (the bubble accounts for the schedule: estimate()).
ComputeTime compute_time(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout);

// Seconds of one GEMM [m, k] x [k, n] -> [m, n] on `gpu`: its FLOPs at the sustained rate of the precision
// (fp8 operands at fp8_flops x fp8_gemm_efficiency, TF32 at half the bf16 rate) or its operands' and
// result's bytes at the memory's, whichever is longer.
double gemm_seconds(double m, double n, double k, const GpuSpec& gpu, Precision precision);

}  // namespace tdx::planner
