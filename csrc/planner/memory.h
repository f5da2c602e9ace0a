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
//              in fp32 and its normalised input before the weight (2 T h R (e + 4); in fp32 training
//              the input is already fp32 and the normalised input stays fp32: 2 T h R 4).
//   selective  torchdist_ext's policy: the outputs of the GEMMs, the attention kernel and the collectives
//              are kept, the element-wise rest recomputed: T e [3hR (the layer input, both output
//              projections) + (2 + 2g/a) h/t (q, k, v, the attention output) + 2f/t (w1 x, w3 x)] + 4T a/t,
//              plus, with tp > 1 and no sequence parallelism, both all-reduces' outputs (2 T e h).
//   full       the layer input: T e h R.
// An MoE layer replaces the MLP term by what torchdist_ext's MoE keeps (experts are not tensor-parallel:
// its terms are at T, not divided by t), with k experts per token, E experts and d the ranks a token is
// dispatched to (expected_ranks_per_token):
//   none       (with the MoE's input in place of the FFN norm's output: T e h, gathered over tp with SP, where an
//              fp32 router or shared experts keep it; a 16-bit router keeps its fp32 copy instead)
//              T e [k (2h + 4 f_moe) (the expert-major rows and the expert outputs; w1 x, w3 x,
//              silu(w1 x), their product) + 4 f_moe per shared expert] + T (4h (the router's fp32 copy of
//              16-bit tokens; none in fp32) + 8E (its fp32 logits and probabilities) + 12k (the chosen
//              experts' int64 ids and fp32 weights))
//   selective  T e [d h (the dispatched rows) + k (2 f_moe + h) (the grouped GEMMs' outputs) + (2 f_moe + h)
//              per shared expert] + T (4E + 12k)
//   full       nothing (the layer input above)
// With layout.recompute_experts = false (the main job's MoE blocks: their norms and attention recomputed each on
// its own, the MoE not) the MoE term is none's, and each recomputed part keeps its input:
//   selective  T e [4hR (the layer input, the normalised input, the attention's output, their sum) + (2 + 2g/a)
//              h/t + h with tp > 1 and no SP (the output projection's partial sum)] + 4T a/t + the MoE's none
//              term, its input included
//   full       T e 3hR (the layer input, the normalised input, their sum) + the same MoE terms
// (measured on a replica of that block at tp 1 and at tp 2 with SP, none, selective and full, fp32 and bf16:
// within 0.12 T e h of 22-36; tests/planner/test_activation_memory.py).
// (within 0.02 % of what our MoE layer, without shared experts and at tp = 1, keeps on one rank; on two
// ranks within 0.3 % on average, each rank within 2 %, as routing sends it:
// tests/planner/test_activation_memory.py; the shared experts' terms are not measured).
// The routed rows' terms (k in none's, d and k in selective's) are the busiest ep rank's: the mean times
// layout.expert_imbalance.
double layer_activation_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer);

// Bytes a recomputed layer's backward recreates on top of what the layer keeps, alive at once from its rerun
// forward to its backward (the gradients of that backward: layer_backward_bytes), per micro-batch:
//   none       0
//   full       layer_activation_bytes at recompute none: everything the layer keeps without recomputation,
//              its output recreated in the place of the checkpointed input, whose storage the rerun shares
//   selective  what selective drops (none's bytes less selective's) and the region's recreated output
//              (T e h R)
// A layer whose experts are not recomputed (moe_layer and !layout.recompute_experts) reruns its norms and
// attention one region at a time, the larger of the two under full: a norm its output, its fp32 1/rms and
// the composite kernel's copies (T (e h R + 4 R) + those); the attention its projections' outputs, the
// attention output and the wo input (T e ((2 + 2g/a) h/t + h/t)) and the softmax statistics (or eager's
// scores). Under selective only the element-wise work, not counted. Measured (tests/planner/
// test_activation_memory.py): full to the byte, selective with SP to the byte; selective without SP
// recreates 1-2 T e h more (the norms' fp32 temporaries), the regions at tp 1 up to 0.5 T e h more: a lower
// bound.
double layer_rerun_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer);

// Bytes a layer's backward allocates above what its rank holds at its start, at their largest, per micro-batch
// (without recomputation: layer_rerun_bytes adds a recomputed layer's rerun on top). The largest come at the top
// of the layer's backward, in its MLP, as its kept activations are being released (layer_activation_bytes's
// notation, f = ffn_hidden / t):
//   down       the down projection's input gradient (T e f) and weight gradient (e h f, before it is
//              accumulated), and with sequence parallelism the output gradient gathered over the sequence and
//              kept for the weight gradient (T e h) and one sequence block more (T e h R) in flight
//   gate       the gradients of silu(w1 x) and w3 x beside their product's, less the product the down
//              projection kept (2 T e f)
//   the larger of the two. Under zb-h1 and zb-v (split mode) the weight gradient waits for the W pass, which
//   keeps the product and the gathered output gradient queued: down without e h f, gate 3 T e f (+ T e h with SP).
// An MoE layer's experts (not tensor-parallel) on the rows routed to this rank's E/ep experts, r = k T
// expert_imbalance, f = moe_ffn_hidden, with the grouped weight gradient of their down projections (E/ep e h f,
// all local experts' at once, computed in B under every schedule):
//   down       r e f + E/ep e h f
//   gate       E/ep e h f + r e (2f - h) (the expert outputs' gradient rows released)
// (shared experts: not counted). Measured in fp32 on CPU (tests/planner/test_activation_memory.py): to the byte
// at tp 1, tp 2 and tp 2 with SP, for our MoE block, and in split mode at tp 1, with f = 2h and f/t = h; in split
// mode at tp 2 torch's composite RMSNorm (its CPU decomposition) peaks up to 3 T e h above, and in bf16 the CPU's
// GEMMs and that norm add fp32 scratch (1.5-7 T e h), which GPU kernels do not allocate. A lower bound where the
// MLP is narrow (f/t < h, fine-grained experts): there the rest of the backward can peak higher (with the
// composite norm at tp 1, fp32, measured 2.0 T e h against 0.75 planned at f = h/4, 2.5 against 0.63 at h/8).
double layer_backward_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer);

// Bytes the model keeps per micro-batch outside its layers, on the stage holding its end: the final RMSNorm's
// input and output (the LM head's input), h R each at e, its fp32 1/rms (4 R), torch's composite norm's extra
// copies (norm="composite": h R (e + 4); h R 4 in fp32), and what the vocab-parallel cross-entropy keeps: the
// logits (e V/t), the int64 target and the fp32 log-sum-exp (12), per token T (layer_activation_bytes's
// notation; no recomputation reaches outside the layers).
double head_activation_bytes(const ModelSpec& model, const Layout& layout);

// Bytes the head's backward allocates per micro-batch above what the last stage holds at its start (its forward's
// bytes included: the loss's backward writes the logits' gradient in place), per token T at e: its input gradient
// (h; h R with SP, reduce-scattered) and, before it is accumulated, its weight gradient (e V h / t, not per token),
// with SP computed by our all_gather_weight_grad, which holds the gathered input and one sequence block of the
// output gradient in flight (h + V R / t); less the loss's fp32 log-sum-exp (4, not at e), which its backward
// releases first. Under zb-h1 and zb-v the weight gradient waits for W: the input gradient alone. (Measured in
// fp32 against our final norm, LM head and loss, not split: to the byte less a 4-byte 0-d scalar of the loss's;
// tests/planner/test_activation_memory.py.)
double head_backward_bytes(const ModelSpec& model, const Layout& layout);

// Bytes the ends of the model leave queued per micro-batch for their deferred weight gradients under the
// zero-bubble schedules (layer_weight_grad_input_bytes's rules), per token T at e:
//   head       the final RMSNorm's normalised input and output gradient (2 h R), the LM head's input (h R) and
//              its output gradient, the logits' (V/t)
//   embedding  its output gradient, gathered over the sequence ([T, h]: h), and its int64 ids made local to its
//              rows (8 bytes, not at e)
double head_weight_grad_input_bytes(const ModelSpec& model, const Layout& layout);
double embedding_weight_grad_input_bytes(const ModelSpec& model, const Layout& layout);

// The ranks of an ep group a token is dispatched to, on average, when it picks top_k distinct experts
// uniformly among num_experts split evenly over ep ranks and goes once to each rank holding one:
// ep (1 - C(E - E/ep, k) / C(E, k)); 1 with ep = 1.
double expected_ranks_per_token(int64_t num_experts, int64_t top_k, int64_t ep);

// Bytes one layer keeps from a micro-batch's backward (B) to its deferred weight-gradient pass (W) under
// the zero-bubble schedules: what torchdist_ext's split layers queue (_weight_grad.py). A column-parallel
// linear keeps its input (this rank's sequence block under SP: h R) and its output gradient; a row-parallel
// one its input and its output gradient gathered over the sequence ([T, h]); an RMSNorm its input and its
// output gradient (h R each). Per dense layer, at T e:
//   attention  h R (the normalised input, shared by q, k, v) + (1 + 2g/a) h/t (their output gradients)
//              + h/t + h (the output projection's input and output gradient)
//   MLP        h R (shared by w1, w3) + 2f/t (their output gradients) + f/t + h (w2's input and output gradient)
//   norms      4 h R
// An MoE layer keeps the attention's and norms' terms only: its router and experts (routed and shared)
// compute their weight gradients in B. The dense figure equals, to the byte, what a Llama layer of ours in
// split mode leaves queued (tp 1, tp 2, tp 2 with SP: tests/planner/test_activation_memory.py). With fp8
// GEMMs the linears queue fp8 copies (1 byte), which this counts at e: an upper bound there.
double layer_weight_grad_input_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer);

// Micro-batches whose activations a pipeline stage holds at its peak.
//   gpipe: all m;  1f1b: min(p, m) (the first stage warms up p);
//   interleaved with v virtual stages: min(m, p) * (1 + (p - 1) / (p v)) (Narayanan et al. 2021).
//   zb-h1, zb-v: min(p, m) forwards too, but they also keep the inputs of the deferred weight-gradient
//   passes. With pp > 1 estimate() takes each rank's own count (pipeline.h: held_activations_per_rank).
double in_flight_microbatches(long pp, long num_microbatches, Schedule schedule, long virtual_stages);

}  // namespace tdx::planner
