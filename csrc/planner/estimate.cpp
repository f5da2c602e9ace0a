#include "planner/estimate.h"

#include <algorithm>
#include <stdexcept>

#include "planner/documents.h"
#include "planner/memory.h"
#include "planner/pipeline.h"

namespace tdx::planner {
namespace {

// Assumptions (each a single constant so that it is easy to find and change):
// NCCL ring collectives reach this share of the link bandwidth (commonly quoted as 70-85%).
constexpr double kLinkEfficiency = 0.8;
// CUDA context, NCCL buffers, library workspaces (cuBLAS: 32 MiB per handle and stream on Hopper) and allocator
// fragmentation per GPU.
constexpr double kFrameworkReserveBytes = 2.0 * (1ull << 30);

double link_bandwidth(const ClusterSpec& cluster, bool intra) {
  double slowest = 0;
  for (const auto& [gpu, count] : cluster.groups) {
    const double bw = intra ? gpu.nvlink_bytes_per_s : gpu.internode_bytes_per_s;
    slowest = slowest == 0 ? bw : std::min(slowest, bw);
  }
  return slowest * kLinkEfficiency;
}

int64_t axis_size(const Layout& l, const std::string& axis) {
  if (axis == "tp") return l.tp;
  if (axis == "cp") return l.cp;
  if (axis == "ep") return l.ep;
  if (axis == "dp") return l.dp / l.dp_replicate;
  if (axis == "dp_replicate") return l.dp_replicate;
  return l.pp;
}

// Layers of a pipeline stage: ceil(L / pp) at most (Llama 3 405B: 126 layers on 16 stages).
double layers_per_stage(const ModelSpec& model, const Layout& l) {
  return static_cast<double>((model.num_layers + l.pp - 1) / l.pp);
}

// The chunks (stages) each pipeline rank holds; 1 without pp.
long rank_chunks(const Layout& l) { return l.pp > 1 ? chunks_per_rank(l.schedule, l.virtual_stages) : 1; }

// Which ends of the model pipeline rank r holds: the first stage (the input embedding) and the last (the final
// norm and the LM head); without pp both. ZB-V's V puts both on rank 0.
bool holds_stage(const Layout& l, long rank, long stage) {
  if (l.pp == 1) return true;
  for (long chunk = 0; chunk < rank_chunks(l); ++chunk) {
    if (stage_of(rank, chunk, l.pp, l.schedule) == stage) return true;
  }
  return false;
}
bool holds_first(const Layout& l, long rank) { return holds_stage(l, rank, 0); }
bool holds_last(const Layout& l, long rank) { return holds_stage(l, rank, l.pp * rank_chunks(l) - 1); }

// One micro-batch's activation [b, s/cp, h], bytes.
double microbatch_activation_bytes(const ModelSpec& model, const Layout& l) {
  const double c = static_cast<double>(l.cp), b = static_cast<double>(l.micro_batch);
  const double h = static_cast<double>(model.hidden), s = static_cast<double>(l.seq_len), s_local = s / c;
  return b * s_local * h * element_bytes(l.precision);
}

// Whether full recomputation reruns the MoE layers' experts too.
bool experts_recomputed(const Layout& l) { return l.recompute == Recompute::kFull && l.recompute_experts; }

}  // namespace

double expected_remote_ranks(int64_t num_experts, int64_t top_k, int64_t ep) {
  if (ep <= 1) return 0;
  return expected_ranks_per_token(num_experts, top_k, ep) * static_cast<double>(ep - 1) / static_cast<double>(ep);
}

bool axis_intra_domain(const Layout& layout, const ClusterSpec& cluster, const std::string& axis) {
  // Groups of an axis are `size` ranks `stride` apart; with the domains being
  // consecutive blocks of gpus_per_domain ranks, every group stays inside one
  // domain exactly when its span divides the domain size.
  const int64_t span = axis_size(layout, axis) * layout.stride(axis);
  return span <= cluster.gpus_per_domain && cluster.gpus_per_domain % span == 0;
}

double training_flops(double num_params, double num_tokens) {
  if (!(num_params > 0) || !(num_tokens > 0)) throw std::invalid_argument("num_params and num_tokens must be positive");
  return 6.0 * num_params * num_tokens;
}

double gpu_hours(double flops, const ClusterSpec& cluster, double mfu) {
  cluster.validate();
  if (!(mfu > 0 && mfu <= 1)) throw std::invalid_argument("mfu must lie in (0, 1]");
  if (!(flops > 0)) throw std::invalid_argument("flops must be positive");
  return flops / (cluster.min_bf16_flops() * mfu) / 3600.0;
}

RankParams rank_params(const ModelSpec& model, const Layout& l) {
  // Parameters of pipeline rank r: its share of the layers, split over tp (experts over ep instead: they are
  // not tensor-parallel; every tp rank of an ep rank holds the same experts, as torchdist_ext's MoE), and
  // the ends it holds, split over tp (the embedding and head are vocab-parallel).
  const ParamCount params = count_params(model);
  const double t = static_cast<double>(l.tp), layers = static_cast<double>(model.num_layers);
  const double h = static_cast<double>(model.hidden), stage_layers = layers_per_stage(model, l);
  const double layer_params_total = params.total - params.embedding;
  const double input_embedding = h * static_cast<double>(model.vocab_size);
  const double head_and_norm = params.embedding - input_embedding;
  RankParams held;
  held.experts = params.expert / layers * stage_layers / static_cast<double>(l.ep);
  held.dense_layers = (layer_params_total - params.expert) / layers * stage_layers / t;
  for (long rank = 0; rank < l.pp; ++rank) {
    held.ends.push_back(((holds_first(l, rank) ? input_embedding : 0) + (holds_last(l, rank) ? head_and_norm : 0)) / t);
  }
  // The communication prices the rank holding the most parameters.
  for (long rank = 1; rank < l.pp; ++rank) {
    held.busiest = held.ends.at(static_cast<size_t>(rank)) > held.ends.at(static_cast<size_t>(held.busiest))
                       ? rank
                       : held.busiest;
  }
  return held;
}

RankActivations rank_activations(const ModelSpec& model, const Layout& l) {
  // Activations: what one layer stores (the mean over dense and MoE layers) on the local sequence s / cp,
  // times the stage's layers and the micro-batches in flight. With pp each rank holds its own count: its
  // peak in the order of passes that runs (pipeline.h; 1F1B's rank r holds min(p - r, m)). The end of the
  // model (the final norm, the head's input and the loss's logits) is held by the last stage from a
  // micro-batch's forward to its backward, which every schedule but GPipe runs right after it there. The
  // zero-bubble schedules also hold their deferred weight gradients' inputs, the embedding's and the head's
  // (its [T, V/t] output gradient) with their stages': each rank's peak in the simulated order, by bytes.
  const double m = static_cast<double>(l.num_microbatches), layers = static_cast<double>(model.num_layers);
  const double stage_layers = layers_per_stage(model, l);
  const long chunks = rank_chunks(l);
  const double moe_layers = static_cast<double>(model.num_moe_layers());
  auto mean_over_layers = [&](double (*bytes)(const ModelSpec&, const Layout&, bool)) {
    return ((layers - moe_layers) * bytes(model, l, false) + moe_layers * bytes(model, l, true)) / layers;
  };
  const double per_layer = mean_over_layers(layer_activation_bytes);
  const double head_forward = head_activation_bytes(model, l);
  // Inside a B pass, which runs its stage's layers from the top, a layer's backward allocates its gradients
  // (layer_backward_bytes) and, recomputed, first recreates what the recomputation dropped (layer_rerun_bytes),
  // on top of what its rank holds: the larger of the model's dense and MoE layers' sum. Without deferred weight
  // gradients each layer's backward releases what it kept, so the top layer's is the pass's largest: on the
  // last stage after that micro-batch's head has released its forward bytes (the loss's and the head's
  // backward run first). Each rank's `backward` is what that adds to its peak between passes.
  // A block whose experts are not recomputed reruns its norms and attention after its MoE's backward is done: the
  // larger of the two.
  auto in_pass = [&](bool moe_layer) {
    const double rerun = layer_rerun_bytes(model, l, moe_layer), gradients = layer_backward_bytes(model, l, moe_layer);
    return moe_layer && !l.recompute_experts ? std::max(rerun, gradients) : rerun + gradients;
  };
  const double layer_backward = std::max(moe_layers < layers ? in_pass(false) : 0.0,
                                         moe_layers > 0 ? in_pass(true) : 0.0);
  // On the last stage the head's own backward runs first, on top of its forward's bytes.
  const double head_backward = head_backward_bytes(model, l);
  const double last_stage_backward = std::max(head_backward, layer_backward - head_forward);
  RankActivations held;
  if (l.defers_weight_grads()) {
    const double chunk_layers = stage_layers / static_cast<double>(chunks);
    const double weight_inputs = mean_over_layers(layer_weight_grad_input_bytes);
    std::vector<StageBytes> stages(static_cast<size_t>(l.pp * chunks),
                                   {per_layer * chunk_layers, weight_inputs * chunk_layers});
    stages.front().weight_input += embedding_weight_grad_input_bytes(model, l);
    stages.back().forward += head_forward;
    const double head_weight_input = head_weight_grad_input_bytes(model, l);
    stages.back().weight_input += head_weight_input;
    const auto timeline = simulate_schedule(l.pp, l.num_microbatches, l.schedule);
    held.activations = peak_held_bytes_per_rank(timeline, l.pp, l.schedule, stages);
    // In split mode each layer's backward queues its W input as it releases its forward's bytes (and the head
    // its own before the layers), so the chunk's bottom layer runs its backward on top of the others' W inputs
    // where those outweigh their forwards.
    const double queued_above = (chunk_layers - 1) * std::max(0.0, weight_inputs - per_layer);
    for (auto& stage : stages) stage.backward_peak = queued_above + layer_backward;
    stages.back().backward_peak =
        std::max(head_backward, head_weight_input - head_forward + queued_above + layer_backward);
    const auto peaks = peak_held_bytes_per_rank(timeline, l.pp, l.schedule, stages);
    for (long rank = 0; rank < l.pp; ++rank) {
      held.backward.push_back(peaks.at(static_cast<size_t>(rank)) - held.activations.at(static_cast<size_t>(rank)));
    }
  } else {
    // The held peak comes right before the first B of these schedules (the warm-up's forwards end there).
    std::vector<double> units{in_flight_microbatches(l.pp, l.num_microbatches, l.schedule, l.virtual_stages)};
    if (l.pp > 1) units = held_activations_per_rank(l.pp, l.num_microbatches, l.schedule, l.virtual_stages, 0.0);
    const double head_held = l.schedule == Schedule::kGPipe && l.pp > 1 ? m : 1;
    for (long rank = 0; rank < l.pp; ++rank) {
      const double microbatches = units.at(static_cast<size_t>(rank)) / static_cast<double>(chunks);
      held.activations.push_back(per_layer * stage_layers * microbatches +
                                 (holds_last(l, rank) ? head_forward * head_held : 0));
      held.backward.push_back(holds_last(l, rank) ? last_stage_backward : layer_backward);
    }
  }
  return held;
}

std::vector<RankMemory> rank_memory(const ModelSpec& model, const Layout& l) {
  // Model states: dense parameters are replicated over dp x cp x ep ranks, expert parameters over dp x cp:
  // ZeRO shards them, and their gradients are reduced, over those (context-parallel ranks hold the same
  // parameters). ZeRO-3 also holds unsharded parameters (bf16, fp32 in fp32 training), counted as buffers:
  // two prefetched layers' and the embedding, final norm and head (FSDP2's root, which it does not reshard
  // after the forward: they stay gathered until the end of the backward), or with pp the whole stage's,
  // which a pipeline keeps unsharded through the step's
  // micro-batches (reduce-scattering once, after the stage's last backward: torchdist_ext.pipeline, as
  // torch's pipelining), with their gradients accumulated unsharded in fp32 (FSDP2 with an fp32 reduce_dtype,
  // as Megatron-LM's fp32 main_grad). Those are the gradients at the step's peak: the sharded ones exist only
  // from that reduce-scatter to the optimizer's zero_grad, when no activations are held. The buffers also
  // hold the framework reserve.
  const ParamCount params = count_params(model);
  const RankParams held = rank_params(model, l);
  const RankActivations activations = rank_activations(model, l);
  const double t = static_cast<double>(l.tp), layers = static_cast<double>(model.num_layers);
  // ZeRO shards over the ranks of one HSDP replica.
  const int64_t dense_replicas = l.dp * l.cp * l.ep / l.dp_replicate, expert_replicas = l.dp * l.cp / l.dp_replicate;
  const double element = element_bytes(l.precision);
  const double layer_params_gpu = ((params.total - params.embedding) / layers) / t;
  const bool unsharded_through_step = l.zero_stage == 3 && l.pp > 1;
  std::vector<RankMemory> ranks;
  for (long rank = 0; rank < l.pp; ++rank) {
    const double dense = held.dense(rank);
    const auto dense_states = model_state_bytes(dense, l.zero_stage, dense_replicas, l.precision);
    ModelStateBytes expert_states;
    if (held.experts > 0) expert_states = model_state_bytes(held.experts, l.zero_stage, expert_replicas, l.precision);
    RankMemory memory;
    memory.params = dense_states.params + expert_states.params;
    memory.grads = unsharded_through_step ? 4 * (dense + held.experts) : dense_states.grads + expert_states.grads;
    memory.optimizer = dense_states.optimizer + expert_states.optimizer;
    memory.activations = activations.activations.at(static_cast<size_t>(rank));
    memory.backward = activations.backward.at(static_cast<size_t>(rank));
    const double unsharded = unsharded_through_step ? element * (dense + held.experts)
                                                    : element * (2 * layer_params_gpu + params.embedding / t);
    memory.buffers = (l.zero_stage == 3 ? unsharded : 0) + kFrameworkReserveBytes;
    ranks.push_back(memory);
  }
  return ranks;
}

StepFlops step_flops(const ModelSpec& model, const Layout& l) {
  // FLOPs: 6 N_active per token for the GEMMs, and causal attention 6 L s h per token (QK^T and PV,
  // half of the score matrix, forward + backward), times the share packed documents keep (documents.h). The model's work, not the hardware's: recomputation,
  // a flash backward's rerun of the scores and a skewed ep rank's extra rows are compute_time()'s.
  const ParamCount params = count_params(model);
  const double s = static_cast<double>(l.seq_len), h = static_cast<double>(model.hidden);
  const double layers = static_cast<double>(model.num_layers);
  StepFlops flops;
  flops.tokens = static_cast<double>(l.sequences_per_step()) * s;
  flops.gemm = 6 * params.active * flops.tokens;
  flops.attention = 6 * layers * s * h * flops.tokens * attention_balance(l).work_share;
  return flops;
}

// Communication per GPU per step, ring algorithms: all-reduce 2(n-1)/n X, all-gather and
// reduce-scatter (n-1)/n X, all-to-all (n-1)/n X, point-to-point X.

double tp_bytes(const ModelSpec& model, const Layout& l) {
  if (l.tp <= 1) return 0;
  // In units of (t-1)/t X, X one micro-batch's activation (an all-reduce is 2 units, an all-gather or a
  // reduce-scatter 1). Each of a layer's two blocks (attention, MLP) is c column-parallel linears reading
  // the block's input (c = 1 when fused; unfused 3 in attention, q, k, v, and 2 in the MLP, gate and up,
  // each communicating the input on its own) and a row-parallel one. Without SP: the row's all-reduce
  // forward and each column's input-gradient all-reduce backward, 2 + 2c units. With SP: c all-gathers
  // and a reduce-scatter forward; backward c reduce-scatters, the row's all-gather, and each column's
  // input gathered again for its weight gradient (the sequence shard is kept, not the gathered input, as
  // in Megatron-LM): 3c + 2. With fp8 GEMMs (delayed scaling, amaxes reduced: every rank casts with one
  // scale) a column's ring carries its input as fp8 bytes (1 per element: 1/e units) and keeps the gathered
  // fp8 input for its weight gradient, and the row's backward ring carries the output gradient's fp8 bytes:
  // (c + 1)(1 + 1/e). Full recomputation reruns the forward's part. An MoE
  // layer's experts are not tensor-parallel: its tp ranks run them on the same tokens, gathered from the
  // sequence shards (2 units with SP, none without; full recompute reruns the gather where it reaches the
  // experts). The ends: the vocab-parallel embedding's output (an all-reduce forward; with
  // SP a reduce-scatter forward and an all-gather backward: 2 units) and the output head, a column-
  // parallel linear (2; with SP 3): those the busiest rank holds (the head; without pp, or zb-v's rank 0, both).
  // On the critical path: not hidden.
  const double t = static_cast<double>(l.tp), m = static_cast<double>(l.num_microbatches);
  const double layers = static_cast<double>(model.num_layers);
  const double element = element_bytes(l.precision);
  const bool full = l.recompute == Recompute::kFull;
  const bool fp8 = uses_fp8_gemms(l.precision);
  auto block_units = [&](double c) {
    if (!l.sequence_parallel) return 2 + 2 * c + (full ? 2 : 0);
    if (fp8) return (c + 1) * (1 + 1 / element) + (full ? c / element + 1 : 0);
    return 3 * c + 2 + (full ? c + 1 : 0);
  };
  const bool fused = model.fused_projections;
  const double attention_block = block_units(fused ? 1 : 3), mlp_block = block_units(fused ? 1 : 2);
  const double moe_block = l.sequence_parallel ? 2 + (experts_recomputed(l) ? 1 : 0) : 0;
  const double moe_share = static_cast<double>(model.num_moe_layers()) / layers;
  const double per_layer = attention_block + (1 - moe_share) * mlp_block + moe_share * moe_block;
  const long busiest = rank_params(model, l).busiest;
  const double ends = (holds_last(l, busiest) ? (l.sequence_parallel ? 3 : 2) : 0) + (holds_first(l, busiest) ? 2 : 0);
  return m * (layers_per_stage(model, l) * per_layer + ends) * (t - 1) / t * microbatch_activation_bytes(model, l);
}

CpBytes cp_bytes(const ModelSpec& model, const Layout& l) {
  CpBytes bytes;
  if (l.cp <= 1) return bytes;
  // cp / u ring ranks around Ulysses groups of u (either may be 1). In units of one head of the local
  // sequence, [b, s/cp, head_dim]; kv heads of a tp rank fewer than u are replicated to one per Ulysses
  // rank (ulysses_attention). Ulysses: q, k, v to head shards and the output back forward, their
  // gradients backward, each rank keeping 1/u of each all-to-all: on the critical path. Ring: a rank's
  // K/V (the local sequence's kv heads, whatever u) go around r - 1 times forward; backward sends them
  // again plus the dK/dV accumulators (r hops): hidden behind the attention compute (estimate()).
  const double t = static_cast<double>(l.tp), c = static_cast<double>(l.cp);
  const double m = static_cast<double>(l.num_microbatches), b = static_cast<double>(l.micro_batch);
  const double s = static_cast<double>(l.seq_len), s_local = s / c;
  const double u = static_cast<double>(l.cp_ulysses), r = c / u;
  const double heads = static_cast<double>(model.num_heads) / t;
  double kv_heads = static_cast<double>(model.num_kv_heads) / t;
  if (u > kv_heads) kv_heads = u;
  const double head = b * s_local * model.head_dim() * element_bytes(l.precision);
  const double ulysses = u > 1 ? 2 * (2 * heads + 2 * kv_heads) * (u - 1) / u * head : 0;
  const double ring = r > 1 ? 2 * kv_heads * head * (3 * (r - 1) + 1) : 0;
  const double layer_passes = m * layers_per_stage(model, l);
  bytes.ring = layer_passes * ring;
  bytes.total = layer_passes * (ring + ulysses);
  return bytes;
}

double ep_bytes(const ModelSpec& model, const Layout& l) {
  if (l.ep <= 1) return 0;
  // MoE dispatch and combine, forward and backward: 4 all-to-alls per MoE layer (6 where full recompute
  // reruns the experts' forward). A token travels once to each other rank holding one of its experts
  // (DeepEP's rule, as tdx::moe_dispatch does), with uniform routing expected_remote_ranks of them
  // (k (ep-1)/ep without the deduplication). A rank sends the rows of its own tokens that go elsewhere in
  // the dispatch and the combine's backward, and the other ranks' rows its experts got in the combine and
  // the dispatch's backward. When every rank's tokens send the share x/ep of their rows to the busiest
  // rank's experts (x = expert_imbalance), it sends (1 - x/ep) + (ep - 1) x/ep of a rank's rows each way,
  // (ep + x (ep - 2)) / (2 (ep - 1)) times uniform routing's: at ep = 2 as many (it keeps more of its own
  // rows and sends back more of the other's). Counted in rows, this is exact with k = 1 and an
  // approximation of the deduplicated messages otherwise (skewed routing changes how often a token's
  // experts share a rank).
  const double m = static_cast<double>(l.num_microbatches), layers = static_cast<double>(model.num_layers);
  const double moe_layers_per_stage = static_cast<double>(model.num_moe_layers()) / layers * layers_per_stage(model, l);
  const double routed = microbatch_activation_bytes(model, l) *
                        expected_remote_ranks(model.num_experts, model.experts_per_token, l.ep);
  const double ep = static_cast<double>(l.ep);
  const double skewed_share = (ep + l.expert_imbalance * (ep - 2)) / (2 * (ep - 1));
  const double exchanges = experts_recomputed(l) ? 6 : 4;
  return m * moe_layers_per_stage * exchanges * routed * skewed_share;
}

double dp_bytes(const ModelSpec& model, const Layout& l) {
  // Data parallelism over the gradients (bf16; fp32 in fp32 training): ZeRO 0-2 all-reduce them once
  // per step and overlap with the backward (two thirds of the compute: estimate()). ZeRO-3 reduce-scatters the
  // gradients once per step (accumulated over the micro-batches: FSDP2's set_requires_gradient_sync) and
  // all-gathers the blocks' parameters for each micro-batch's forward and again for its backward, and
  // the root unit's (the embedding, final norm and head, outside the blocks) once per micro-batch (FSDP2
  // keeps the root unsharded from its forward to its backward); with pp everything once per step (a
  // pipeline keeps the parameters unsharded through the step: torchdist_ext.pipeline, torchtitan).
  // Overlapped with all the compute. Dense parameters are replicated over dp x cp x ep ranks, experts over
  // dp x cp (rank_memory); the busiest pipeline rank's are counted. With HSDP all this is within a replica
  // (dp x cp x ep / dp_replicate ranks): dp_replicate_bytes() adds the replicas' all-reduce.
  const double m = static_cast<double>(l.num_microbatches), element = element_bytes(l.precision);
  const RankParams held = rank_params(model, l);
  const double dense_per_stage = held.dense(held.busiest);
  const double ends_per_stage = held.ends.at(static_cast<size_t>(held.busiest));
  const double r = static_cast<double>(l.dp_replicate);
  const double dense_dp = static_cast<double>(l.dp * l.cp * l.ep) / r, expert_dp = static_cast<double>(l.dp * l.cp) / r;
  const double block_gathers = l.pp > 1 ? 1 : 2 * m, root_gathers = l.pp > 1 ? 1 : m;
  auto volume = [&](double n, double param_count, double gathers) {
    if (n <= 1) return 0.0;
    const double share = (n - 1) / n * param_count * element;
    return l.zero_stage == 3 ? (gathers + 1) * share : 2 * share;
  };
  return volume(dense_dp, dense_per_stage - ends_per_stage, block_gathers) +
         volume(dense_dp, ends_per_stage, root_gathers) + volume(expert_dp, held.experts, block_gathers);
}

double dp_replicate_bytes(const ModelSpec& model, const Layout& l) {
  // HSDP's replicas all-reduce each rank's gradient shard once per step (FSDP2: after the reduce-scatter
  // within the replica), (r - 1) / r x 2 x the shard's bytes, overlapped with the compute like dp's.
  if (l.dp_replicate <= 1) return 0;
  const double r = static_cast<double>(l.dp_replicate), element = element_bytes(l.precision);
  const RankParams held = rank_params(model, l);
  const double dense_shard = static_cast<double>(l.dp * l.cp * l.ep) / r;
  const double expert_shard = static_cast<double>(l.dp * l.cp) / r;
  const double shard = held.dense(held.busiest) / dense_shard + held.experts / expert_shard;
  return 2 * (r - 1) / r * shard * element;
}

double pp_bytes(const ModelSpec& model, const Layout& l) {
  if (l.pp <= 1) return 0;
  // Activations forward and their gradients backward at each stage boundary, per micro-batch, by the
  // busiest rank; the sequence-parallel activation is split over tp.
  const double activation = microbatch_activation_bytes(model, l);
  const double boundary = l.sequence_parallel ? activation / static_cast<double>(l.tp) : activation;
  return static_cast<double>(l.num_microbatches) * busiest_rank_boundary_sends(l.pp, l.schedule, l.virtual_stages) *
         boundary;
}

Estimate estimate(const ModelSpec& model, const ClusterSpec& cluster, const Layout& l) {
  l.validate_for(model, cluster);
  Estimate e;

  // Memory: each pipeline rank's; the estimate's fields are the fullest rank's.
  const RankParams held = rank_params(model, l);
  e.params_per_gpu = held.total(held.busiest);
  e.pipeline_ranks = rank_memory(model, l);
  for (size_t rank = 1; rank < e.pipeline_ranks.size(); ++rank) {
    if (e.pipeline_ranks[rank].total() > e.pipeline_ranks.at(static_cast<size_t>(e.fullest_pipeline_rank)).total()) {
      e.fullest_pipeline_rank = static_cast<long>(rank);
    }
  }
  const RankMemory& fullest = e.pipeline_ranks.at(static_cast<size_t>(e.fullest_pipeline_rank));
  e.params = fullest.params, e.grads = fullest.grads, e.optimizer = fullest.optimizer;
  e.activations = fullest.activations, e.backward = fullest.backward, e.buffers = fullest.buffers;
  e.gpu_memory = cluster.min_memory_bytes();

  // Compute.
  const StepFlops flops = step_flops(model, l);
  e.tokens_per_step = flops.tokens;
  e.model_flops_per_step = flops.model();
  const ComputeTime compute = compute_time(model, cluster, l);
  e.compute = compute;
  e.bubble = l.pp > 1 ? bubble_fraction(l.pp, l.num_microbatches, l.schedule, l.virtual_stages) : 0.0;
  e.attention_spread = attention_balance(l).spread;

  // Communication: each axis's bytes at its link's bandwidth, less what hides behind compute.
  auto add = [&](const std::string& axis, double bytes, double hidden_behind) {
    AxisComm comm;
    comm.intra_domain = axis_intra_domain(l, cluster, axis);
    comm.bytes = bytes;
    comm.seconds = bytes / link_bandwidth(cluster, comm.intra_domain);
    comm.exposed_seconds = std::max(0.0, comm.seconds - hidden_behind);
    e.comm[axis] = comm;
  };
  if (l.tp > 1) add("tp", tp_bytes(model, l), 0.0);
  if (l.cp > 1) {
    // The ring hides behind the attention compute; Ulysses' all-to-alls are on the critical path.
    const CpBytes cp = cp_bytes(model, l);
    const double ring_seconds = cp.ring / link_bandwidth(cluster, axis_intra_domain(l, cluster, "cp"));
    add("cp", cp.total, std::min(compute.attention_seconds, ring_seconds));
  }
  if (l.ep > 1) add("ep", ep_bytes(model, l), 0.0);
  const double dp = dp_bytes(model, l);
  const double hidden_behind = l.zero_stage == 3 ? compute.seconds : compute.seconds * 2 / 3;
  if (dp > 0) add("dp", dp, hidden_behind);
  // The replicas' all-reduce follows the reduce-scatter: it hides behind what compute dp leaves uncovered.
  const double dp_seconds = dp > 0 ? e.comm["dp"].seconds : 0.0;
  if (l.dp_replicate > 1) add("dp_replicate", dp_replicate_bytes(model, l), std::max(0.0, hidden_behind - dp_seconds));
  if (l.pp > 1) add("pp", pp_bytes(model, l), 0.0);

  double exposed = 0;
  for (const auto& [axis, comm] : e.comm) exposed += comm.exposed_seconds;
  e.step_seconds = compute.seconds / (1.0 - e.bubble) + exposed;
  const double gpus = static_cast<double>(l.world_size());
  // Against the peak of the units that run each FLOP: the GEMMs' precision's (fp8, TF32 at half the bf16
  // peak, bf16), the LM head's and the attention's, so that fp8 runs are not over 100 %.
  const GpuSpec& gpu = cluster.slowest_gpu();
  const double gemm_peak = uses_fp8_gemms(l.precision)       ? gpu.fp8_flops
                           : l.precision == Precision::kFp32 ? gpu.bf16_flops / 2
                                                             : gpu.bf16_flops;
  // The LM head stays in the activations' precision under fp8 recipes (compute.cpp): its 6 h V per token at
  // the bf16 (or TF32) peak.
  const double head = uses_fp8_gemms(l.precision)
                          ? 6 * static_cast<double>(model.hidden) * static_cast<double>(model.vocab_size) * flops.tokens
                          : 0;
  const double head_peak = l.precision == Precision::kFp8Fp32 ? gpu.bf16_flops / 2 : gpu.bf16_flops;
  const double ideal_seconds =
      ((flops.gemm - head) / gemm_peak + head / head_peak + flops.attention / gpu.bf16_flops) / gpus;
  e.mfu = ideal_seconds / e.step_seconds;
  return e;
}

}  // namespace tdx::planner
