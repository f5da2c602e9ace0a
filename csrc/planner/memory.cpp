#include "planner/memory.h"

#include <algorithm>
#include <stdexcept>

namespace tdx::planner {

ModelStateBytes model_state_bytes(double num_params, int zero_stage, long dp, Precision precision) {
  if (!(num_params > 0)) throw std::invalid_argument("num_params must be positive");
  if (dp < 1) throw std::invalid_argument("dp must be >= 1");
  if (zero_stage < 0 || zero_stage > 3) throw std::invalid_argument("zero_stage must be 0, 1, 2 or 3");
  const bool fp32 = element_bytes(precision) == 4;
  const double param_bytes = fp32 ? 4 : (precision == Precision::kFp8Mixed ? 3 : 2);
  const double shard = 1.0 / static_cast<double>(dp);
  ModelStateBytes bytes;
  bytes.params = num_params * param_bytes * (zero_stage >= 3 ? shard : 1.0);
  bytes.grads = num_params * element_bytes(precision) * (zero_stage >= 2 ? shard : 1.0);
  bytes.optimizer = num_params * (fp32 ? 8 : 12) * (zero_stage >= 1 ? shard : 1.0);
  return bytes;
}

double element_bytes(Precision precision) {
  return precision == Precision::kFp32 || precision == Precision::kFp8Fp32 ? 4 : 2;
}

double activation_bytes_per_layer(double s, double b, double h, double a, long tp, bool sequence_parallel,
                                  Recompute recompute, AttentionKernel attention) {
  if (!(s > 0 && b > 0 && h > 0 && a > 0)) {
    throw std::invalid_argument("seq_len, micro_batch, hidden and num_heads must be positive");
  }
  if (tp < 1) throw std::invalid_argument("tp must be >= 1");
  const double t = static_cast<double>(tp);
  const double sbh = s * b * h;
  if (recompute == Recompute::kFull) return sequence_parallel ? 2 * sbh / t : 2 * sbh;
  // Without SP the layer norms' and dropouts' 10 sbh stay replicated on every tp rank.
  const double linear = sequence_parallel ? 34 / t : 10 + 24 / t;
  if (recompute == Recompute::kSelective) return sbh * linear;
  if (attention == AttentionKernel::kFlash) return sbh * linear + 4 * a * s * b / t;
  return sbh * (linear + 5 * a * s / (h * t));
}

namespace {

// The sizes both per-layer byte counts start from.
struct LayerDims {
  double e;           // bytes per activation element
  double tokens;      // of a micro-batch on one cp rank
  double h, a, g, t;  // hidden size, query heads, key/value heads, tensor-parallel size
  double replicated;  // the share of a [tokens, h] tensor a tp rank holds (1/t with SP, else 1)
};

LayerDims layer_dims(const ModelSpec& model, const Layout& layout) {
  const double t = static_cast<double>(layout.tp);
  return {element_bytes(layout.precision),
          static_cast<double>(layout.micro_batch) * static_cast<double>(layout.seq_len) / static_cast<double>(layout.cp),
          static_cast<double>(model.hidden),
          static_cast<double>(model.num_heads),
          static_cast<double>(model.num_kv_heads),
          t,
          layout.sequence_parallel ? 1 / t : 1.0};
}

// q, k, v and the attention output a tp rank keeps, elements per token.
double attention_heads_per_token(const LayerDims& d) { return (2 + 2 * d.g / d.a) * d.h / d.t; }

// What the attention core keeps for its backward: the fp32 log-sum-exp (flash kernels) or the softmax
// probabilities (eager).
double softmax_bytes(const LayerDims& d, const Layout& layout) {
  if (layout.attention == AttentionKernel::kFlash) return 4 * d.tokens * d.a / d.t;
  return d.tokens * d.e * d.a * static_cast<double>(layout.seq_len) / static_cast<double>(layout.cp) / d.t;
}

// Torch's composite RMSNorm keeps x.float() (x itself in fp32) and the fp32 x * rstd cast back to x's dtype
// (the product itself in fp32), where the fused kernel keeps x alone: bytes per token of one norm.
double composite_norm_extra_per_token(const LayerDims& d, const Layout& layout) {
  if (layout.norm != NormKernel::kComposite) return 0;
  return d.h * d.replicated * (d.e < 4 ? d.e + 4 : d.e);
}

}  // namespace

double layer_activation_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer) {
  const LayerDims dims = layer_dims(model, layout);
  const auto [e, tokens, h, a, g, t, replicated] = dims;
  const double attention_heads = attention_heads_per_token(dims);
  const double lse = 4 * tokens * a / t;
  const double k = static_cast<double>(model.experts_per_token);
  const double f_moe = static_cast<double>(model.moe_ffn_hidden);
  const double shared = static_cast<double>(model.num_shared_experts);
  const double experts = static_cast<double>(model.num_experts);
  // What the MoE (router and experts) keeps without recomputation, on the ep rank whose experts get the most
  // routed rows (layout.expert_imbalance times the mean).
  const double load = layout.expert_imbalance;
  const double router_input = e < 4 ? 4 * h : 0;  // the router's fp32 copy of 16-bit tokens
  const double moe_kept = tokens * e * (k * load * (2 * h + 4 * f_moe) + 4 * f_moe * shared) +
                          tokens * (router_input + 8 * experts + 12 * k);
  // The MoE's input (the FFN norm's output, gathered over tp with SP) is kept by an fp32 router (its .float()
  // is the tensor itself) and by shared experts; a 16-bit router keeps its fp32 copy instead (counted above)
  // and the dispatch only the rows' indices.
  const double moe_input = moe_layer && (e >= 4 || shared > 0) ? tokens * e * h : 0;
  const bool kept_experts = moe_layer && !layout.recompute_experts;
  if (kept_experts && layout.recompute != Recompute::kNone) {
    // The norms and the attention recomputed each on its own keep their inputs: the layer input, the
    // normalised input, the attention's output added back (and under selective the attention's kept tensors).
    if (layout.recompute == Recompute::kFull) return tokens * e * 3 * h * replicated + moe_kept + moe_input;
    const double all_reduce = layout.tp > 1 && !layout.sequence_parallel ? h : 0;
    return tokens * e * (4 * h * replicated + attention_heads + all_reduce) + lse + moe_kept + moe_input;
  }
  if (layout.recompute == Recompute::kFull) return tokens * e * h * replicated;
  if (layout.recompute == Recompute::kSelective) {
    const double mlp = !moe_layer ? 2 * static_cast<double>(model.ffn_hidden) / t
                                  : expected_ranks_per_token(model.num_experts, model.experts_per_token, layout.ep) *
                                            load * h +
                                        (k * load + shared) * (2 * f_moe + h);
    const double moe = moe_layer ? tokens * (4 * experts + 12 * k) : 0;
    const double all_reduces = layout.tp > 1 && !layout.sequence_parallel ? 2 * h : 0;
    return tokens * e * (3 * h * replicated + attention_heads + mlp + all_reduces) + lse + moe;
  }
  const double mlp = moe_layer ? 0 : 4 * static_cast<double>(model.ffn_hidden) / t;
  // An MoE layer counts its input as moe_input instead of the FFN norm's (sequence-sharded) output.
  const double norms = moe_layer ? 3 * h * replicated : 4 * h * replicated;
  double bytes = tokens * e * (norms + attention_heads + h / t + mlp) + 4 * tokens * 2 * replicated +
                 (moe_layer ? moe_kept + moe_input : 0);
  return bytes + 2 * tokens * composite_norm_extra_per_token(dims, layout) + softmax_bytes(dims, layout);
}

double layer_rerun_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer) {
  if (layout.recompute == Recompute::kNone) return 0;
  const LayerDims dims = layer_dims(model, layout);
  const auto [e, tokens, h, a, g, t, replicated] = dims;
  if (moe_layer && !layout.recompute_experts) {
    if (layout.recompute == Recompute::kSelective) return 0;
    // A norm region recreates its output, its fp32 1/rms and the composite kernel's copies; the attention
    // region its projections' outputs, the attention output, the wo input and the softmax statistics.
    const double norm = tokens * (e * h * replicated + 4 * replicated + composite_norm_extra_per_token(dims, layout));
    const double attention = tokens * e * (attention_heads_per_token(dims) + h / t) + softmax_bytes(dims, layout);
    return std::max(norm, attention);
  }
  Layout kept_all = layout;
  kept_all.recompute = Recompute::kNone;
  const double without_recompute = layer_activation_bytes(model, kept_all, moe_layer);
  if (layout.recompute == Recompute::kFull) return without_recompute;
  return without_recompute - layer_activation_bytes(model, layout, moe_layer) + tokens * e * h * replicated;
}

double layer_backward_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer) {
  const auto [e, tokens, h, a, g, t, replicated] = layer_dims(model, layout);
  if (moe_layer) {
    const double rows = static_cast<double>(model.experts_per_token) * layout.expert_imbalance * tokens;
    const double f = static_cast<double>(model.moe_ffn_hidden);
    const double weight_grad = static_cast<double>(model.num_experts / layout.ep) * e * h * f;
    const double down = rows * e * f + weight_grad;
    const double gate = weight_grad + rows * e * (2 * f - h);
    return std::max(down, gate);
  }
  const double f = static_cast<double>(model.ffn_hidden) / t;
  const bool deferred = layout.defers_weight_grads();
  const double weight_grad = deferred ? 0 : e * h * f;
  const double gathered = layout.sequence_parallel && layout.tp > 1 ? tokens * e * h * (1 + replicated) : 0;
  const double down = tokens * e * f + weight_grad + gathered;
  // Split mode keeps the product for the W pass (and the gathered output gradient with it).
  const double gate = deferred ? 3 * tokens * e * f + (gathered > 0 ? tokens * e * h : 0) : 2 * tokens * e * f;
  return std::max(down, gate);
}

double head_activation_bytes(const ModelSpec& model, const Layout& layout) {
  const LayerDims dims = layer_dims(model, layout);
  const auto [e, tokens, h, a, g, t, replicated] = dims;
  const double composite = composite_norm_extra_per_token(dims, layout);
  const double loss = e * static_cast<double>(model.vocab_size) / t + 8 + 4;  // logits, int64 target, fp32 lse
  return tokens * (2 * h * replicated * e + 4 * replicated + composite + loss);
}

double head_backward_bytes(const ModelSpec& model, const Layout& layout) {
  const auto [e, tokens, h, a, g, t, replicated] = layer_dims(model, layout);
  const double vocab = static_cast<double>(model.vocab_size) / t;
  const bool sequence_parallel = layout.sequence_parallel && layout.tp > 1;
  // The loss's backward releases its fp32 log-sum-exp before the head's runs.
  const double input_grad = tokens * e * h * (sequence_parallel ? replicated : 1) - 4 * tokens;
  if (layout.defers_weight_grads()) return input_grad;
  const double in_flight = sequence_parallel ? tokens * e * (h + vocab * replicated) : 0;
  return input_grad + e * vocab * h + in_flight;
}

double head_weight_grad_input_bytes(const ModelSpec& model, const Layout& layout) {
  const auto [e, tokens, h, a, g, t, replicated] = layer_dims(model, layout);
  return tokens * e * (3 * h * replicated + static_cast<double>(model.vocab_size) / t);
}

double embedding_weight_grad_input_bytes(const ModelSpec& model, const Layout& layout) {
  const auto [e, tokens, h, a, g, t, replicated] = layer_dims(model, layout);
  return tokens * (e * h + 8);
}

double expected_ranks_per_token(int64_t num_experts, int64_t top_k, int64_t ep) {
  if (ep <= 1) return 1;
  // P(a given rank holds none of the k distinct experts) = C(E - E/ep, k) / C(E, k).
  const int64_t elsewhere = num_experts - num_experts / ep;
  double none_here = 1;
  for (int64_t i = 0; i < top_k; ++i) {
    none_here *= static_cast<double>(std::max<int64_t>(elsewhere - i, 0)) / static_cast<double>(num_experts - i);
  }
  return static_cast<double>(ep) * (1 - none_here);
}

double layer_weight_grad_input_bytes(const ModelSpec& model, const Layout& layout, bool moe_layer) {
  const auto [e, tokens, h, a, g, t, replicated] = layer_dims(model, layout);
  const double attention = h * replicated + (1 + 2 * g / a) * h / t + h / t + h;
  const double norms = 4 * h * replicated;
  const double mlp = moe_layer ? 0 : h * replicated + 3 * static_cast<double>(model.ffn_hidden) / t + h;
  return tokens * e * (attention + mlp + norms);
}

double in_flight_microbatches(long pp, long m, Schedule schedule, long v) {
  const double held = static_cast<double>(std::min(pp, m));
  if (schedule == Schedule::kGPipe) return static_cast<double>(m);
  if (schedule == Schedule::kInterleaved) {
    return held * (1 + static_cast<double>(pp - 1) / (static_cast<double>(pp) * static_cast<double>(v)));
  }
  return held;
}

}  // namespace tdx::planner
