#pragma once
// Per-GPU memory: model states (ZeRO) and activations (Korthikanti et al. 2022).

#include "planner/options.h"

namespace tdx::planner {

// Bytes per GPU of the states of `num_params` parameters (already divided by
// tensor / pipeline / expert parallelism) under ZeRO stage `zero_stage` over
// `dp` data-parallel ranks (Rajbhandari et al. 2019, section 3):
//   bf16-mixed  params 2 B (bf16), grads 2 B (bf16), optimizer 12 B (fp32 master + Adam m + v) = 16 B
//   fp8-mixed   params 3 B (bf16 + a cached fp8 copy for the GEMMs), grads 2 B, optimizer 12 B = 17 B
//   ZeRO-1 shards the optimizer over dp, ZeRO-2 also the grads, ZeRO-3 also the params.
struct ModelStateBytes {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
ModelStateBytes model_state_bytes(double num_params, int zero_stage, long dp, Precision precision);

// Bytes of activations one transformer layer stores for the backward, per
// micro-batch, with 16-bit activations (Korthikanti et al. 2022, Table 2;
// s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp):
//   none       no TP: sbh (34 + 5as/h); TP: sbh (10 + 24/t + 5as/(ht)); TP + SP: sbh (34/t + 5as/(ht))
//   selective  the same without the attention-score term 5as/h (softmax and dropout recomputed)
//   full       only the layer input: 2sbh, or 2sbh/t with SP
// That is attention="eager" (the a x s x s scores and their softmax stored). A flash / memory-efficient kernel
// (attention="flash", the default: SDPA's kernels, ring attention) never stores the scores; it keeps the
// softmax's log-sum-exp instead, fp32 per head and query (4 as b / t bytes), so "none" costs
// sbh (linear term) + 4abs/t. The 34 counts dropout masks (2sbh + sbh of them), kept as published.
double activation_bytes_per_layer(double seq_len, double micro_batch, double hidden, double num_heads, long tp,
                                  bool sequence_parallel, Recompute recompute,
                                  AttentionKernel attention = AttentionKernel::kFlash);

// Micro-batches whose activations a pipeline stage holds at its peak.
//   gpipe: all m;  1f1b, zb-h1, zb-v: min(p, m) (the first stage warms up p; the zero-bubble
//   schedules also keep the inputs of deferred weight-gradient passes, which this ignores);
//   interleaved with v virtual stages: min(m, p) * (1 + (p - 1) / (p v)) (Narayanan et al. 2021).
double in_flight_microbatches(long pp, long num_microbatches, Schedule schedule, long virtual_stages);

}  // namespace tdx::planner
