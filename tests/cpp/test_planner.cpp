// The planner's formulas against hand computations written out here, and the
// figures of commonly quoted training notes (docs/planner.md; some are wrong: see BubbleOf8StagesAnd4MicroBatches).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner/checks.h"
#include "planner/estimate.h"
#include "planner/memory.h"
#include "planner/pipeline.h"
#include "planner/specs.h"

using namespace tdx::planner;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

ModelSpec llama3_70b() {
  ModelSpec m;
  m.num_layers = 80, m.hidden = 8192, m.num_heads = 64, m.num_kv_heads = 8, m.ffn_hidden = 28672;
  m.vocab_size = 128256;
  return m;
}

GpuSpec h100() { return {"h100-80gb", 80 * kGiB, 989e12, 450e9, 50e9, 3.35e12, 1979e12, 0.73, 0.56, 0.33}; }
GpuSpec a100() { return {"a100-80gb", 80 * kGiB, 312e12, 300e9, 25e9, 2.039e12, 0, 0.8, 0, 0.65}; }
GpuSpec b200() { return {"b200-192gb", 192e9, 2.25e15, 900e9, 50e9, 8e12, 4.5e15, 0.73, 0.56, 0.33}; }

ClusterSpec cluster_of(GpuSpec gpu, int64_t count) {
  ClusterSpec c;
  c.groups = {{gpu, count}};
  return c;
}

}  // namespace

TEST(ModelStates, SixteenBytesPerParameterWithMixedPrecisionAdam) {
  // 2 (bf16 params) + 2 (bf16 grads) + 4 + 4 + 4 (fp32 master, Adam m, Adam v) = 16 bytes.
  EXPECT_DOUBLE_EQ(model_state_bytes(70e9, 0, 1, Precision::kBf16Mixed).total(), 70e9 * 16);  // 1.12 TB, as in the notes
  EXPECT_DOUBLE_EQ(model_state_bytes(13e9, 0, 1, Precision::kBf16Mixed).total(), 208e9);
  // ZeRO-3 over 32 ranks: 1.12 TB / 32 = 35 GB per GPU.
  EXPECT_DOUBLE_EQ(model_state_bytes(70e9, 3, 32, Precision::kBf16Mixed).total(), 35e9);
}

TEST(ModelStates, ZeroStagesReduceByFourEightAndDp) {
  // Rajbhandari et al. 2019: stage 1 -> 4x, stage 2 -> 8x, stage 3 -> Nd x as Nd grows.
  // (Commonly quoted notes say "ZeRO-1 up to 8x": that is stage 2's figure.)
  const double dp = 1024, full = 16;
  EXPECT_NEAR(full / (model_state_bytes(1, 1, dp, Precision::kBf16Mixed).total()), 4.0, 0.05);  // 16 / (4 + 12/Nd)
  EXPECT_NEAR(full / (model_state_bytes(1, 2, dp, Precision::kBf16Mixed).total()), 8.0, 0.1);   // 16 / (2 + 14/Nd)
  EXPECT_DOUBLE_EQ(full / (model_state_bytes(1, 3, 64, Precision::kBf16Mixed).total()), 64.0);
  EXPECT_DOUBLE_EQ(model_state_bytes(1, 0, 1, Precision::kFp8Mixed).total(), 17.0);
  EXPECT_THROW(model_state_bytes(1, 4, 1, Precision::kBf16Mixed), std::invalid_argument);
  EXPECT_THROW(parse_option<Precision>("fp16"), std::invalid_argument);
}

TEST(Activations, KorthikantiTable2) {
  // Llama-3 70B shapes: s = 4096, b = 1, h = 8192, a = 64; sbh = 33,554,432.
  const double sbh = 4096.0 * 8192.0;
  // No parallelism: sbh (34 + 5 a s / h) = sbh (34 + 160) = 6.51e9 bytes; x 80 layers = 520.8 GB (the notes' figures).
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(4096, 1, 8192, 64, 1, false, Recompute::kNone, AttentionKernel::kEager), sbh * 194);
  EXPECT_NEAR(80 * activation_bytes_per_layer(4096, 1, 8192, 64, 1, false, Recompute::kNone, AttentionKernel::kEager) / 1e9, 520.8, 0.1);
  // TP = 8 without SP: sbh (10 + 24/8 + 5*64*4096/(8192*8)) = sbh (13 + 20).
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(4096, 1, 8192, 64, 8, false, Recompute::kNone, AttentionKernel::kEager), sbh * 33);
  // TP + SP: sbh (34/8 + 20); selective recomputation drops the 20; full keeps 2 sbh / t.
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(4096, 1, 8192, 64, 8, true, Recompute::kNone, AttentionKernel::kEager), sbh * 24.25);
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(4096, 1, 8192, 64, 8, true, Recompute::kSelective), sbh * 4.25);
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(4096, 1, 8192, 64, 8, true, Recompute::kFull), sbh * 2 / 8);
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(4096, 1, 8192, 64, 8, false, Recompute::kFull), sbh * 2);
  // A flash kernel (the default) stores no scores, only the fp32 log-sum-exp per head and query: 4 a s b / t.
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(4096, 1, 8192, 64, 8, true, Recompute::kNone),
                   sbh * 4.25 + 4.0 * 64 * 4096 / 8);
  try {
    parse_option<Recompute>("some", "Layout.recompute");
    FAIL() << "expected invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "Layout.recompute must be one of none, selective, full, got 'some'");
  }
}

TEST(Activations, LlamaLayerAsAutogradRunsIt) {
  // Llama-3 70B (h = 8192, a = 64, g = 8, f = 28672), s = 4096, b = 1: T = 4096 tokens, e = 2 bytes.
  const ModelSpec model = llama3_70b();
  const double T = 4096, e = 2, h = 8192, a = 64, g = 8, f = 28672;
  Layout l;
  // none, flash, fused norms: T e [4h + (3 + 2g/a) h + 4f] + 4T (2 + a).
  EXPECT_DOUBLE_EQ(layer_activation_bytes(model, l, false), T * e * (4 * h + (3 + 2 * g / a) * h + 4 * f) + 4 * T * (2 + a));
  // eager attention: the softmax probabilities T e a s instead of the log-sum-exp.
  l.attention = AttentionKernel::kEager;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(model, l, false),
                   T * e * (4 * h + (3 + 2 * g / a) * h + 4 * f + a * 4096) + 4 * T * 2);
  // torch's composite CPU norm also keeps each norm's input in fp32 and its normalised input: 2 T h (e + 4) more.
  l.attention = AttentionKernel::kFlash, l.norm = NormKernel::kComposite;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(model, l, false),
                   T * e * (4 * h + (3 + 2 * g / a) * h + 4 * f) + 4 * T * (2 + a) + 2 * T * h * (e + 4));
  // tp = 8 with SP: the norms' tensors and the 1/rms split over t too (R = 1/8); cp = 2 halves T.
  l.norm = NormKernel::kFused, l.tp = 8, l.sequence_parallel = true, l.cp = 2;
  const double t = 8, Tc = T / 2;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(model, l, false),
                   Tc * e * (4 * h / t + (3 + 2 * g / a) * h / t + 4 * f / t) + 4 * Tc * (2 / t + a / t));
  // selective: the layer input, both output projections, q k v, the attention output, w1 x and w3 x.
  l.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(model, l, false),
                   Tc * e * (3 * h / t + (2 + 2 * g / a) * h / t + 2 * f / t) + 4 * Tc * a / t);
  // without SP the two all-reduces' outputs are kept too, and the layer input is whole.
  l.sequence_parallel = false;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(model, l, false),
                   Tc * e * (3 * h + (2 + 2 * g / a) * h / t + 2 * f / t + 2 * h) + 4 * Tc * a / t);
  l.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(layer_activation_bytes(model, l, false), Tc * e * h);
}

TEST(Activations, WhatARecomputedLayersBackwardRecreates) {
  const ModelSpec model = llama3_70b();
  const double e = 2, h = 8192, a = 64, g = 8, t = 8, Tc = 2048;
  Layout l;
  l.tp = 8, l.sequence_parallel = true, l.cp = 2;
  Layout kept_all = l;
  EXPECT_EQ(layer_rerun_bytes(model, l, false), 0);
  // Full: everything the layer keeps without recomputation.
  l.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(layer_rerun_bytes(model, l, false), layer_activation_bytes(model, kept_all, false));
  // Selective: what it drops, and the layer's output (a sequence block with SP).
  l.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(layer_rerun_bytes(model, l, false), layer_activation_bytes(model, kept_all, false) -
                                                           layer_activation_bytes(model, l, false) + Tc * e * h / t);
  // Experts not recomputed: the attention region alone under full (projections, attention output, wo input,
  // fp32 log-sum-exp), nothing counted under selective.
  l.recompute_experts = false;
  EXPECT_EQ(layer_rerun_bytes(model, l, true), 0);
  l.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(layer_rerun_bytes(model, l, true), Tc * e * ((2 + 2 * g / a) * h / t + h / t) + 4 * Tc * a / t);
}

TEST(Activations, TheGradientsOfALayersBackward) {
  ModelSpec model = llama3_70b();
  const double e = 2, h = 8192, f = 28672, Tc = 2048;
  Layout l;
  l.tp = 8, l.cp = 2;
  // Without SP the larger of the down projection's input and weight gradients and the gate's two input gradients.
  const double t = 8;
  EXPECT_DOUBLE_EQ(layer_backward_bytes(model, l, false), std::max(Tc * e * f / t + e * h * f / t, 2 * Tc * e * f / t));
  // With SP the output gradient gathered over the sequence and one block in flight join the down projection's.
  l.sequence_parallel = true;
  const double down = Tc * e * f / t + e * h * f / t + Tc * e * h * (1 + 1 / t);
  EXPECT_DOUBLE_EQ(layer_backward_bytes(model, l, false), std::max(down, 2 * Tc * e * f / t));
  // Under the zero-bubble schedules the weight gradient waits for the W pass, and the product (with the gathered
  // output gradient) stays queued for it beside the gate's gradients.
  l.pp = 4, l.schedule = Schedule::kZbH1;
  const double split = std::max(down - e * h * f / t, 3 * Tc * e * f / t + Tc * e * h);
  EXPECT_DOUBLE_EQ(layer_backward_bytes(model, l, false), split);
  // Recomputation does not change it (layer_rerun_bytes adds the rerun).
  l.recompute = Recompute::kFull;
  EXPECT_DOUBLE_EQ(layer_backward_bytes(model, l, false), split);
  // An MoE layer: its routed rows k T x on this rank's E / ep experts, and their grouped weight gradient (in B
  // under every schedule).
  model = ModelSpec{};
  model.num_layers = 2, model.hidden = 1024, model.num_heads = 8, model.num_kv_heads = 8, model.ffn_hidden = 4096;
  model.vocab_size = 1000, model.num_experts = 8, model.experts_per_token = 2, model.moe_ffn_hidden = 512;
  Layout m;
  m.ep = 2, m.seq_len = 256, m.micro_batch = 2, m.expert_imbalance = 1.5;
  const double T = 512, H = 1024, F = 512, rows = 2 * 1.5 * T, weight_grad = 4 * e * H * F;
  EXPECT_DOUBLE_EQ(layer_backward_bytes(model, m, true),
                   std::max(rows * e * F + weight_grad, weight_grad + rows * e * (2 * F - H)));
  m.pp = 2, m.schedule = Schedule::kZbV, m.recompute = Recompute::kSelective;
  EXPECT_DOUBLE_EQ(layer_backward_bytes(model, m, true), rows * e * F + weight_grad);
}

TEST(Estimate, ABlockWhoseExpertsAreNotRecomputedRerunsAfterItsMoeBackward) {
  // Every layer an MoE layer: under full recompute with recompute_experts = false the norms and attention rerun
  // after the MoE's backward is done, so a B adds the larger of the two, not their sum; on the one stage, after
  // the head has released its forward (or the head's own backward, if larger).
  ModelSpec model;
  model.num_layers = 4, model.hidden = 1024, model.num_heads = 8, model.num_kv_heads = 8, model.ffn_hidden = 4096;
  model.vocab_size = 1000, model.num_experts = 8, model.experts_per_token = 2, model.moe_ffn_hidden = 512;
  Layout l;
  l.seq_len = 1024, l.recompute = Recompute::kFull, l.recompute_experts = false;
  const double rerun = layer_rerun_bytes(model, l, true), gradients = layer_backward_bytes(model, l, true);
  ASSERT_GT(rerun, 0);
  const Estimate e = estimate(model, cluster_of(h100(), 1), l);
  EXPECT_DOUBLE_EQ(e.backward, std::max(head_backward_bytes(model, l),
                                        std::max(rerun, gradients) - head_activation_bytes(model, l)));
  // Where recomputation reaches the experts the whole layer reruns before its backward: the sum.
  l.recompute_experts = true;
  const Estimate whole = estimate(model, cluster_of(h100(), 1), l);
  EXPECT_DOUBLE_EQ(whole.backward, std::max(head_backward_bytes(model, l),
                                            layer_rerun_bytes(model, l, true) + layer_backward_bytes(model, l, true) -
                                                head_activation_bytes(model, l)));
}

TEST(Activations, TheGradientsOfTheHeadsBackward) {
  const ModelSpec model = llama3_70b();
  const double e = 2, h = 8192, V = 128256, t = 8, T = 4096;
  Layout l;
  l.tp = 8;
  // Its input gradient and weight gradient; with SP the input gradient reduce-scattered, and the gathered input
  // and an output-gradient block in flight in the weight gradient's ring.
  // (less the loss's fp32 log-sum-exp, released first).
  EXPECT_DOUBLE_EQ(head_backward_bytes(model, l), T * e * h + e * V / t * h - 4 * T);
  l.sequence_parallel = true;
  EXPECT_DOUBLE_EQ(head_backward_bytes(model, l), T * e * h / t + e * V / t * h + T * e * (h + V / t / t) - 4 * T);
  // Under the zero-bubble schedules the weight gradient (and its ring) waits for W.
  l.pp = 4, l.schedule = Schedule::kZbV;
  EXPECT_DOUBLE_EQ(head_backward_bytes(model, l), T * e * h / t - 4 * T);
}

TEST(Activations, DeferredWeightGradientInputsAsTheSplitLayersQueueThem) {
  const ModelSpec model = llama3_70b();
  const double T = 4096, e = 2, h = 8192, a = 64, g = 8, f = 28672;
  Layout l;
  // tp = 1: every linear keeps its whole input and output gradient: q, k, v share the normalised input,
  // w1, w3 theirs; o and w2 keep their inputs (h, f) and output gradients (h each); two norms 2h each.
  EXPECT_DOUBLE_EQ(layer_weight_grad_input_bytes(model, l, false),
                   T * e * ((h + (1 + 2 * g / a) * h + h + h) + (h + 2 * f + f + h) + 4 * h));
  // tp = 8 with SP, cp = 2: the shared inputs and the norms' tensors are sequence blocks (h / t), the row
  // linears' output gradients are gathered ([T, h]).
  l.tp = 8, l.sequence_parallel = true, l.cp = 2;
  const double t = 8, Tc = T / 2;
  EXPECT_DOUBLE_EQ(layer_weight_grad_input_bytes(model, l, false),
                   Tc * e * (6 * h / t + (2 + 2 * g / a) * h / t + 3 * f / t + 2 * h));
}

TEST(Pipeline, PeakHeldActivationsOfTheSimulatedSchedules) {
  // Without deferred weight gradients the peak is the forwards' closed form (times the chunks per rank).
  for (long m : {4L, 8L, 16L}) {
    EXPECT_DOUBLE_EQ(peak_held_activations(simulate_schedule(4, m, Schedule::k1F1B), 4, 0.7),
                     in_flight_microbatches(4, m, Schedule::k1F1B, 1));
    EXPECT_DOUBLE_EQ(peak_held_activations(simulate_schedule(4, m, Schedule::kGPipe), 4, 0.7),
                     in_flight_microbatches(4, m, Schedule::kGPipe, 1));
    if (m >= 8) {  // Megatron's closed form assumes a full warm-up: (v - 1) p + 2 (p - 1) + 1 <= v m forwards
      EXPECT_DOUBLE_EQ(peak_held_activations(simulate_schedule(4, m, Schedule::kInterleaved, 2), 4, 0.7) / 2,
                       in_flight_microbatches(4, m, Schedule::kInterleaved, 2));
    }
    EXPECT_DOUBLE_EQ(peak_held_activations(simulate_schedule(4, m, Schedule::kZbH1), 4, 0.0), 4);
  }
  // zb-h1, p = 2, m = 4, by hand. Stage 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3 holds at most two
  // forwards' activations (2), or one and a W input (1 + w). Stage 1 defers one W: F0 B0 F1 B1 W0 F2 B2 W1 F3
  // B3 W2 W3 holds at most one forward's activations and a W input (1 + w), or two W inputs (2w).
  for (double w : {0.0, 0.25, 0.5, 1.0, 2.0}) {
    EXPECT_DOUBLE_EQ(peak_held_activations(simulate_schedule(2, 4, Schedule::kZbH1), 2, w), std::max({2.0, 1 + w, 2 * w}));
  }
  // With W inputs as large as the activations (w = 1) no stage holds more than 1F1B's peak, p.
  for (long p : {2L, 4L, 8L}) {
    for (long m : {1L, 3L, 8L, 32L}) {
      EXPECT_LE(peak_held_activations(simulate_schedule(p, m, Schedule::kZbH1), p, 1.0), p) << p << " stages, " << m;
    }
  }
  // zb-v counts chunk units (half a stage): 2p is 1F1B's p stages. For m >= 2p - 1 its handcrafted order idles
  // exactly the closed form, as does the greedy order at m = p, and between them the handcrafted order or the
  // greedy one under a cap profile (p = 5, m = 6: 0.122 before the caps).
  for (long p = 1; p <= 16; ++p) {
    for (long m = 1; m <= 4 * p + 3; ++m) {
      const auto timeline = simulate_schedule(p, m, Schedule::kZbV);
      ASSERT_EQ(timeline.size(), static_cast<size_t>(6 * p * m));
      for (double w : {0.0, 0.5, 1.0}) EXPECT_LE(peak_held_activations(timeline, p, w), 2 * p) << p << " stages, " << m;
      const double closed_form = static_cast<double>(p - 1) / static_cast<double>(6 * m + p - 1);
      if (m >= p) EXPECT_NEAR(idle_fraction(timeline, p), closed_form, 1e-12) << p << " stages, " << m;
    }
  }
  EXPECT_THROW(peak_held_activations(simulate_schedule(2, 4, Schedule::kZbH1), 2, -1.0), std::invalid_argument);
  // Unequal stages by bytes (the ends of the model), zb-h1, p = 2, m = 4, in the orders above: stage 0 holds
  // at most two forwards (2 f0) or one and a W input (f0 + w0); stage 1 one forward and a W input (f1 + w1) or
  // two W inputs (2 w1).
  const auto zb_h1 = simulate_schedule(2, 4, Schedule::kZbH1);
  EXPECT_EQ(peak_held_bytes_per_rank(zb_h1, 2, Schedule::kZbH1, {{1, 0.5}, {3, 2}}), (std::vector<double>{2, 5}));
  EXPECT_EQ(peak_held_bytes_per_rank(zb_h1, 2, Schedule::kZbH1, {{1, 3}, {1, 0.25}}), (std::vector<double>{4, 1.25}));
  // A B pass's rerun counts on top of what its rank held before it: stage 0 two forwards (2 + 1), stage 1 a
  // forward and the previous micro-batch's W input (3 + 2 + 1); 1F1B's ranks their warm-up's forwards.
  EXPECT_EQ(peak_held_bytes_per_rank(zb_h1, 2, Schedule::kZbH1, {{1, 0.5, 1}, {3, 2, 1}}), (std::vector<double>{3, 6}));
  EXPECT_EQ(peak_held_bytes_per_rank(simulate_schedule(2, 4, Schedule::k1F1B), 2, Schedule::k1F1B,
                                     {{1, 0, 0.5}, {1, 0, 0.5}}),
            (std::vector<double>{2.5, 1.5}));
  EXPECT_THROW(peak_held_bytes_per_rank(zb_h1, 2, Schedule::kZbH1, {{1, 1, -1}, {1, 1}}), std::invalid_argument);
  EXPECT_THROW(peak_held_bytes_per_rank(zb_h1, 2, Schedule::kZbH1, {{1, 1}}), std::invalid_argument);
  EXPECT_THROW(peak_held_bytes_per_rank(zb_h1, 2, Schedule::kZbH1, {{1, 1}, {1, -1}}), std::invalid_argument);
  EXPECT_THROW(peak_held_bytes_per_rank(zb_h1, 1, Schedule::kZbH1, {{1, 1}, {1, 1}}), std::invalid_argument);
  // ZB-V's chunk 1 of rank 0 is the last stage: its bytes count there.
  const auto zb_v = simulate_schedule(2, 4, Schedule::kZbV);
  const auto heavy_end = peak_held_bytes_per_rank(zb_v, 2, Schedule::kZbV, {{1, 0}, {1, 0}, {1, 0}, {10, 0}});
  EXPECT_GE(heavy_end[0], 10);
  EXPECT_LT(heavy_end[1], 10);
  // Rank by rank, the closed forms the estimate uses equal the simulated orders' peaks.
  for (long p = 1; p <= 8; ++p) {
    for (long m = 1; m <= 4 * p; ++m) {
      for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved, Schedule::kZbH1}) {
        if (schedule == Schedule::kInterleaved && m % p) continue;  // it needs m divisible by p
        const long v = schedule == Schedule::kInterleaved ? 3 : 1;
        EXPECT_EQ(held_activations_per_rank(p, m, schedule, v, 0.5),
                  peak_held_activations_per_rank(simulate_schedule(p, m, schedule, v), p, 0.5))
            << p << " stages, " << m << " micro-batches, schedule " << static_cast<int>(schedule);
      }
    }
  }
}

TEST(Pipeline, BubbleOf8StagesAnd4MicroBatches) {
  // (p - 1) / (m + p - 1) = 7 / 11 = 63.6%. The commonly quoted "46%" (docs/planner.md) is not this formula's value
  // (nor (p-1)/m = 175%): it is the wrong figure there.
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 4, Schedule::k1F1B, 1), 7.0 / 11.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 32, Schedule::k1F1B, 1), 7.0 / 39.0);    // m = 4p: 17.9%
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 32, Schedule::kInterleaved, 2), 7.0 / 71.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 32, Schedule::kZbH1, 1), 7.0 / 103.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 32, Schedule::kZbV, 1), 7.0 / 199.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(1, 1, Schedule::kGPipe, 1), 0.0);
}

TEST(Pipeline, SimulatedTimelinesHaveTheClosedFormBubble) {
  for (long p : {2, 4, 8}) {
    for (long m : {1, 3, 8, 16}) {
      for (const Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kZbH1, Schedule::kZbV}) {
        const auto timeline = simulate_schedule(p, m, schedule);
        const size_t passes = schedule == Schedule::kZbV ? 6 : schedule == Schedule::kZbH1 ? 3 : 2;
        ASSERT_EQ(timeline.size(), passes * p * m);
        EXPECT_NEAR(idle_fraction(timeline, p), bubble_fraction(p, m, schedule, 1), 1e-12)
            << option_name(schedule) << " p=" << p << " m=" << m;
      }
    }
  }
}

TEST(Pipeline, SimulatedInterleavedScheduleHasTheClosedFormBubble) {
  for (long p : {2, 4, 8}) {
    for (long v : {2, 3, 4}) {
      for (long m : {p, 2 * p, 4 * p}) {
        const auto timeline = simulate_schedule(p, m, Schedule::kInterleaved, v);
        ASSERT_EQ(timeline.size(), static_cast<size_t>(2 * p * m * v));
        EXPECT_NEAR(idle_fraction(timeline, p), bubble_fraction(p, m, Schedule::kInterleaved, v), 1e-12)
            << "p=" << p << " v=" << v << " m=" << m;
      }
    }
  }
  EXPECT_THROW(simulate_schedule(4, 6, Schedule::kInterleaved, 2), std::invalid_argument);  // m % p != 0
}

TEST(Pipeline, ReplayWithTheSimulatorsCostsIsTheSimulatedTimeline) {
  struct Case {
    Schedule schedule;
    long v;
    double forward, backward, weight;  // the simulator's costs of one pass of one chunk
  };
  for (long p : {2, 4}) {
    for (long m : {p, 2 * p, 3 * p}) {
      for (const Case c : {Case{Schedule::kGPipe, 1, 1, 1, 1}, Case{Schedule::k1F1B, 1, 1, 1, 1},
                           Case{Schedule::kZbH1, 1, 1, 1, 1}, Case{Schedule::kZbV, 1, 0.5, 0.5, 0.5},
                           Case{Schedule::kInterleaved, 2, 0.5, 0.5, 0.5}}) {
        const auto simulated = simulate_schedule(p, m, c.schedule, c.v);
        const auto replayed = replay_schedule(p, m, c.schedule, c.v, {c.forward}, {c.backward}, {c.weight});
        ASSERT_EQ(replayed.size(), simulated.size());
        EXPECT_NEAR(idle_fraction(replayed, p), idle_fraction(simulated, p), 1e-12)
            << option_name(c.schedule) << " p=" << p << " m=" << m;
      }
    }
  }
}

TEST(Pipeline, ReplayWaitsTheMessageTimeForAnInputFromAnotherDeviceOnly) {
  // GPipe, p = 2, m = 1, F = B = 1: F0 [0, 1], F1 [1.5, 2.5], B1 [2.5, 3.5], B0 [4, 5] with 0.5 per message.
  const auto timed = replay_schedule(2, 1, Schedule::kGPipe, 1, {1.0}, {1.0}, {0.0}, 0.5);
  double makespan = 0;
  for (const auto& pass : timed) makespan = std::max(makespan, pass.end);
  EXPECT_DOUBLE_EQ(makespan, 5.0);
  EXPECT_DOUBLE_EQ(idle_fraction(timed, 2), 1.0 - 4.0 / (2 * 5.0));
  // zb-v on one device hands its turn over in memory: no message, whatever it would cost.
  EXPECT_NEAR(idle_fraction(replay_schedule(1, 4, Schedule::kZbV, 1, {0.5}, {0.5}, {0.5}, 10.0), 1),
              idle_fraction(replay_schedule(1, 4, Schedule::kZbV, 1, {0.5}, {0.5}, {0.5}), 1), 1e-12);
  EXPECT_THROW(replay_schedule(2, 4, Schedule::k1F1B, 1, {1.0}, {1.0}, {1.0}, -1.0), std::invalid_argument);
}

TEST(Pipeline, ReplayedOneFOneBKeepsItsClosedFormForAnyUniformCosts) {
  // With the same costs on every stage, 1F1B's bubble is (p - 1) / (m + p - 1) whatever F, B and W cost;
  // splitting W off (zb-h1) leaves a smaller one.
  for (long p : {2, 4}) {
    const double one_f_one_b = idle_fraction(replay_schedule(p, 8, Schedule::k1F1B, 1, {1.0}, {1.7}, {1.3}), p);
    EXPECT_NEAR(one_f_one_b, bubble_fraction(p, 8, Schedule::k1F1B, 1), 1e-12);
    EXPECT_LT(idle_fraction(replay_schedule(p, 8, Schedule::kZbH1, 1, {1.0}, {1.7}, {1.3}), p), one_f_one_b);
  }
  EXPECT_THROW(replay_schedule(2, 4, Schedule::k1F1B, 1, {-1.0}, {1.0}, {1.0}), std::invalid_argument);
  EXPECT_THROW(replay_schedule(2, 4, Schedule::k1F1B, 1, {1.0, 1.0, 1.0}, {1.0}, {1.0}), std::invalid_argument);
  // A slower last stage: 1F1B's critical path runs through its passes.
  const auto slow_last = replay_schedule(2, 4, Schedule::k1F1B, 1, {1.0, 1.0}, {1.0, 2.0}, {1.0});
  double makespan = 0;
  for (const auto& pass : slow_last) makespan = std::max(makespan, pass.end);
  EXPECT_DOUBLE_EQ(makespan, 1.0 + 4 * (1.0 + 3.0) + 2.0);  // F on stage 0, then stage 1's 4 x (F + B), then stage 0's last B
}

TEST(Pipeline, ReplayTakesOneCostPerStageAndMicroBatch) {
  // GPipe, p = 2, m = 2, stage-major costs: F0.0 = 1, F0.1 = 3, F1.0 = 1, F1.1 = 1; B = 1; no W.
  // F0.0 [0, 1], F0.1 [1, 4], F1.0 [1, 2], F1.1 [4, 5], B1.0 [5, 6], B1.1 [6, 7], B0.0 [6, 7], B0.1 [7, 8].
  const auto timed = replay_schedule(2, 2, Schedule::kGPipe, 1, {1.0, 3.0, 1.0, 1.0}, {1.0}, {0.0});
  double makespan = 0;
  for (const auto& pass : timed) makespan = std::max(makespan, pass.end);
  EXPECT_DOUBLE_EQ(makespan, 8.0);
  // The same value for every pass reads as one per kind.
  EXPECT_NEAR(idle_fraction(replay_schedule(2, 2, Schedule::kZbV, 1, std::vector<double>(8, 1.0), {1.0}, {1.0}), 2),
              idle_fraction(replay_schedule(2, 2, Schedule::kZbV, 1, {1.0}, {1.0}, {1.0}), 2), 1e-12);
  EXPECT_THROW(replay_schedule(2, 2, Schedule::kGPipe, 1, std::vector<double>(5, 1.0), {1.0}, {0.0}),
               std::invalid_argument);
}

TEST(Pipeline, OneFOneBHoldsAtMostPMicroBatches) {
  EXPECT_DOUBLE_EQ(in_flight_microbatches(8, 32, Schedule::k1F1B, 1), 8);
  EXPECT_DOUBLE_EQ(in_flight_microbatches(8, 32, Schedule::kGPipe, 1), 32);
  EXPECT_DOUBLE_EQ(in_flight_microbatches(8, 4, Schedule::k1F1B, 1), 4);
  EXPECT_DOUBLE_EQ(in_flight_microbatches(8, 32, Schedule::kInterleaved, 2), 8 * (1 + 7.0 / 16.0));
}

TEST(Compute, SixNDAndGpuHours) {
  // Chinchilla-optimal 70B on 1.4T tokens: 6 x 70e9 x 1.4e12 = 5.88e23 FLOPs (as in the notes).
  EXPECT_DOUBLE_EQ(training_flops(70e9, 1.4e12), 5.88e23);
  // On H100s at the dense bf16 peak (989 TFLOP/s): 5.88e23 / 989e12 / 3600 = 165,150 GPU-hours,
  // 412,900 at 40% MFU: not the "13 million hours" commonly quoted for one H100.
  EXPECT_NEAR(gpu_hours(5.88e23, cluster_of(h100(), 1), 1.0), 5.88e23 / 989e12 / 3600, 1e-6);
  EXPECT_NEAR(gpu_hours(5.88e23, cluster_of(h100(), 1), 0.4), 412875, 1);
}

TEST(Params, PublishedTotals) {
  // Llama-3 70B per layer: q, o 8192^2 each; k, v 8192 x 1024 each; SwiGLU 3 x 8192 x 28672; 2 norms.
  const double per_layer = 2 * 8192.0 * 8192 + 2 * 8192.0 * 1024 + 3 * 8192.0 * 28672 + 2 * 8192;
  const double embeddings = 2 * 8192.0 * 128256 + 8192;
  EXPECT_DOUBLE_EQ(count_params(llama3_70b()).total, 80 * per_layer + embeddings);
  EXPECT_NEAR(count_params(llama3_70b()).total / 70.6e9, 1.0, 0.02);
}

TEST(Layout, AxesMustMultiplyToTheGpuCount) {
  Layout l;
  l.tp = 8, l.pp = 4;
  try {
    l.validate_for(llama3_70b(), cluster_of(h100(), 64));
    FAIL() << "expected invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("must equal the cluster's 64 GPUs"), std::string::npos) << e.what();
  }
  l.tp = 3, l.pp = 1, l.dp = 1;
  EXPECT_THROW(l.validate_for(llama3_70b(), cluster_of(h100(), 3)), std::invalid_argument);  // 64 heads % 3
}

TEST(Checks, TensorParallelismAcrossNodesIsAnError) {
  Layout l;
  l.tp = 16, l.dp = 2;
  l.sequence_parallel = true;
  const auto findings = check(llama3_70b(), cluster_of(h100(), 32), l);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].code, "TDX001");
  EXPECT_EQ(findings[0].severity, "error");
  l.tp = 8, l.dp = 4;
  EXPECT_TRUE(check(llama3_70b(), cluster_of(h100(), 32), l).empty());
}

TEST(Checks, ALayoutThatCannotRunIsOneErrorPerProblem) {
  Layout l;
  l.tp = 3, l.pp = 2, l.dp = 2;  // 12 ranks on 16 GPUs; 64 heads % 3
  l.schedule = Schedule::kInterleaved, l.virtual_stages = 2, l.num_microbatches = 3;  // 3 % pp = 2
  const auto findings = check(llama3_70b(), cluster_of(h100(), 16), l);
  ASSERT_EQ(findings.size(), 3u);
  for (const auto& finding : findings) {
    EXPECT_EQ(finding.code, "TDX008");
    EXPECT_EQ(finding.severity, "error");
  }
  EXPECT_NE(findings[0].message.find("= 12 must equal the cluster's 16 GPUs"), std::string::npos);
  EXPECT_NE(findings[1].message.find("tp=3 must divide ModelSpec.num_heads=64"), std::string::npos);
  EXPECT_NE(findings[2].message.find("needs num_microbatches divisible by pp=2, got 3"), std::string::npos);
  l.tp = 4, l.num_microbatches = 4;
  EXPECT_TRUE(l.problems_for(llama3_70b(), cluster_of(h100(), 16)).empty());
}

TEST(Checks, MixedGpuTypesInsideATensorParallelGroup) {
  ClusterSpec mixed;
  mixed.groups = {{h100(), 12}, {a100(), 4}};  // the second node is half H100, half A100
  Layout l;
  l.tp = 8, l.dp = 2;
  const auto findings = check(llama3_70b(), mixed, l);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].code, "TDX006");
  mixed.groups = {{h100(), 8}, {a100(), 8}};  // one type per node: only data parallelism mixes them
  EXPECT_TRUE(check(llama3_70b(), mixed, l).empty());
}

TEST(Estimate, MemoryBreakdownOfZero3Tp8OnH100) {
  // Llama-3 70B, TP = 8, ZeRO-3 over dp = 4, SP, selective recomputation, s = 4096, b = 1, m = 8.
  Layout l;
  l.tp = 8, l.dp = 4, l.zero_stage = 3, l.sequence_parallel = true, l.recompute = Recompute::kSelective;
  l.num_microbatches = 8;
  const Estimate e = estimate(llama3_70b(), cluster_of(h100(), 32), l);
  const ParamCount params = count_params(llama3_70b());
  const double per_gpu = params.total / 8;  // pp = 1: every layer and both embeddings, split over tp
  EXPECT_NEAR(e.params_per_gpu, per_gpu, 1);
  EXPECT_NEAR(e.params + e.grads + e.optimizer, per_gpu * 16 / 4, 1);
  // One micro-batch in flight without pp; selective with SP: T e [3h/t + (2 + 2g/a) h/t + 2f/t] + 4 T a/t.
  const double selective = 4096.0 * 2 * (3 * 8192 / 8.0 + (2 + 2 * 8 / 64.0) * 8192 / 8 + 2 * 28672 / 8.0) +
                           4 * 4096.0 * 64 / 8;
  // And the model's end: the final norm's bf16 input and output and fp32 1/rms, the loss's bf16 logits,
  // int64 target and fp32 log-sum-exp.
  const double head = 4096.0 * (2 * 8192 / 8.0 * 2 + 4 / 8.0 + 2 * 128256 / 8.0 + 12);
  EXPECT_NEAR(e.activations, 80 * selective + head, 1);
  EXPECT_TRUE(e.fits());
  EXPECT_GT(e.mfu, 0.2);
  EXPECT_LT(e.mfu, 0.7);
}

TEST(Estimate, EachPipelineRankHoldsItsOwnEndsAndMicroBatches) {
  // Llama-3 70B on pp = 4 x tp = 8, ZeRO-1 (bf16 parameters 2 B each, unsharded), SP, selective, m = 8.
  const ModelSpec model = llama3_70b();
  Layout l;
  l.pp = 4, l.tp = 8, l.zero_stage = 1, l.sequence_parallel = true, l.recompute = Recompute::kSelective;
  l.num_microbatches = 8;
  const Estimate e = estimate(model, cluster_of(h100(), 32), l);
  ASSERT_EQ(e.pipeline_ranks.size(), 4u);
  const double per_layer = layer_activation_bytes(model, l, false), V = 128256, h = 8192, t = 8;
  // The model's end per micro-batch: the final norm's input and output (bf16, sequence-sharded), its fp32
  // 1/rms, and the loss's bf16 logits, int64 target and fp32 log-sum-exp.
  const double head = 4096 * (2 * h / t * 2 + 4 / t + 2 * V / t + 12);
  EXPECT_DOUBLE_EQ(head_activation_bytes(model, l), head);
  // 1F1B's rank r holds p - r micro-batches of its 20 layers; the last rank also one micro-batch's end.
  for (size_t r = 0; r < 4; ++r) {
    EXPECT_NEAR(e.pipeline_ranks[r].activations, per_layer * 20 * (4 - r) + (r == 3 ? head : 0), 1) << r;
  }
  // Inside the B after that peak, selective's rerun and the layer's gradients on top; the last rank's micro-batch
  // has released its end.
  const double in_pass = layer_rerun_bytes(model, l, false) + layer_backward_bytes(model, l, false);
  for (Schedule schedule : {Schedule::k1F1B, Schedule::kGPipe, Schedule::kInterleaved}) {
    Layout other = l;
    other.schedule = schedule, other.virtual_stages = schedule == Schedule::kInterleaved ? 5 : 1;
    const Estimate o = estimate(model, cluster_of(h100(), 32), other);
    for (size_t r = 0; r < 3; ++r) EXPECT_DOUBLE_EQ(o.pipeline_ranks[r].backward, in_pass) << r;
    EXPECT_DOUBLE_EQ(o.pipeline_ranks[3].backward, std::max(head_backward_bytes(model, other), in_pass - head));
  }
  // The embedding on rank 0; the final norm and LM head on rank 3.
  const RankMemory &first = e.pipeline_ranks[0], &middle = e.pipeline_ranks[1], &last = e.pipeline_ranks[3];
  EXPECT_NEAR(first.params - middle.params, 2 * V * h / t, 1);
  EXPECT_NEAR(last.params - middle.params, 2 * (V * h + h) / t, 1);
  // The estimate is the fullest rank's: the first (four micro-batches).
  EXPECT_EQ(e.fullest_pipeline_rank, 0);
  EXPECT_DOUBLE_EQ(e.total_memory(), first.total());
  EXPECT_NEAR(e.params_per_gpu, (count_params(model).total - 2 * V * h - h) / 4 / t + (V * h + h) / t, 1);

  // ZeRO-3 over dp = 4 with the pipeline: each rank's bf16 parameters sharded (2 B / 4), its whole stage
  // unsharded (2 B, a buffer) with its gradients accumulated unsharded in fp32 (4 B): the sharded gradients
  // exist only after the step's reduce-scatter, when no activations are held.
  Layout zero3 = l;
  zero3.zero_stage = 3, zero3.dp = 4;
  const Estimate z = estimate(model, cluster_of(h100(), 128), zero3);
  for (size_t r = 0; r < 4; ++r) {
    const double held = z.pipeline_ranks[r].params / 2 * 4;  // the rank's parameters, from their sharded bytes
    EXPECT_NEAR(z.pipeline_ranks[r].grads, 4 * held, 1) << r;
    EXPECT_NEAR(z.pipeline_ranks[r].buffers, 2 * held + 2.0 * kGiB, 1) << r;
    EXPECT_NEAR(z.pipeline_ranks[r].optimizer, 12 * held / 4, 1) << r;
  }
  EXPECT_NEAR(z.pipeline_ranks[3].params - z.pipeline_ranks[1].params, 2 * (V * h + h) / t / 4, 1);

  // ZB-V's V puts the first and the last stage on rank 0.
  l.schedule = Schedule::kZbV;
  const Estimate v = estimate(model, cluster_of(h100(), 32), l);
  EXPECT_NEAR(v.pipeline_ranks[0].params - v.pipeline_ranks[1].params, 2 * (2 * V * h + h) / t, 1);
  // Each rank its own peak of the simulated order, with the deferred W inputs: on ranks 1-3 in half-stage chunk
  // units; rank 0's chunks are the ends, the embedding's W input on the first and the head's forward
  // and W input on the last.
  const double w = layer_weight_grad_input_bytes(model, l, false);
  const auto timeline = simulate_schedule(4, 8, Schedule::kZbV);
  const auto units = peak_held_activations_per_rank(timeline, 4, w / per_layer);
  for (size_t r : {1, 2, 3}) EXPECT_NEAR(v.pipeline_ranks[r].activations, per_layer * 20 * units[r] / 2, 1) << r;
  std::vector<StageBytes> stages(8, {per_layer * 10, w * 10});
  stages.front().weight_input += embedding_weight_grad_input_bytes(model, l);
  EXPECT_DOUBLE_EQ(embedding_weight_grad_input_bytes(model, l), 4096 * (2 * h + 8));
  stages.back().forward += head;
  stages.back().weight_input += head_weight_grad_input_bytes(model, l);
  EXPECT_DOUBLE_EQ(head_weight_grad_input_bytes(model, l), 4096 * 2 * (3 * h / t + V / t));
  const auto with_ends = peak_held_bytes_per_rank(timeline, 4, Schedule::kZbV, stages);
  for (size_t r = 0; r < 4; ++r) EXPECT_NEAR(v.pipeline_ranks[r].activations, with_ends[r], 1) << r;
  // The backward: what it adds inside the simulated B passes to each rank's peak between passes, a chunk's
  // bottom layer rerunning and running its backward (no weight gradients: deferred) on top of the 9 W inputs
  // queued above it (the last stage's B also queues the head's and releases its forward first).
  const double queued_above = 9 * std::max(0.0, w - per_layer);
  const double split_pass = layer_rerun_bytes(model, l, false) + layer_backward_bytes(model, l, false);
  EXPECT_LT(split_pass, in_pass);
  for (auto& stage : stages) stage.backward_peak = queued_above + split_pass;
  stages.back().backward_peak =
      std::max(head_backward_bytes(model, l),
               head_weight_grad_input_bytes(model, l) - head + queued_above + split_pass);
  const auto inside_b = peak_held_bytes_per_rank(timeline, 4, Schedule::kZbV, stages);
  for (size_t r = 0; r < 4; ++r) EXPECT_NEAR(v.pipeline_ranks[r].backward, inside_b[r] - with_ends[r], 1) << r;
  EXPECT_GT(with_ends[0], per_layer * 20 * units[0] / 2 + head);
  EXPECT_NEAR(v.params_per_gpu, (count_params(model).total - 2 * V * h - h) / 4 / t + (2 * V * h + h) / t, 1);
}

TEST(Estimate, MoeTokensTravelOnceToEachRankHoldingOneOfTheirExperts) {
  // E = 8, k = 2, ep = 2: the other rank holds none of the two experts with probability C(4,2)/C(8,2) = 6/28.
  EXPECT_DOUBLE_EQ(expected_remote_ranks(8, 2, 2), 22.0 / 28.0);
  // One expert per rank: nothing to deduplicate, k (ep - 1) / ep.
  EXPECT_DOUBLE_EQ(expected_remote_ranks(8, 2, 8), 2.0 * 7.0 / 8.0);
  EXPECT_DOUBLE_EQ(expected_remote_ranks(8, 2, 1), 0.0);
  // DeepSeek-V3's 256 experts, top-8, over 64 ranks: 63 (1 - C(252,8)/C(256,8)) = 7.556 ranks, not 7.875 copies.
  EXPECT_NEAR(expected_remote_ranks(256, 8, 64), 7.5558, 1e-4);
}

TEST(Estimate, ContextParallelBytesFollowTheAttention) {
  // Llama-3 70B (64 heads, 8 kv heads, head_dim 128), tp = 8, cp = 8, s = 32768, b = 1, bf16: one head of
  // the local sequence is 4096 x 128 x 2 bytes; per layer the ring sends its K/V (1 kv head of a tp rank)
  // 3 (r - 1) + 1 times, Ulysses (u - 1) / u of q + out (8 heads) and k + v (1 kv head, replicated to one
  // per Ulysses rank) both ways.
  Layout l;
  l.tp = 8, l.cp = 8, l.zero_stage = 3, l.sequence_parallel = true, l.seq_len = 32768;
  const double head = 4096.0 * 128 * 2;
  auto cp_bytes = [&](int64_t ulysses) {
    Layout with = l;
    with.cp_ulysses = ulysses;
    return estimate(llama3_70b(), cluster_of(h100(), 64), with).comm.at("cp").bytes;
  };
  EXPECT_NEAR(cp_bytes(1), 80 * 2 * 1 * head * (3 * 7 + 1), 1);
  EXPECT_NEAR(cp_bytes(8), 80 * 2 * (2 * 8 + 2 * 8) * 7 / 8.0 * head, 1);
  EXPECT_NEAR(cp_bytes(2), 80 * (2 * (2 * 8 + 2 * 2) / 2.0 * head + 2 * 2 * head * (3 * 3 + 1)), 1);
}

// estimate()'s parts (estimate.h), each against a closed form on small models whose numbers are written out here,
// and estimate() as their composition.

namespace {

// 4 layers, h = 64, 4 heads of 16 (2 kv heads: k and v 64 x 32), SwiGLU 128, vocabulary 100. Per layer: q, o
// 64 x 64 each, k, v 64 x 32 each, two norms 64, the MLP 3 x 64 x 128: 12416 + 24576 = 36992. The input embedding
// 100 x 64 = 6400; the LM head and final norm 6400 + 64 = 6464. In all 4 x 36992 + 12864 = 160832.
ModelSpec tiny_dense() {
  ModelSpec m;
  m.num_layers = 4, m.hidden = 64, m.num_heads = 4, m.num_kv_heads = 2, m.ffn_hidden = 128, m.vocab_size = 100;
  return m;
}
constexpr double kTinyLayer = 36992, kTinyEmbedding = 6400, kTinyHead = 6464;

// 4 layers, the first dense, three MoE (8 experts of width 32, top-2, one shared expert), h = 64, 4 heads and 4 kv
// heads, vocabulary 100. Attention and norms per layer 2 x 64 x 64 + 2 x 64 x 64 + 2 x 64 = 16512; the dense MLP
// 3 x 64 x 128 = 24576; an expert 3 x 64 x 32 = 6144, a router 64 x 8 = 512. Routed experts 3 x 8 x 6144 = 147456;
// shared experts and routers 3 x (6144 + 512) = 19968; the rest of the layers 4 x 16512 + 24576 + 19968 = 110592;
// the ends 12864. Active per token: 110592 + 12864 + 3 x 2 x 6144 (routed top-2: 36864) = 160320.
ModelSpec tiny_moe() {
  ModelSpec m;
  m.num_layers = 4, m.hidden = 64, m.num_heads = 4, m.num_kv_heads = 4, m.ffn_hidden = 128, m.vocab_size = 100;
  m.num_experts = 8, m.experts_per_token = 2, m.moe_ffn_hidden = 32, m.num_dense_layers = 1, m.num_shared_experts = 1;
  return m;
}
constexpr double kMoeLayers = 110592, kMoeExperts = 147456, kMoeEnds = 12864, kMoeActive = 160320;
constexpr double kMoeRoutedActive = 36864, kMoeShared = 19968;

// One micro-batch's [b, s/cp, h] of the tiny models at b = 1, s = 256, bf16: 256 x 64 x 2 bytes.
constexpr double kTinyActivation = 256.0 * 64 * 2;

void expect_close(double actual, double expected) { EXPECT_NEAR(actual, expected, 1e-12 * std::abs(expected)); }

}  // namespace

TEST(EstimateParts, RankParamsSplitTheLayersOverTpTheExpertsOverEpAndHoldTheEnds) {
  Layout l;
  l.tp = 2, l.pp = 2;  // 1F1B: two layers per stage, the embedding on rank 0, the head and final norm on rank 1
  RankParams p = rank_params(tiny_dense(), l);
  EXPECT_DOUBLE_EQ(p.dense_layers, 2 * kTinyLayer / 2);
  EXPECT_DOUBLE_EQ(p.experts, 0);
  ASSERT_EQ(p.ends.size(), 2u);
  EXPECT_DOUBLE_EQ(p.ends[0], kTinyEmbedding / 2);
  EXPECT_DOUBLE_EQ(p.ends[1], kTinyHead / 2);
  EXPECT_EQ(p.busiest, 1);
  EXPECT_DOUBLE_EQ(p.total(1), kTinyLayer + kTinyHead / 2);
  // ZB-V's V puts both ends on rank 0.
  l.schedule = Schedule::kZbV;
  p = rank_params(tiny_dense(), l);
  EXPECT_DOUBLE_EQ(p.ends[0], (kTinyEmbedding + kTinyHead) / 2);
  EXPECT_DOUBLE_EQ(p.ends[1], 0);
  EXPECT_EQ(p.busiest, 0);
  // 4 layers on 3 stages: ceil(4 / 3) = 2 layers each at most; the middle rank holds no end.
  l.tp = 1, l.pp = 3, l.schedule = Schedule::k1F1B;
  p = rank_params(tiny_dense(), l);
  EXPECT_DOUBLE_EQ(p.dense_layers, 2 * kTinyLayer);
  EXPECT_EQ(p.ends, (std::vector<double>{kTinyEmbedding, 0, kTinyHead}));
  EXPECT_EQ(p.busiest, 2);
  // MoE over ep = 2 and tp = 2 without pp: the routed experts split over ep only, the rest over tp.
  Layout moe;
  moe.tp = 2, moe.ep = 2;
  p = rank_params(tiny_moe(), moe);
  EXPECT_DOUBLE_EQ(p.dense_layers, kMoeLayers / 2);
  EXPECT_DOUBLE_EQ(p.experts, kMoeExperts / 2);
  EXPECT_EQ(p.ends, (std::vector<double>{kMoeEnds / 2}));
  EXPECT_DOUBLE_EQ(p.total(0), (kMoeLayers + kMoeEnds) / 2 + kMoeExperts / 2);
}

TEST(EstimateParts, RankActivationsHoldEachRanksMicroBatchesAndTheModelsEnd) {
  const ModelSpec model = tiny_dense();
  Layout l;
  l.seq_len = 256, l.recompute = Recompute::kSelective;
  const double layer = layer_activation_bytes(model, l, false), head = head_activation_bytes(model, l);
  const double in_pass = layer_rerun_bytes(model, l, false) + layer_backward_bytes(model, l, false);
  ASSERT_GT(layer, 0);
  // One rank: one micro-batch of the 4 layers and the model's end; inside its B the top layer's rerun and
  // gradients once the head has released its forward, or the head's own backward if larger.
  RankActivations a = rank_activations(model, l);
  ASSERT_EQ(a.activations.size(), 1u);
  ASSERT_EQ(a.backward.size(), 1u);
  EXPECT_DOUBLE_EQ(a.activations[0], 4 * layer + head);
  EXPECT_DOUBLE_EQ(a.backward[0], std::max(head_backward_bytes(model, l), in_pass - head));
  // 1F1B over pp = 2 with m = 4: rank 0 holds min(2 - 0, 4) = 2 micro-batches of its 2 layers, rank 1 one, and
  // the end.
  l.pp = 2, l.num_microbatches = 4;
  a = rank_activations(model, l);
  ASSERT_EQ(a.activations.size(), 2u);
  EXPECT_DOUBLE_EQ(a.activations[0], 2 * 2 * layer);
  EXPECT_DOUBLE_EQ(a.activations[1], 1 * 2 * layer + head);
  EXPECT_DOUBLE_EQ(a.backward[0], in_pass);
  EXPECT_DOUBLE_EQ(a.backward[1], std::max(head_backward_bytes(model, l), in_pass - head));
  // GPipe holds every micro-batch, the end's included.
  l.schedule = Schedule::kGPipe;
  a = rank_activations(model, l);
  EXPECT_DOUBLE_EQ(a.activations[0], 4 * 2 * layer);
  EXPECT_DOUBLE_EQ(a.activations[1], 4 * 2 * layer + 4 * head);
}

TEST(EstimateParts, RankMemoryIsModelStatesActivationsAndBuffers) {
  const ModelSpec model = tiny_dense();
  constexpr double kReserve = 2.0 * kGiB;  // the framework reserve
  Layout l;
  l.seq_len = 256, l.pp = 2, l.dp = 2, l.zero_stage = 1, l.num_microbatches = 4;
  // ZeRO-1 over dp = 2, bf16-mixed: parameters and gradients 2 B each, unsharded; optimizer 12 B over 2.
  // Rank 0: 2 layers and the embedding, rank 1: 2 layers and the head.
  const double held[] = {2 * kTinyLayer + kTinyEmbedding, 2 * kTinyLayer + kTinyHead};
  const RankActivations a = rank_activations(model, l);
  auto ranks = rank_memory(model, l);
  ASSERT_EQ(ranks.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(ranks[r].params, 2 * held[r]) << r;
    EXPECT_DOUBLE_EQ(ranks[r].grads, 2 * held[r]) << r;
    EXPECT_DOUBLE_EQ(ranks[r].optimizer, 12 * held[r] / 2) << r;
    EXPECT_EQ(ranks[r].activations, a.activations[r]) << r;
    EXPECT_EQ(ranks[r].backward, a.backward[r]) << r;
    EXPECT_DOUBLE_EQ(ranks[r].buffers, kReserve) << r;
  }
  // ZeRO-3 with the pipeline: parameters sharded, the stage's unsharded bf16 copy (a buffer) and its gradients
  // accumulated unsharded in fp32.
  l.zero_stage = 3;
  ranks = rank_memory(model, l);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(ranks[r].params, 2 * held[r] / 2) << r;
    EXPECT_DOUBLE_EQ(ranks[r].grads, 4 * held[r]) << r;
    EXPECT_DOUBLE_EQ(ranks[r].optimizer, 12 * held[r] / 2) << r;
    EXPECT_DOUBLE_EQ(ranks[r].buffers, 2 * held[r] + kReserve) << r;
  }
  // ZeRO-3 without pp: everything sharded; two prefetched layers, the embedding and the head (FSDP2's root)
  // unsharded.
  l.pp = 1;
  ranks = rank_memory(model, l);
  ASSERT_EQ(ranks.size(), 1u);
  const double all = 4 * kTinyLayer + kTinyEmbedding + kTinyHead;
  EXPECT_DOUBLE_EQ(ranks[0].params, 2 * all / 2);
  EXPECT_DOUBLE_EQ(ranks[0].grads, 2 * all / 2);
  EXPECT_DOUBLE_EQ(ranks[0].optimizer, 12 * all / 2);
  EXPECT_DOUBLE_EQ(ranks[0].buffers, 2 * (2 * kTinyLayer + kTinyEmbedding + kTinyHead) + kReserve);
  // fp32 training without ZeRO: 4 B parameters, 4 B gradients, 8 B Adam moments.
  l.zero_stage = 0, l.dp = 1, l.precision = Precision::kFp32;
  ranks = rank_memory(model, l);
  EXPECT_DOUBLE_EQ(ranks[0].params, 4 * all);
  EXPECT_DOUBLE_EQ(ranks[0].grads, 4 * all);
  EXPECT_DOUBLE_EQ(ranks[0].optimizer, 8 * all);
  EXPECT_DOUBLE_EQ(ranks[0].buffers, kReserve);
  // MoE, ZeRO-1 over ep = 2: dense parameters replicated over dp x ep = 2 (optimizer sharded over 2), the experts
  // (half of them per rank) over dp = 1.
  Layout moe;
  moe.seq_len = 256, moe.ep = 2, moe.zero_stage = 1;
  ranks = rank_memory(tiny_moe(), moe);
  const double dense = kMoeLayers + kMoeEnds, experts = kMoeExperts / 2;
  EXPECT_DOUBLE_EQ(ranks[0].params, 2 * dense + 2 * experts);
  EXPECT_DOUBLE_EQ(ranks[0].grads, 2 * dense + 2 * experts);
  EXPECT_DOUBLE_EQ(ranks[0].optimizer, 12 * dense / 2 + 12 * experts);
}

TEST(EstimateParts, StepFlopsAreSixNDAndAttention) {
  Layout l;
  l.seq_len = 256, l.micro_batch = 2, l.num_microbatches = 3, l.dp = 2, l.recompute = Recompute::kFull;
  // 2 x 3 x 2 sequences of 256 tokens; 6 N D with N = 160832; attention 6 L s h per token; the model's
  // work whatever the recompute.
  const double tokens = 2 * 3 * 2 * 256.0, all = 4 * kTinyLayer + kTinyEmbedding + kTinyHead;
  StepFlops f = step_flops(tiny_dense(), l);
  EXPECT_DOUBLE_EQ(f.tokens, tokens);
  EXPECT_DOUBLE_EQ(f.gemm, 6 * all * tokens);
  EXPECT_DOUBLE_EQ(f.attention, 6 * 4 * 256.0 * 64 * tokens);
  EXPECT_DOUBLE_EQ(f.model(), 6 * all * tokens + 6 * 4 * 256.0 * 64 * tokens);
  // MoE over ep = 2: 1 x 1 x 1 x 2 sequences, 6 N_active D.
  Layout moe;
  moe.seq_len = 256, moe.ep = 2, moe.expert_imbalance = 1.5;
  f = step_flops(tiny_moe(), moe);
  EXPECT_DOUBLE_EQ(f.tokens, 2 * 256.0);
  EXPECT_DOUBLE_EQ(f.gemm, 6 * kMoeActive * 2 * 256.0);
}

TEST(Compute, AGemmIsTheLongerOfItsFlopsAtTheSustainedRateAndItsBytesAtTheMemorys) {
  const GpuSpec gpu = h100();
  const double n = 8192;
  EXPECT_DOUBLE_EQ(gemm_seconds(n, n, n, gpu, Precision::kBf16Mixed), 2 * n * n * n / (989e12 * 0.73));
  EXPECT_DOUBLE_EQ(gemm_seconds(n, n, n, gpu, Precision::kFp8Mixed), 2 * n * n * n / (1979e12 * 0.56));
  EXPECT_DOUBLE_EQ(gemm_seconds(n, n, n, gpu, Precision::kFp32), 2 * n * n * n / (989e12 * 0.73 * 0.5));
  // A matrix-vector product moves its matrix: memory-bound at 80 % of the HBM bandwidth.
  EXPECT_DOUBLE_EQ(gemm_seconds(n, 1, n, gpu, Precision::kBf16Mixed), (n * n + n + n) * 2 / (3.35e12 * 0.8));
  EXPECT_THROW(gemm_seconds(0, n, n, gpu, Precision::kBf16Mixed), std::invalid_argument);
  EXPECT_THROW(gemm_seconds(n, n, n, a100(), Precision::kFp8Mixed), std::invalid_argument);
}

TEST(Compute, EachPartAnswersTheSettingThatOughtToMoveIt) {
  const ModelSpec model = llama3_70b();
  const ClusterSpec cluster = cluster_of(h100(), 8);
  Layout l;
  l.tp = 8, l.sequence_parallel = true, l.seq_len = 8192, l.num_microbatches = 4, l.norm = NormKernel::kComposite;
  const ComputeTime eager = compute_time(model, cluster, l);
  EXPECT_DOUBLE_EQ(eager.seconds, eager.gemm_seconds + eager.attention_seconds + eager.memory_seconds +
                                      eager.optimizer_seconds);
  // The attention: 4 micro-batches x 80 layers of 2 b s^2 head_dim heads / tp FLOPs forward, 2.5 times
  // that backward, at a flash kernel's 33 % of the peak.
  EXPECT_DOUBLE_EQ(eager.attention_seconds, 4 * 80 * (2 * 8192.0 * 8192 * 128 * 8) * 3.5 / (989e12 * 0.33));
  // An eager attention: its scores' bytes once (3e written, read and written forward, 6e backward per score),
  // not again through the rest's backward factor.
  Layout scores = l;
  scores.attention = AttentionKernel::kEager;
  const double per_score = 9 * 2.0 * 8 * 8192.0 * 8192;  // 9 e, 64 / 8 heads, s_q = s = 8192
  EXPECT_NEAR(compute_time(model, cluster, scores).memory_seconds - eager.memory_seconds,
              4 * 80 * per_score / (3.35e12 * 0.8), 1e-9);
  // Compiled: the same GEMMs and attention, fewer bytes in fused kernels.
  l.compiled = true;
  const ComputeTime compiled = compute_time(model, cluster, l);
  EXPECT_DOUBLE_EQ(compiled.gemm_seconds, eager.gemm_seconds);
  EXPECT_DOUBLE_EQ(compiled.attention_seconds, eager.attention_seconds);
  EXPECT_LT(compiled.memory_seconds, eager.memory_seconds / 2);
  // Full recompute reruns each block's forward: its GEMMs (a third of a linear's three) and the
  // attention's (1 of its 3.5).
  l.recompute = Recompute::kFull;
  const ComputeTime full = compute_time(model, cluster, l);
  EXPECT_DOUBLE_EQ(full.attention_seconds, compiled.attention_seconds * 4.5 / 3.5);
  EXPECT_GT(full.gemm_seconds, compiled.gemm_seconds * 1.3);
  EXPECT_LT(full.gemm_seconds, compiled.gemm_seconds * 4 / 3);  // the LM head is not rerun
  // fp8 GEMMs: faster GEMMs, the attention unchanged, casts added to the memory-bound bytes.
  l.recompute = Recompute::kNone, l.precision = Precision::kFp8Mixed;
  const ComputeTime fp8 = compute_time(model, cluster, l);
  EXPECT_LT(fp8.gemm_seconds, compiled.gemm_seconds * 0.7);
  EXPECT_DOUBLE_EQ(fp8.attention_seconds, compiled.attention_seconds);
  EXPECT_GT(fp8.memory_seconds, compiled.memory_seconds);
  // A mixed cluster runs at its slowest GPU's pace; an A100 has no fp8.
  ClusterSpec mixed;
  mixed.groups = {{h100(), 4}, {a100(), 4}};
  l.precision = Precision::kBf16Mixed;
  EXPECT_DOUBLE_EQ(compute_time(model, mixed, l).seconds, compute_time(model, cluster_of(a100(), 8), l).seconds);
  l.precision = Precision::kFp8Mixed;
  const std::vector<std::string> problems = l.problems_for(model, mixed);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("GPU a100-80gb has no fp8 tensor cores"), std::string::npos) << problems[0];
}

TEST(EstimateParts, TpBytesCountTheBlocksCollectivesAndTheEnds) {
  // In units of (t - 1)/t X per micro-batch, X = [b, s, h] at 2 bytes; tp = 2, m = 2. A fused block (c = 1) is
  // 2 + 2c = 4 units without SP and 3c + 2 = 5 with it; the ends (embedding and head) 2 + 2, with SP 2 + 3.
  const ModelSpec model = tiny_dense();
  Layout l;
  l.seq_len = 256, l.num_microbatches = 2, l.tp = 2;
  const double x = kTinyActivation / 2;  // (t - 1) / t X
  EXPECT_DOUBLE_EQ(tp_bytes(model, l), 2 * (4 * (4 + 4) + 4) * x);
  l.recompute = Recompute::kFull;  // the forward's all-reduce again: 2 more per block
  EXPECT_DOUBLE_EQ(tp_bytes(model, l), 2 * (4 * (6 + 6) + 4) * x);
  l.recompute = Recompute::kNone, l.sequence_parallel = true;
  EXPECT_DOUBLE_EQ(tp_bytes(model, l), 2 * (4 * (5 + 5) + 5) * x);
  l.recompute = Recompute::kFull;  // the forward's c all-gathers and reduce-scatter again: c + 1 more
  EXPECT_DOUBLE_EQ(tp_bytes(model, l), 2 * (4 * (7 + 7) + 5) * x);
  // fp8 GEMMs carry the columns' inputs and the row's output gradient as fp8 (1 B: 1/2 unit): (c + 1)(1 + 1/2).
  l.recompute = Recompute::kNone, l.precision = Precision::kFp8Mixed;
  EXPECT_DOUBLE_EQ(tp_bytes(model, l), 2 * (4 * (3 + 3) + 5) * x);
  // Unfused projections: q, k, v (c = 3: 11 units) and gate, up (c = 2: 8 units) each gather their input.
  ModelSpec unfused = model;
  unfused.fused_projections = false;
  l.precision = Precision::kBf16Mixed;
  EXPECT_DOUBLE_EQ(tp_bytes(unfused, l), 2 * (4 * (11 + 8) + 5) * x);
  // pp = 2: the busiest rank (the last, with the head) has 2 layers and the head's 3 units.
  l.pp = 2;
  EXPECT_DOUBLE_EQ(tp_bytes(model, l), 2 * (2 * (5 + 5) + 3) * x);
  // MoE layers (3 of 4) gather the experts' tokens with SP: 2 units in place of the MLP's 5.
  Layout moe = l;
  moe.pp = 1;
  EXPECT_DOUBLE_EQ(tp_bytes(tiny_moe(), moe), 2 * (4 * 5 + 5 + 3 * 2 + 5) * x);
  l.tp = 1;
  EXPECT_EQ(tp_bytes(model, l), 0);
}

TEST(EstimateParts, CpBytesAreTheRingsAndUlyssesExchanges) {
  // The figures of ContextParallelBytesFollowTheAttention (Llama-3 70B, tp = 8, cp = 8, s = 32768), with the
  // ring's part apart: all of it at u = 1, none at u = 8 (r = 1), and at u = 2 its 4 ring ranks' K/V.
  Layout l;
  l.tp = 8, l.cp = 8, l.zero_stage = 3, l.sequence_parallel = true, l.seq_len = 32768;
  const double head = 4096.0 * 128 * 2;
  l.cp_ulysses = 1;
  CpBytes cp = cp_bytes(llama3_70b(), l);
  EXPECT_NEAR(cp.total, 80 * 2 * 1 * head * (3 * 7 + 1), 1);
  EXPECT_DOUBLE_EQ(cp.ring, cp.total);
  l.cp_ulysses = 8;
  cp = cp_bytes(llama3_70b(), l);
  EXPECT_NEAR(cp.total, 80 * 2 * (2 * 8 + 2 * 8) * 7 / 8.0 * head, 1);
  EXPECT_EQ(cp.ring, 0);
  l.cp_ulysses = 2;
  cp = cp_bytes(llama3_70b(), l);
  EXPECT_NEAR(cp.ring, 80 * 2 * 2 * head * (3 * 3 + 1), 1);
  EXPECT_NEAR(cp.total, 80 * (2 * (2 * 8 + 2 * 2) / 2.0 * head + 2 * 2 * head * (3 * 3 + 1)), 1);
  // With micro-batches and pp: per micro-batch, the stage's layers (m = 4, 40 layers).
  l.num_microbatches = 4, l.pp = 2;
  EXPECT_NEAR(cp_bytes(llama3_70b(), l).total, 4 * 40 * (2 * (2 * 8 + 2 * 2) / 2.0 * head + 2 * 2 * head * 10), 1);
  l.cp = 1, l.cp_ulysses = 1;
  cp = cp_bytes(llama3_70b(), l);
  EXPECT_EQ(cp.total, 0);
  EXPECT_EQ(cp.ring, 0);
}

TEST(EstimateParts, EpBytesAreTheMoeAllToAllsOfTheRowsSentElsewhere) {
  // 3 MoE layers, m = 2, X the micro-batch's [b, s, h]: 4 all-to-alls a layer, each of the rows going to the
  // other ep rank (E = 8, k = 2, ep = 2: 22/28 of a token) times the busiest rank's share ((ep + x (ep - 2)) /
  // (2 (ep - 1)) = 1 at ep = 2).
  const ModelSpec model = tiny_moe();
  Layout l;
  l.seq_len = 256, l.num_microbatches = 2, l.ep = 2, l.expert_imbalance = 1.5;
  expect_close(ep_bytes(model, l), 2 * 3 * 4 * kTinyActivation * 22 / 28);
  // Full recompute reruns the experts' forward: 6 all-to-alls.
  l.recompute = Recompute::kFull;
  expect_close(ep_bytes(model, l), 2 * 3 * 6 * kTinyActivation * 22 / 28);
  l.recompute_experts = false;
  expect_close(ep_bytes(model, l), 2 * 3 * 4 * kTinyActivation * 22 / 28);
  // ep = 4 at imbalance 2: 3 (1 - C(6,2)/C(8,2)) = 39/28 other ranks a token, and (4 + 2 x 2) / 6 = 4/3 of them.
  l.recompute = Recompute::kNone, l.recompute_experts = true, l.ep = 4, l.expert_imbalance = 2;
  expect_close(ep_bytes(model, l), 2 * 3 * 4 * kTinyActivation * 39 / 28 * 4 / 3);
  // cp = 2 halves the local sequence.
  l.cp = 2;
  expect_close(ep_bytes(model, l), 2 * 3 * 4 * kTinyActivation / 2 * 39 / 28 * 4 / 3);
  l.ep = 1, l.expert_imbalance = 1;
  EXPECT_EQ(ep_bytes(model, l), 0);
}

TEST(EstimateParts, DpBytesAreTheGradientsAllReduceOrZero3sGathers) {
  const ModelSpec model = tiny_dense();
  const double blocks = 4 * kTinyLayer, ends = kTinyEmbedding + kTinyHead;
  Layout l;
  l.dp = 4, l.zero_stage = 1, l.num_microbatches = 2;
  // ZeRO 0-2: an all-reduce of the bf16 gradients, 2 (dp - 1)/dp of 2 B a parameter.
  expect_close(dp_bytes(model, l), 2 * 3.0 / 4 * 2 * (blocks + ends));
  // ZeRO-3: a reduce-scatter of the gradients, and all-gathers: the blocks' twice per micro-batch, the root's once.
  l.zero_stage = 3;
  expect_close(dp_bytes(model, l), 3.0 / 4 * 2 * ((2 * 2 + 1) * blocks + (2 + 1) * ends));
  // ZeRO-3 with pp: every gather once per step, for the busiest rank's parameters (the last: 2 layers and the head).
  l.pp = 2;
  expect_close(dp_bytes(model, l), 3.0 / 4 * 2 * 2 * (2 * kTinyLayer + kTinyHead));
  // cp ranks hold the same parameters: they reduce the gradients too.
  l.pp = 1, l.dp = 1, l.cp = 2, l.zero_stage = 1;
  expect_close(dp_bytes(model, l), 2 * 1.0 / 2 * 2 * (blocks + ends));
  // MoE, ep = 2, dp = 2: dense parameters over dp x ep = 4 ranks, the rank's experts over dp = 2.
  Layout moe;
  moe.dp = 2, moe.ep = 2, moe.zero_stage = 1;
  expect_close(dp_bytes(tiny_moe(), moe), 2 * 3.0 / 4 * 2 * (kMoeLayers + kMoeEnds) + 2 * 1.0 / 2 * 2 * kMoeExperts / 2);
  // fp32 training moves 4 B a parameter.
  l.cp = 1, l.dp = 4, l.precision = Precision::kFp32;
  expect_close(dp_bytes(model, l), 2 * 3.0 / 4 * 4 * (blocks + ends));
  l.dp = 1;
  EXPECT_EQ(dp_bytes(model, l), 0);
}

TEST(EstimateParts, PpBytesAreTheBusiestRanksStageBoundaryMessages) {
  // m = 4 micro-batches of X = [b, s, h] at 2 bytes.
  const ModelSpec model = tiny_dense();
  Layout l;
  l.seq_len = 256, l.num_microbatches = 4, l.pp = 2;
  // Two stages: rank 0 sends activations forward, rank 1 gradients backward: one message a micro-batch each.
  EXPECT_DOUBLE_EQ(pp_bytes(model, l), 4 * 1 * kTinyActivation);
  // Four: the middle ranks send both ways.
  l.pp = 4;
  EXPECT_DOUBLE_EQ(pp_bytes(model, l), 4 * 2 * kTinyActivation);
  // Interleaved, 2 ranks x 2 chunks (stages 0, 2 | 1, 3): each rank sends 3 messages a micro-batch.
  l.pp = 2, l.schedule = Schedule::kInterleaved, l.virtual_stages = 2;
  EXPECT_DOUBLE_EQ(pp_bytes(model, l), 4 * 3 * kTinyActivation);
  // ZB-V (stages 0, 3 | 1, 2): the turn at rank 1 sends nothing: 2 a micro-batch.
  l.schedule = Schedule::kZbV, l.virtual_stages = 1;
  EXPECT_DOUBLE_EQ(pp_bytes(model, l), 4 * 2 * kTinyActivation);
  // The sequence-parallel activation is split over tp.
  l.schedule = Schedule::k1F1B, l.tp = 2, l.sequence_parallel = true;
  EXPECT_DOUBLE_EQ(pp_bytes(model, l), 4 * 1 * kTinyActivation / 2);
  l.pp = 1;
  EXPECT_EQ(pp_bytes(model, l), 0);
}

TEST(EstimateParts, EstimateIsTheCompositionOfItsParts) {
  struct Case {
    ModelSpec model;
    ClusterSpec cluster;
    Layout layout;
  };
  std::vector<Case> cases;
  {
    Layout l;  // MemoryBreakdownOfZero3Tp8OnH100's layout
    l.tp = 8, l.dp = 4, l.zero_stage = 3, l.sequence_parallel = true, l.recompute = Recompute::kSelective;
    l.num_microbatches = 8;
    cases.push_back({llama3_70b(), cluster_of(h100(), 32), l});
    l.dp = 1, l.pp = 4, l.zero_stage = 1, l.schedule = Schedule::kZbV;
    cases.push_back({llama3_70b(), cluster_of(h100(), 32), l});
  }
  {
    // Every axis at once on a mixed cluster of 4-GPU domains: hybrid cp, skewed MoE routing, ZeRO-3 with pp, fp8.
    Layout l;
    l.tp = 2, l.cp = 2, l.cp_ulysses = 2, l.ep = 2, l.dp = 2, l.pp = 2, l.zero_stage = 3, l.sequence_parallel = true;
    l.recompute = Recompute::kFull, l.recompute_experts = false, l.expert_imbalance = 1.5;
    l.precision = Precision::kFp8Mixed, l.num_microbatches = 4, l.seq_len = 256;
    ClusterSpec mixed;
    mixed.groups = {{b200(), 16}, {h100(), 16}}, mixed.gpus_per_domain = 4;
    cases.push_back({tiny_moe(), mixed, l});
    // Interleaved, ring attention, ZeRO-1, fp32.
    Layout r;
    r.pp = 2, r.schedule = Schedule::kInterleaved, r.virtual_stages = 2, r.cp = 2, r.dp = 2, r.zero_stage = 1;
    r.precision = Precision::kFp32, r.num_microbatches = 4, r.seq_len = 256;
    cases.push_back({tiny_dense(), cluster_of(a100(), 8), r});
  }
  for (const Case& c : cases) {
    const Layout& l = c.layout;
    SCOPED_TRACE(std::to_string(l.tp) + " tp, " + std::to_string(l.cp) + " cp, " + std::to_string(l.ep) + " ep, " +
                 std::to_string(l.dp) + " dp, " + std::to_string(l.pp) + " pp, " + option_name(l.schedule));
    const Estimate e = estimate(c.model, c.cluster, l);
    // Memory: the ranks of rank_memory, the fullest's fields, the busiest rank's parameters.
    const RankParams held = rank_params(c.model, l);
    EXPECT_EQ(e.params_per_gpu, held.total(held.busiest));
    const std::vector<RankMemory> ranks = rank_memory(c.model, l);
    ASSERT_EQ(e.pipeline_ranks.size(), ranks.size());
    ASSERT_EQ(ranks.size(), static_cast<size_t>(l.pp));
    size_t fullest = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      EXPECT_EQ(e.pipeline_ranks[r].params, ranks[r].params) << r;
      EXPECT_EQ(e.pipeline_ranks[r].grads, ranks[r].grads) << r;
      EXPECT_EQ(e.pipeline_ranks[r].optimizer, ranks[r].optimizer) << r;
      EXPECT_EQ(e.pipeline_ranks[r].activations, ranks[r].activations) << r;
      EXPECT_EQ(e.pipeline_ranks[r].backward, ranks[r].backward) << r;
      EXPECT_EQ(e.pipeline_ranks[r].buffers, ranks[r].buffers) << r;
      if (ranks[r].total() > ranks[fullest].total()) fullest = r;
    }
    EXPECT_EQ(e.fullest_pipeline_rank, static_cast<long>(fullest));
    EXPECT_EQ(e.params, ranks[fullest].params);
    EXPECT_EQ(e.grads, ranks[fullest].grads);
    EXPECT_EQ(e.optimizer, ranks[fullest].optimizer);
    EXPECT_EQ(e.activations, ranks[fullest].activations);
    EXPECT_EQ(e.backward, ranks[fullest].backward);
    EXPECT_EQ(e.buffers, ranks[fullest].buffers);
    EXPECT_EQ(e.gpu_memory, c.cluster.min_memory_bytes());
    // Compute.
    const StepFlops flops = step_flops(c.model, l);
    const ComputeTime compute = compute_time(c.model, c.cluster, l);
    EXPECT_EQ(e.tokens_per_step, flops.tokens);
    EXPECT_EQ(e.model_flops_per_step, flops.model());
    EXPECT_EQ(e.compute.seconds, compute.seconds);
    EXPECT_EQ(e.bubble, l.pp > 1 ? bubble_fraction(l.pp, l.num_microbatches, l.schedule, l.virtual_stages) : 0.0);
    // Communication: each axis's bytes at 80 % of its slowest link, less what hides behind compute (the cp ring
    // behind the attention, dp behind the backward or, under ZeRO-3, all the compute).
    auto bandwidth = [&](const std::string& axis) {
      double slowest = 0;
      for (const auto& [gpu, count] : c.cluster.groups) {
        const double bw = axis_intra_domain(l, c.cluster, axis) ? gpu.nvlink_bytes_per_s : gpu.internode_bytes_per_s;
        slowest = slowest == 0 ? bw : std::min(slowest, bw);
      }
      return slowest * 0.8;
    };
    std::map<std::string, std::pair<double, double>> expected;  // axis: bytes, seconds hidden behind compute
    if (l.tp > 1) expected["tp"] = {tp_bytes(c.model, l), 0.0};
    if (l.cp > 1) {
      const CpBytes cp = cp_bytes(c.model, l);
      expected["cp"] = {cp.total, std::min(compute.attention_seconds, cp.ring / bandwidth("cp"))};
    }
    if (l.ep > 1) expected["ep"] = {ep_bytes(c.model, l), 0.0};
    const double dp = dp_bytes(c.model, l);
    if (dp > 0) expected["dp"] = {dp, l.zero_stage == 3 ? compute.seconds : compute.seconds * 2 / 3};
    if (l.pp > 1) expected["pp"] = {pp_bytes(c.model, l), 0.0};
    ASSERT_EQ(e.comm.size(), expected.size());
    double exposed = 0;
    for (const auto& [axis, want] : expected) {
      ASSERT_EQ(e.comm.count(axis), 1u) << axis;
      const AxisComm& comm = e.comm.at(axis);
      EXPECT_GT(comm.bytes, 0) << axis;
      EXPECT_EQ(comm.intra_domain, axis_intra_domain(l, c.cluster, axis)) << axis;
      EXPECT_EQ(comm.bytes, want.first) << axis;
      EXPECT_DOUBLE_EQ(comm.seconds, want.first / bandwidth(axis)) << axis;
      EXPECT_DOUBLE_EQ(comm.exposed_seconds, std::max(0.0, comm.seconds - want.second)) << axis;
      exposed += comm.exposed_seconds;
    }
    EXPECT_DOUBLE_EQ(e.step_seconds, e.compute.seconds / (1.0 - e.bubble) + exposed);
    // MFU against the peak each FLOP runs at: the GEMMs' precision's, the LM head's (bf16 under fp8
    // recipes), bf16 for the attention.
    const GpuSpec& gpu = c.cluster.slowest_gpu();
    const bool fp8 = uses_fp8_gemms(l.precision);
    const double gemm_peak = fp8 ? gpu.fp8_flops : l.precision == Precision::kFp32 ? gpu.bf16_flops / 2 : gpu.bf16_flops;
    const double head = fp8 ? 6.0 * static_cast<double>(c.model.hidden * c.model.vocab_size) * flops.tokens : 0;
    const double head_peak = l.precision == Precision::kFp8Fp32 ? gpu.bf16_flops / 2 : gpu.bf16_flops;
    EXPECT_DOUBLE_EQ(e.mfu, ((flops.gemm - head) / gemm_peak + head / head_peak + flops.attention / gpu.bf16_flops) /
                                (static_cast<double>(l.world_size()) * e.step_seconds));
  }
}
