#include "planner/estimate.h"

#include <algorithm>
#include <stdexcept>

#include "planner/memory.h"
#include "planner/pipeline.h"

namespace tdx::planner {
namespace {

// Assumptions (each a single constant so that it is easy to find and change):
// Large GEMMs and attention kernels reach this share of the dense peak.
constexpr double kKernelEfficiency = 0.7;
// NCCL ring collectives reach this share of the link bandwidth (commonly quoted as 70-85%).
constexpr double kLinkEfficiency = 0.8;
// CUDA context, NCCL buffers, library workspaces (cuBLAS: 32 MiB per handle and stream on Hopper) and allocator
// fragmentation per GPU.
constexpr double kFrameworkReserveBytes = 2.0 * (1ull << 30);
// fp8 GEMMs run at twice the bf16 rate; attention and the rest stay in bf16.
constexpr double kFp8GemmSpeedup = 2.0;
// fp32 GEMMs run as TF32, at half the dense bf16 rate (A100, H100, B200).
constexpr double kFp32GemmSpeedup = 0.5;

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
  if (axis == "dp") return l.dp;
  return l.pp;
}

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

Estimate estimate(const ModelSpec& model, const ClusterSpec& cluster, const Layout& l) {
  l.validate_for(model, cluster);
  const ParamCount params = count_params(model);
  Estimate e;
  const double t = static_cast<double>(l.tp), c = static_cast<double>(l.cp);
  const double m = static_cast<double>(l.num_microbatches), b = static_cast<double>(l.micro_batch);
  const double h = static_cast<double>(model.hidden), layers = static_cast<double>(model.num_layers);
  const double s = static_cast<double>(l.seq_len), s_local = s / c;
  // Stages get ceil(L / pp) layers at most (Llama 3 405B: 126 layers on 16 stages).
  const double layers_per_stage = static_cast<double>((model.num_layers + l.pp - 1) / l.pp);

  // Which ends of the model pipeline rank r holds: the first stage (the input embedding) and the last (the final
  // norm and the LM head); without pp both. ZB-V's V puts both on rank 0.
  const long chunks = l.pp > 1 ? chunks_per_rank(l.schedule, l.virtual_stages) : 1;
  auto holds_stage = [&](long rank, long stage) {
    if (l.pp == 1) return true;
    for (long chunk = 0; chunk < chunks; ++chunk) {
      if (stage_of(rank, chunk, l.pp, l.schedule) == stage) return true;
    }
    return false;
  };
  auto holds_first = [&](long rank) { return holds_stage(rank, 0); };
  auto holds_last = [&](long rank) { return holds_stage(rank, l.pp * chunks - 1); };

  // Parameters of pipeline rank r: its share of the layers, split over tp (experts over ep instead: they are
  // not tensor-parallel; every tp rank of an ep rank holds the same experts, as torchdist_ext's MoE), and
  // the ends it holds, split over tp (the embedding and head are vocab-parallel).
  const double layer_params_total = params.total - params.embedding;
  const double input_embedding = h * static_cast<double>(model.vocab_size);
  const double head_and_norm = params.embedding - input_embedding;
  const double expert_per_stage = params.expert / layers * layers_per_stage / static_cast<double>(l.ep);
  const double dense_layers_per_stage = (layer_params_total - params.expert) / layers * layers_per_stage / t;
  auto ends_of = [&](long rank) {
    return ((holds_first(rank) ? input_embedding : 0) + (holds_last(rank) ? head_and_norm : 0)) / t;
  };
  // The communication below prices the rank holding the most parameters.
  long busiest = 0;
  for (long rank = 1; rank < l.pp; ++rank) busiest = ends_of(rank) > ends_of(busiest) ? rank : busiest;
  const double ends_per_stage = ends_of(busiest);
  const double dense_per_stage = dense_layers_per_stage + ends_per_stage;
  e.params_per_gpu = dense_per_stage + expert_per_stage;

  // Activations: what one layer stores (the mean over dense and MoE layers) on the local sequence s / cp,
  // times the stage's layers and the micro-batches in flight. With pp each rank holds its own count: its
  // peak in the order of passes that runs (pipeline.h; 1F1B's rank r holds min(p - r, m)). The end of the
  // model (the final norm, the head's input and the loss's logits) is held by the last stage from a
  // micro-batch's forward to its backward, which every schedule but GPipe runs right after it there. The
  // zero-bubble schedules also hold their deferred weight gradients' inputs, the embedding's and the head's
  // (its [T, V/t] output gradient) with their stages': each rank's peak in the simulated order, by bytes.
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
  std::vector<double> activations, backwards;
  if (l.defers_weight_grads()) {
    const double chunk_layers = layers_per_stage / static_cast<double>(chunks);
    const double weight_inputs = mean_over_layers(layer_weight_grad_input_bytes);
    std::vector<StageBytes> stages(static_cast<size_t>(l.pp * chunks),
                                   {per_layer * chunk_layers, weight_inputs * chunk_layers});
    stages.front().weight_input += embedding_weight_grad_input_bytes(model, l);
    stages.back().forward += head_forward;
    const double head_weight_input = head_weight_grad_input_bytes(model, l);
    stages.back().weight_input += head_weight_input;
    const auto timeline = simulate_schedule(l.pp, l.num_microbatches, l.schedule);
    activations = peak_held_bytes_per_rank(timeline, l.pp, l.schedule, stages);
    // In split mode each layer's backward queues its W input as it releases its forward's bytes (and the head
    // its own before the layers), so the chunk's bottom layer runs its backward on top of the others' W inputs
    // where those outweigh their forwards.
    const double queued_above = (chunk_layers - 1) * std::max(0.0, weight_inputs - per_layer);
    for (auto& stage : stages) stage.backward_peak = queued_above + layer_backward;
    stages.back().backward_peak =
        std::max(head_backward, head_weight_input - head_forward + queued_above + layer_backward);
    const auto peaks = peak_held_bytes_per_rank(timeline, l.pp, l.schedule, stages);
    for (long rank = 0; rank < l.pp; ++rank) {
      backwards.push_back(peaks.at(static_cast<size_t>(rank)) - activations.at(static_cast<size_t>(rank)));
    }
  } else {
    // The held peak comes right before the first B of these schedules (the warm-up's forwards end there).
    std::vector<double> held{in_flight_microbatches(l.pp, l.num_microbatches, l.schedule, l.virtual_stages)};
    if (l.pp > 1) held = held_activations_per_rank(l.pp, l.num_microbatches, l.schedule, l.virtual_stages, 0.0);
    const double head_held = l.schedule == Schedule::kGPipe && l.pp > 1 ? m : 1;
    for (long rank = 0; rank < l.pp; ++rank) {
      const double units = held.at(static_cast<size_t>(rank)) / static_cast<double>(chunks);
      activations.push_back(per_layer * layers_per_stage * units +
                            (holds_last(rank) ? head_forward * head_held : 0));
      backwards.push_back(holds_last(rank) ? last_stage_backward : layer_backward);
    }
  }

  // Model states: dense parameters are replicated over dp x cp x ep ranks, expert parameters over dp x cp:
  // ZeRO shards them, and their gradients are reduced, over those (context-parallel ranks hold the same
  // parameters). ZeRO-3 also holds unsharded parameters (bf16, fp32 in fp32 training), counted as buffers:
  // two prefetched layers', or with pp the whole stage's, which a pipeline keeps unsharded through the step's
  // micro-batches (reduce-scattering once, after the stage's last backward: torchdist_ext.pipeline, as
  // torch's pipelining), with their gradients accumulated unsharded in fp32 (FSDP2 with an fp32 reduce_dtype,
  // as Megatron-LM's fp32 main_grad). Those are the gradients at the step's peak: the sharded ones exist only
  // from that reduce-scatter to the optimizer's zero_grad, when no activations are held. The buffers also
  // hold the framework reserve.
  const int64_t dense_replicas = l.dp * l.cp * l.ep, expert_replicas = l.dp * l.cp;
  const double element = element_bytes(l.precision);
  const double layer_params_gpu = (layer_params_total / layers) / t;
  const bool unsharded_through_step = l.zero_stage == 3 && l.pp > 1;
  for (long rank = 0; rank < l.pp; ++rank) {
    const double dense = dense_layers_per_stage + ends_of(rank);
    const auto dense_states = model_state_bytes(dense, l.zero_stage, dense_replicas, l.precision);
    ModelStateBytes expert_states;
    if (expert_per_stage > 0) {
      expert_states = model_state_bytes(expert_per_stage, l.zero_stage, expert_replicas, l.precision);
    }
    RankMemory memory;
    memory.params = dense_states.params + expert_states.params;
    memory.grads = unsharded_through_step ? 4 * (dense + expert_per_stage) : dense_states.grads + expert_states.grads;
    memory.optimizer = dense_states.optimizer + expert_states.optimizer;
    memory.activations = activations.at(static_cast<size_t>(rank));
    memory.backward = backwards.at(static_cast<size_t>(rank));
    const double unsharded = unsharded_through_step ? element * (dense + expert_per_stage)
                                                    : 2 * element * layer_params_gpu;
    memory.buffers = (l.zero_stage == 3 ? unsharded : 0) + kFrameworkReserveBytes;
    e.pipeline_ranks.push_back(memory);
    if (memory.total() > e.pipeline_ranks.at(static_cast<size_t>(e.fullest_pipeline_rank)).total()) {
      e.fullest_pipeline_rank = rank;
    }
  }
  const RankMemory& fullest = e.pipeline_ranks.at(static_cast<size_t>(e.fullest_pipeline_rank));
  e.params = fullest.params, e.grads = fullest.grads, e.optimizer = fullest.optimizer;
  e.activations = fullest.activations, e.backward = fullest.backward, e.buffers = fullest.buffers;
  e.gpu_memory = cluster.min_memory_bytes();

  // FLOPs: 6 N_active per token for the GEMMs, and causal attention 6 L s h per token (QK^T and PV,
  // half of the score matrix, forward + backward). Recomputation adds forward work: full the blocks' whole
  // forward (2 N per token, N the blocks' active parameters: not the embedding, head and final norm outside
  // the checkpointed blocks, nor the MoE layers' routers and experts where recompute does not reach them)
  // and the attention's (a third of it); selective keeps the GEMMs' and the attention's outputs and reruns
  // only element-wise work (no FLOPs counted).
  e.tokens_per_step = static_cast<double>(l.sequences_per_step()) * s;
  const double gemm_flops = 6 * params.active * e.tokens_per_step;
  const double attention_flops = 6 * layers * s * h * e.tokens_per_step;
  e.model_flops_per_step = gemm_flops + attention_flops;
  const bool experts_recomputed = l.recompute == Recompute::kFull && l.recompute_experts;
  double recompute_gemm = 0, recompute_attention = 0;
  if (l.recompute == Recompute::kFull) {
    const double recomputed = params.active - params.embedding - (l.recompute_experts ? 0 : params.moe_active);
    recompute_gemm = 2 * recomputed * e.tokens_per_step;
    recompute_attention = attention_flops / 3;
  }
  // The ep rank whose experts get the most rows runs expert_imbalance times the mean of the routed GEMMs
  // (forward, backward and any rerun), and the step waits for it.
  const double routed_excess = (l.expert_imbalance - 1) * 6 * params.routed_active * e.tokens_per_step *
                               (experts_recomputed ? 4.0 / 3.0 : 1.0);
  const double gemm_speed = uses_fp8_gemms(l.precision)         ? kFp8GemmSpeedup
                            : l.precision == Precision::kFp32   ? kFp32GemmSpeedup
                                                                : 1.0;
  const double gpus = static_cast<double>(l.world_size());
  const double rate = cluster.min_bf16_flops() * kKernelEfficiency;
  const double attention_seconds = (attention_flops + recompute_attention) / gpus / rate;
  e.compute_seconds = (gemm_flops + recompute_gemm + routed_excess) / gemm_speed / gpus / rate + attention_seconds;
  e.bubble = l.pp > 1 ? bubble_fraction(l.pp, l.num_microbatches, l.schedule, l.virtual_stages) : 0.0;

  // Communication per GPU per step, ring algorithms: all-reduce 2(n-1)/n X, all-gather and
  // reduce-scatter (n-1)/n X, all-to-all (n-1)/n X, point-to-point X.
  auto add = [&](const std::string& axis, double bytes, double hidden_behind) {
    AxisComm comm;
    comm.intra_domain = axis_intra_domain(l, cluster, axis);
    comm.bytes = bytes;
    comm.seconds = bytes / link_bandwidth(cluster, comm.intra_domain);
    comm.exposed_seconds = std::max(0.0, comm.seconds - hidden_behind);
    e.comm[axis] = comm;
  };
  const double activation = b * s_local * h * element;  // one micro-batch's [b, s/cp, h]
  if (l.tp > 1) {
    // In units of (t-1)/t X, X the activation above (an all-reduce is 2 units, an all-gather or a
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
    const bool full = l.recompute == Recompute::kFull;
    const bool fp8 = uses_fp8_gemms(l.precision);
    auto block_units = [&](double c) {
      if (!l.sequence_parallel) return 2 + 2 * c + (full ? 2 : 0);
      if (fp8) return (c + 1) * (1 + 1 / element) + (full ? c / element + 1 : 0);
      return 3 * c + 2 + (full ? c + 1 : 0);
    };
    const bool fused = model.fused_projections;
    const double attention_block = block_units(fused ? 1 : 3), mlp_block = block_units(fused ? 1 : 2);
    const double moe_block = l.sequence_parallel ? 2 + (experts_recomputed ? 1 : 0) : 0;
    const double moe_share = static_cast<double>(model.num_moe_layers()) / layers;
    const double per_layer = attention_block + (1 - moe_share) * mlp_block + moe_share * moe_block;
    const double ends = (holds_last(busiest) ? (l.sequence_parallel ? 3 : 2) : 0) + (holds_first(busiest) ? 2 : 0);
    add("tp", m * (layers_per_stage * per_layer + ends) * (t - 1) / t * activation, 0.0);
  }
  if (l.cp > 1) {
    // cp / u ring ranks around Ulysses groups of u (either may be 1). In units of one head of the local
    // sequence, [b, s/cp, head_dim]; kv heads of a tp rank fewer than u are replicated to one per Ulysses
    // rank (ulysses_attention). Ulysses: q, k, v to head shards and the output back forward, their
    // gradients backward, each rank keeping 1/u of each all-to-all: on the critical path. Ring: a rank's
    // K/V (the local sequence's kv heads, whatever u) go around r - 1 times forward; backward sends them
    // again plus the dK/dV accumulators (r hops): hidden behind the attention compute.
    const double u = static_cast<double>(l.cp_ulysses), r = c / u;
    const double heads = static_cast<double>(model.num_heads) / t;
    double kv_heads = static_cast<double>(model.num_kv_heads) / t;
    if (u > kv_heads) kv_heads = u;
    const double head = b * s_local * model.head_dim() * element;
    const double ulysses = u > 1 ? 2 * (2 * heads + 2 * kv_heads) * (u - 1) / u * head : 0;
    const double ring = r > 1 ? 2 * kv_heads * head * (3 * (r - 1) + 1) : 0;
    const double ring_seconds =
        m * layers_per_stage * ring / link_bandwidth(cluster, axis_intra_domain(l, cluster, "cp"));
    add("cp", m * layers_per_stage * (ring + ulysses), std::min(attention_seconds, ring_seconds));
  }
  if (l.ep > 1) {
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
    const double moe_layers_per_stage = static_cast<double>(model.num_moe_layers()) / layers * layers_per_stage;
    const double routed = activation * expected_remote_ranks(model.num_experts, model.experts_per_token, l.ep);
    const double ep = static_cast<double>(l.ep);
    const double skewed_share = (ep + l.expert_imbalance * (ep - 2)) / (2 * (ep - 1));
    const double exchanges = experts_recomputed ? 6 : 4;
    add("ep", m * moe_layers_per_stage * exchanges * routed * skewed_share, 0.0);
  }
  {
    // Data parallelism over the gradients (bf16; fp32 in fp32 training): ZeRO 0-2 all-reduce them once
    // per step and overlap with the backward (two thirds of the compute). ZeRO-3 reduce-scatters the
    // gradients once per step (accumulated over the micro-batches: FSDP2's set_requires_gradient_sync) and
    // all-gathers the blocks' parameters for each micro-batch's forward and again for its backward, and
    // the root unit's (the embedding, final norm and head, outside the blocks) once per micro-batch (FSDP2
    // keeps the root unsharded from its forward to its backward); with pp everything once per step (a
    // pipeline keeps the parameters unsharded through the step: torchdist_ext.pipeline, torchtitan).
    // Overlapped with all the compute.
    const double dense_dp = static_cast<double>(dense_replicas), expert_dp = static_cast<double>(expert_replicas);
    const double block_gathers = l.pp > 1 ? 1 : 2 * m, root_gathers = l.pp > 1 ? 1 : m;
    auto volume = [&](double n, double param_count, double gathers) {
      if (n <= 1) return 0.0;
      const double share = (n - 1) / n * param_count * element;
      return l.zero_stage == 3 ? (gathers + 1) * share : 2 * share;
    };
    const double bytes = volume(dense_dp, dense_per_stage - ends_per_stage, block_gathers) +
                         volume(dense_dp, ends_per_stage, root_gathers) +
                         volume(expert_dp, expert_per_stage, block_gathers);
    if (bytes > 0) add("dp", bytes, l.zero_stage == 3 ? e.compute_seconds : e.compute_seconds * 2 / 3);
  }
  if (l.pp > 1) {
    // Activations forward and their gradients backward at each stage boundary, per micro-batch, by the
    // busiest rank; the sequence-parallel activation is split over tp.
    const double boundary = l.sequence_parallel ? activation / t : activation;
    add("pp", m * busiest_rank_boundary_sends(l.pp, l.schedule, l.virtual_stages) * boundary, 0.0);
  }
  double exposed = 0;
  for (const auto& [axis, comm] : e.comm) exposed += comm.exposed_seconds;
  e.step_seconds = e.compute_seconds / (1.0 - e.bubble) + exposed;
  e.mfu = e.model_flops_per_step / (e.step_seconds * gpus * cluster.min_bf16_flops());
  return e;
}

}  // namespace tdx::planner
