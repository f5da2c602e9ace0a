#pragma once
// Per-GPU memory: model states (ZeRO) and activations (Korthikanti et al. 2022).

#include "planner/options.h"
#include "planner/specs.h"

namespace tdx::planner {

// Bytes per GPU of the states of `num_params` parameters (already divided by
// tensor / pipeline / expert parallelism) under ZeRO stage `zero_stage` over
// `dp` data-parallel ranks (Rajbhandari et al. 2019, section 3):
//   bf16-mixed  params 2 B (bf16), grads 2 B (bf16), optimizer 12 B (fp32 master + Adam m + v) = 16 B
//   fp8-mixed   params 3 B (bf16 + a cached fp8 copy for the GEMMs), grads 2 B, optimizer 12 B = 17 B
//   fp32, fp8-fp32  params 4 B (their own master), grads 4 B, optimizer 8 B (Adam m + v) = 16 B
//   ZeRO-1 shards the optimizer over dp, ZeRO-2 also the grads, ZeRO-3 also the params.
struct ModelStateBytes {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
ModelStateBytes model_state_bytes(double num_params, int zero_stage, long dp, Precision precision);

// Bytes per element of activations, of their gradients and of the parameters and gradients that data
// parallelism moves: 4 in fp32 training (fp32, fp8-fp32), else 2 (bf16; fp8 GEMMs keep bf16 activations
// between them).
double element_bytes(Precision precision);

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

// Bytes of activations one layer of `model` (RMSNorm, grouped-query attention with RoPE, SwiGLU MLP; no
// dropout, no biases) stores for the backward per micro-batch, as autograd runs it with our layers and
// recompute policies. T = micro_batch x seq_len / cp tokens, e = element_bytes(precision) (2: 16-bit
// activations; 4 in fp32), h hidden,
// a heads, g kv heads, f the MLP width, t = tp, R = 1/t with sequence parallelism (the tensors outside the
// tensor-parallel region are sequence-sharded), else 1:
//   none       T e [4hR (both norms' inputs and outputs) + (3 + 2g/a) h/t (q, k, v, the attention output
//              and its head-merged copy, the output projection's input) + 4f/t (w1 x, w3 x, silu(w1 x),
//              their product)] + 4T (2R + a/t) (the norms' fp32 1/rms, the attention's fp32 log-sum-exp)
//              attention="eager" stores the a x s softmax probabilities (T e a s / t) instead of the
//              log-sum-exp; norm="composite" (torch's CPU RMSNorm) also stores each norm's input
//              in fp32 and its normalised input before the weight (2 T h R (e + 4)).
//   selective  torchdist_ext's policy: the outputs of the GEMMs, the attention kernel and the collectives
//              are kept, the element-wise rest recomputed: T e [3hR (the layer input, both output
//              projections) + (2 + 2g/a) h/t (q, k, v, the attention output) + 2f/t (w1 x, w3 x)] + 4T a/t,
//              plus, with tp > 1 and no sequence parallelism, both all-reduces' outputs (2 T e h).
//   full       the layer input: T e h R.
// An MoE layer replaces the MLP term by its routed tokens' (k per token, their dispatched copies and
// SwiGLU activations: k (h + 4 f_moe)) and its shared experts' (4 f_moe each) at T e, not divided by t
// (experts are not tensor-parallel); under recompute they keep the GEMM outputs (2 f_moe per token and
// expert). The MoE terms are not checked against a measurement; the dense ones are
// (tests/planner/test_activation_memory.py).
double layer_activation_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer);

// Micro-batches whose activations a pipeline stage holds at its peak.
//   gpipe: all m;  1f1b, zb-h1, zb-v: min(p, m) (the first stage warms up p; the zero-bubble
//   schedules also keep the inputs of deferred weight-gradient passes, which this ignores);
//   interleaved with v virtual stages: min(m, p) * (1 + (p - 1) / (p v)) (Narayanan et al. 2021).
double in_flight_microbatches(long pp, long num_microbatches, Schedule schedule, long virtual_stages);

}  // namespace tdx::planner
