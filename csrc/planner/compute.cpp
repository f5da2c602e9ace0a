#include "planner/compute.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "planner/documents.h"
#include "planner/estimate.h"
#include "planner/memory.h"

namespace tdx::planner {
namespace {

// Memory-bound kernels reach this share of the HBM bandwidth (our MoE permute: about 80 % on the H100 and the
// H200, benchmarks/README.md).
constexpr double kHbmEfficiency = 0.8;
// Host time to issue one eager op (dispatch and launch, no CUDA graphs): a kernel shorter than this leaves
// the GPU waiting, so an op costs at least this much.
constexpr double kLaunchSeconds = 5e-6;
// fp32 GEMMs run as TF32 at half the dense bf16 rate (A100, H100, B200).
constexpr double kTf32Share = 0.5;
// A flash attention's backward recomputes the scores: 5 matmuls to the forward's 2 (Dao 2023).
constexpr double kFlashBackwardShare = 2.5;

double memory_seconds(double bytes, double kernels, const GpuSpec& gpu) {
  return std::max(bytes / (gpu.hbm_bytes_per_s * kHbmEfficiency), kernels * kLaunchSeconds);
}

// Forward shape [m, k] x [k, n] of a linear: its forward (and `reruns` more), its input gradient
// [m, n] x [n, k] and its weight gradient [n, m] x [m, k]; each at least a launch.
double linear_seconds(double m, double n, double k, const GpuSpec& gpu, Precision p, double reruns) {
  auto one = [&](double a, double b, double c) { return std::max(gemm_seconds(a, b, c, gpu, p), kLaunchSeconds); };
  return one(m, n, k) * (1 + reruns) + one(m, k, n) + one(n, k, m);
}

// What one layer (or the model's ends) costs for one micro-batch on one GPU.
struct Work {
  double gemm = 0;            // seconds
  double attention = 0;       // seconds
  double memory_bytes = 0;    // moved by the memory-bound ops, forward, backward and reruns
  double memory_kernels = 0;  // their kernels
  Work& operator+=(const Work& o) {
    gemm += o.gemm, attention += o.attention, memory_bytes += o.memory_bytes, memory_kernels += o.memory_kernels;
    return *this;
  }
  Work scaled(double share) const {
    return {gemm * share, attention * share, memory_bytes * share, memory_kernels * share};
  }
};

// The sizes one GPU sees for one micro-batch.
struct Local {
  double e;        // element bytes of activations (2: 16-bit, 4: fp32)
  double tokens;   // T = micro_batch x seq_len / cp
  double hidden_tokens;  // tokens of the hidden states between blocks: T / tp with sequence parallelism
  double h, q, g;  // hidden; the tp rank's query and key/value widths (kv heads at least one per rank)
  bool eager;      // each memory-bound op its own kernel (not compiled)
};

Local local_sizes(const ModelSpec& model, const Layout& l) {
  Local s{};
  const double t = static_cast<double>(l.tp), hd = static_cast<double>(model.head_dim());
  s.e = element_bytes(l.precision);
  s.tokens = static_cast<double>(l.micro_batch * l.seq_len) / static_cast<double>(l.cp);
  s.hidden_tokens = l.sequence_parallel ? s.tokens / t : s.tokens;
  s.h = static_cast<double>(model.hidden);
  s.q = static_cast<double>(model.num_heads) / t * hd;
  s.g = std::max(static_cast<double>(model.num_kv_heads) / t, 1.0) * hd;
  s.eager = !l.compiled;
  return s;
}

// Bytes and kernels of the memory-bound forward ops per element, eager (torch's composite ops) or fused:
//   RMSNorm: composite: fp32 upcast (e + 4), square (8), mean (4), scale (8), downcast (4 + e), weight (2e) in
//     6 kernels; fused (a norm kernel, or compiled): read and write, 2e.
//   residual add: 3e (fused into the norm when compiled: no kernel of its own).
//   RoPE of q and k: eager as torch's complex multiply in fp32: upcast (e + 4), multiply (12), downcast
//     (4 + e) in 6 kernels; fused 2e.
//   SwiGLU's silu(a) * b: eager 5e in 2 kernels; fused 3e.
double norm_bytes(const Local& s, const Layout& l) {
  return s.eager && l.norm == NormKernel::kComposite ? 28 + 4 * s.e : 2 * s.e;
}
double norm_kernels(const Local& s, const Layout& l) { return s.eager && l.norm == NormKernel::kComposite ? 6 : 1; }

// The attention half of a block (norm, q/k/v/o GEMMs, RoPE, attention, output copy, residual), forward.
Work attention_block(const ModelSpec& model, const Layout& l, const Local& s, const GpuSpec& gpu) {
  const double full_rerun = l.recompute == Recompute::kFull ? 1 : 0;
  Work w;
  const double T = s.tokens;
  if (model.fused_projections) {
    w.gemm += linear_seconds(T, s.q + 2 * s.g, s.h, gpu, l.precision, full_rerun);
  } else {
    w.gemm += linear_seconds(T, s.q, s.h, gpu, l.precision, full_rerun) +
              2 * linear_seconds(T, s.g, s.h, gpu, l.precision, full_rerun);
  }
  w.gemm += linear_seconds(T, s.h, s.q, gpu, l.precision, full_rerun);
  // Causal attention of the rank's T / b queries of each sequence over the whole sequence (the ring brings
  // the rest): 4 s_q s_k head_dim FLOPs per head forward, halved by the mask; packed documents keep their
  // share of it, and the slowest ring rank pays its spread (documents.h).
  const double b = static_cast<double>(l.micro_batch), seq = static_cast<double>(l.seq_len);
  const double heads = s.q / static_cast<double>(model.head_dim());
  const AttentionBalance balance = attention_balance(l);
  const double forward = 2 * b * (T / b) * seq * static_cast<double>(model.head_dim()) * heads * balance.work_share *
                         (1 + balance.spread);
  if (l.attention == AttentionKernel::kFlash) {
    w.attention = forward * (1 + full_rerun + kFlashBackwardShare) / (gpu.bf16_flops * gpu.attention_efficiency);
  } else {  // unfused: both triangles' products as GEMMs (their scores' bytes: eager_scores)
    w.attention = 2 * forward * (3 + full_rerun) / (gpu.bf16_flops * gpu.gemm_efficiency);
  }
  const double hidden = s.hidden_tokens * s.h;
  w.memory_bytes += hidden * (norm_bytes(s, l) + 3 * s.e) +
                    T * (s.q + s.g) * (s.eager ? 20 + 2 * s.e : 2 * s.e) + T * s.q * 2 * s.e;
  w.memory_kernels += s.eager ? norm_kernels(s, l) + 1 + 6 + 1 : 2;
  return w;
}

// An unfused attention's [b, heads, s_q, s] scores through the softmax: written, read and written forward,
// about twice that backward, and the forward's again under full recompute (bytes and kernels of the whole
// step's share of one layer: not passed through with_backward).
Work eager_scores(const ModelSpec& model, const Layout& l, const Local& s) {
  Work w;
  if (l.attention != AttentionKernel::kEager) return w;
  const double full_rerun = l.recompute == Recompute::kFull ? 1 : 0;
  const double heads = s.q / static_cast<double>(model.head_dim());
  w.memory_bytes = (3 + 6 + 3 * full_rerun) * s.e * heads * s.tokens * static_cast<double>(l.seq_len);
  w.memory_kernels = 3 + 6 + 3 * full_rerun;
  return w;
}

// The fp8 casts of linears, each given as (rows, input width, output width): its input cast forward and its
// output gradient cast backward, each the amax, the cast and a transposed fp8 copy for the other GEMM, per
// element: eager 2e + 1 + 2 in 3 kernels; fused (the amax in the read, the transposed copy written by the
// cast) e + 2 in 1.
struct CastedLinear {
  double rows, in, out;
};
Work fp8_casts(const Local& s, std::initializer_list<CastedLinear> linears) {
  Work w;
  for (const CastedLinear& linear : linears) {
    w.memory_bytes += linear.rows * (linear.in + linear.out) * (s.eager ? 2 * s.e + 3 : s.e + 2);
    w.memory_kernels += 2 * (s.eager ? 3 : 1);
  }
  return w;
}

// The casts of a block's attention linears (q, k and v each casting the block input when unfused).
Work attention_casts(const ModelSpec& model, const Local& s) {
  const double T = s.tokens;
  if (model.fused_projections) return fp8_casts(s, {{T, s.h, s.q + 2 * s.g}, {T, s.q, s.h}});
  return fp8_casts(s, {{T, s.h, s.q}, {T, s.h, s.g}, {T, s.h, s.g}, {T, s.q, s.h}});
}

// The dense MLP half of a block: norm, gate and up GEMMs, SwiGLU, down GEMM, residual; forward.
Work dense_mlp(const ModelSpec& model, const Layout& l, const Local& s, const GpuSpec& gpu) {
  const double full_rerun = l.recompute == Recompute::kFull ? 1 : 0;
  const double f = static_cast<double>(model.ffn_hidden) / static_cast<double>(l.tp), T = s.tokens;
  Work w;
  if (model.fused_projections) {
    w.gemm += linear_seconds(T, 2 * f, s.h, gpu, l.precision, full_rerun);
  } else {
    w.gemm += 2 * linear_seconds(T, f, s.h, gpu, l.precision, full_rerun);
  }
  w.gemm += linear_seconds(T, s.h, f, gpu, l.precision, full_rerun);
  w.memory_bytes += s.hidden_tokens * s.h * (norm_bytes(s, l) + 3 * s.e) + T * f * (s.eager ? 5 : 3) * s.e;
  w.memory_kernels += s.eager ? norm_kernels(s, l) + 1 + 2 : 2;
  return w;
}

// The MoE half of a block: norm, router, the experts of this ep rank on the rows routed to them (the
// busiest rank's: expert_imbalance times the mean T k), shared experts on every token, the dispatch's
// permutation and the combine's weighted sum, residual; forward. Experts are not tensor-parallel: the tp
// ranks run them on the same tokens.
Work moe_mlp(const ModelSpec& model, const Layout& l, const Local& s, const GpuSpec& gpu) {
  const double rerun = l.recompute == Recompute::kFull && l.recompute_experts ? 1 : 0;
  const double T = s.tokens, f = static_cast<double>(model.moe_ffn_hidden);
  const double experts = static_cast<double>(model.num_experts), local_experts = experts / static_cast<double>(l.ep);
  const double rows = T * static_cast<double>(model.experts_per_token) * l.expert_imbalance;
  const double rows_per_expert = rows / local_experts;
  Work w;
  w.gemm += linear_seconds(T, experts, s.h, gpu, Precision::kBf16Mixed, rerun);  // the router (bf16 or fp32)
  w.gemm += local_experts * (linear_seconds(rows_per_expert, 2 * f, s.h, gpu, l.precision, rerun) +
                             linear_seconds(rows_per_expert, s.h, f, gpu, l.precision, rerun));
  const double shared = static_cast<double>(model.num_shared_experts) * f;
  if (shared > 0) {
    w.gemm += linear_seconds(T, 2 * shared, s.h, gpu, l.precision, rerun) +
              linear_seconds(T, s.h, shared, gpu, l.precision, rerun);
  }
  const double swiglu = (s.eager ? 5 : 3) * s.e;
  w.memory_bytes += s.hidden_tokens * s.h * (norm_bytes(s, l) + 3 * s.e) + T * experts * 12 +
                    rows * (5 * s.e * s.h + f * swiglu) + T * shared * swiglu;
  w.memory_kernels += s.eager ? norm_kernels(s, l) + 1 + 6 + 2 : 6;
  return w;
}

// The fp8 casts of an MoE half: the experts' w1, w3 and w2 on the routed rows and the shared experts' on
// every token (the router stays in 16 or 32 bits).
Work moe_casts(const ModelSpec& model, const Layout& l, const Local& s) {
  const double f = static_cast<double>(model.moe_ffn_hidden);
  const double shared = static_cast<double>(model.num_shared_experts) * f;
  const double rows = s.tokens * static_cast<double>(model.experts_per_token) * l.expert_imbalance;
  Work w = fp8_casts(s, {{rows, s.h, f}, {rows, s.h, f}, {rows, f, s.h}});
  if (shared > 0) w += fp8_casts(s, {{s.tokens, s.h, shared}, {s.tokens, s.h, shared}, {s.tokens, shared, s.h}});
  return w;
}

// The precision of the LM head's GEMMs: fp8 recipes keep the head in the activations' precision (ours and
// torchtitan's Float8).
Precision head_precision(Precision p) {
  return p == Precision::kFp8Mixed ? Precision::kBf16Mixed : p == Precision::kFp8Fp32 ? Precision::kFp32 : p;
}

// The ends of the model for one micro-batch: the embedding, the final norm, the LM head and the loss.
//   embedding: forward a gather (2e per element), backward a scatter-add into fp32 (e + 8);
//   loss over the tp rank's V / t logits of each token: eager as torch's cross-entropy of fp32 logits:
//   upcast (e + 4), log-softmax (8), gather (4), backward (12), downcast (4 + e): 32 + 2e in 6 kernels; fused
//   (compiled, or a fused cross-entropy) read forward, read and write backward: 3e.
Work model_ends(const ModelSpec& model, const Layout& l, const Local& s, const GpuSpec& gpu) {
  const double v = static_cast<double>(model.vocab_size) / static_cast<double>(l.tp);
  Work w;
  w.gemm = linear_seconds(s.tokens, v, s.h, gpu, head_precision(l.precision), 0);
  w.memory_bytes = s.hidden_tokens * s.h * (2 * s.e + s.e + 8 + 3 * norm_bytes(s, l)) +
                   s.tokens * v * (s.eager ? 32 + 2 * s.e : 3 * s.e);
  w.memory_kernels = s.eager ? 3 + 3 * norm_kernels(s, l) + 6 : 4;
  return w;
}

// The memory-bound ops' backward moves about twice their forward's bytes (each reads what its forward read
// and the output's gradient, and writes the inputs' gradients) in about as many kernels again; a recomputed
// part (selective or full recompute, where it reaches) reruns the forward's.
Work with_backward(Work forward, bool rerun) {
  forward.memory_bytes *= rerun ? 4 : 3;
  forward.memory_kernels *= rerun ? 4 : 3;
  return forward;
}

ComputeTime compute_on(const ModelSpec& model, const Layout& l, const GpuSpec& gpu) {
  const Local s = local_sizes(model, l);
  const double layers = static_cast<double>(model.num_layers);
  const double moe_layers = static_cast<double>(model.num_moe_layers()), dense_layers = layers - moe_layers;
  const bool fp8 = uses_fp8_gemms(l.precision);
  const bool rerun = l.recompute != Recompute::kNone;
  Work block = with_backward(attention_block(model, l, s, gpu), rerun);
  block += eager_scores(model, l, s);
  if (fp8) block += attention_casts(model, s);
  Work per_layer;  // the mean over the layers
  if (dense_layers > 0) {
    Work dense = block;
    dense += with_backward(dense_mlp(model, l, s, gpu), rerun);
    const double f = static_cast<double>(model.ffn_hidden) / static_cast<double>(l.tp), T = s.tokens;
    if (fp8 && model.fused_projections) dense += fp8_casts(s, {{T, s.h, 2 * f}, {T, f, s.h}});
    if (fp8 && !model.fused_projections) dense += fp8_casts(s, {{T, s.h, f}, {T, s.h, f}, {T, f, s.h}});
    per_layer += dense.scaled(dense_layers / layers);
  }
  if (moe_layers > 0) {
    Work moe = block;
    moe += with_backward(moe_mlp(model, l, s, gpu), rerun && l.recompute_experts);
    if (fp8) moe += moe_casts(model, l, s);
    per_layer += moe.scaled(moe_layers / layers);
  }
  const Work ends = model_ends(model, l, s, gpu);
  // Each pipeline rank runs its share of the layers and ends for every micro-batch (ceil(L / pp) layers at
  // most: the bubble of the schedule prices the stage that waits; estimate()).
  const double m = static_cast<double>(l.num_microbatches), pp = static_cast<double>(l.pp);
  ComputeTime time;
  time.gemm_seconds = m * (layers / pp * per_layer.gemm + ends.gemm / pp);
  time.attention_seconds = m * layers / pp * per_layer.attention;
  time.memory_seconds = m * (layers / pp * memory_seconds(per_layer.memory_bytes, per_layer.memory_kernels, gpu) +
                             memory_seconds(ends.memory_bytes, ends.memory_kernels, gpu) / pp);
  // AdamW over the rank's optimizer shard: read the fp32 parameter, gradient and both moments, write the
  // parameter and moments (28 bytes per parameter), in a few fused (foreach) kernels.
  const RankMemory held = rank_memory(model, l).front();
  const double state_bytes_per_param = element_bytes(l.precision) == 4 ? 8 : 12;
  time.optimizer_seconds = memory_seconds(28 * held.optimizer / state_bytes_per_param, 4, gpu);
  time.seconds = time.gemm_seconds + time.attention_seconds + time.memory_seconds + time.optimizer_seconds;
  return time;
}

}  // namespace

double gemm_seconds(double m, double n, double k, const GpuSpec& gpu, Precision precision) {
  if (!(m > 0 && n > 0 && k > 0) || !std::isfinite(m * n * k)) {
    throw std::invalid_argument("gemm_seconds: m, n and k must be positive and finite, got " + std::to_string(m) +
                                ", " + std::to_string(n) + ", " + std::to_string(k));
  }
  const bool fp8 = uses_fp8_gemms(precision);
  if (fp8 && !(gpu.fp8_flops > 0)) {
    throw std::invalid_argument("gemm_seconds: precision " + std::string(option_name(precision)) + " runs fp8 GEMMs: " +
                                "GPU " + gpu.name + " has none (GpuSpec.fp8_flops = 0)");
  }
  const double rate = fp8                            ? gpu.fp8_flops * gpu.fp8_gemm_efficiency
                      : precision == Precision::kFp32 ? gpu.bf16_flops * gpu.gemm_efficiency * kTf32Share
                                                      : gpu.bf16_flops * gpu.gemm_efficiency;
  const double operand = fp8 ? 1 : element_bytes(precision), result = element_bytes(precision);
  const double bytes = (m * k + k * n) * operand + m * n * result;
  return std::max(2 * m * n * k / rate, bytes / (gpu.hbm_bytes_per_s * kHbmEfficiency));
}

ComputeTime compute_time(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout) {
  ComputeTime slowest;
  for (const auto& [gpu, count] : cluster.groups) {
    const ComputeTime time = compute_on(model, layout, gpu);
    if (time.seconds > slowest.seconds) slowest = time;
  }
  return slowest;
}

}  // namespace tdx::planner
