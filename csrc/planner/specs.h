#pragma once
// The planner's inputs: a model, a cluster, a layout. Torch-free; every
// figure is computed from these by the formulas in memory.h, pipeline.h and
// estimate.h. Sizes are validated here: a bad value throws
// std::invalid_argument naming the field, the value and the rule.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "planner/options.h"

namespace tdx::planner {

// A decoder-only transformer (Llama family; MoE optional).
struct ModelSpec {
  std::string name;
  int64_t num_layers = 0;
  int64_t hidden = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;       // = num_heads when not grouped
  int64_t ffn_hidden = 0;         // dense SwiGLU width
  int64_t vocab_size = 32000;
  int64_t num_experts = 1;        // routed experts per MoE layer (1: dense)
  int64_t experts_per_token = 1;  // top-k
  int64_t moe_ffn_hidden = 0;     // expert SwiGLU width
  int64_t num_dense_layers = 0;   // leading layers with a dense MLP in an MoE model (DeepSeek-V3: 3)
  int64_t num_shared_experts = 0; // experts every token uses, besides the routed top-k
  double num_params = 0;          // the published total, when the architecture is outside count_params'
                                  // formula (0: counted from the shapes)
  bool fused_projections = true;  // q, k, v (and the MLP's gate and up projections) one GEMM each, as in
                                  // Megatron; false: separate column-parallel linears, each gathering
                                  // (with SP) or all-reducing the gradient of (without) its input itself

  int64_t head_dim() const { return hidden / num_heads; }
  bool is_moe() const { return num_experts > 1; }
  int64_t num_moe_layers() const { return is_moe() ? num_layers - num_dense_layers : 0; }
  void validate() const;
};

// Parameter counts of a ModelSpec (untied embeddings, SwiGLU MLPs, RMSNorm, biases-free).
struct ParamCount {
  double total = 0;        // every parameter
  double active = 0;       // used per token (routed experts: top-k of them)
  double expert = 0;       // in routed experts (sharded by expert parallelism)
  double moe_active = 0;   // of active, the MoE layers' routers, shared experts and top-k routed experts
  double routed_active = 0;  // of moe_active, the top-k routed experts
  double per_layer_dense = 0;  // attention + norms of one layer
  double embedding = 0;    // input embedding + LM head
};
ParamCount count_params(const ModelSpec& model);

// One GPU type. The peaks and bandwidths are the datasheet's; the efficiencies are what its kernels sustain
// of them (compute.h prices each op with them; the presets say where each figure comes from).
struct GpuSpec {
  std::string name;
  double memory_bytes = 0;
  double bf16_flops = 0;        // dense peak, FLOP/s
  double nvlink_bytes_per_s = 0;     // per GPU, one direction, inside an NVLink domain
  double internode_bytes_per_s = 0;  // per GPU, one direction, between domains
  double hbm_bytes_per_s = 0;        // memory bandwidth
  double fp8_flops = 0;              // dense fp8 peak, FLOP/s (0: no fp8 tensor cores)
  double gemm_efficiency = 0;        // share of bf16_flops a large bf16 GEMM sustains, in (0, 1]
  double fp8_gemm_efficiency = 0;    // share of fp8_flops a large fp8 GEMM sustains (0 without fp8)
  double attention_efficiency = 0;   // share of bf16_flops a flash attention sustains, forward and backward
  void validate() const;
};

// GPUs in NVLink domains (nodes, or NVL72 racks); ranks are numbered in
// `groups` order, a group being `count` GPUs of one type.
struct ClusterSpec {
  std::vector<std::pair<GpuSpec, int64_t>> groups;
  int64_t gpus_per_domain = 8;

  int64_t num_gpus() const;
  const GpuSpec& gpu_of_rank(int64_t rank) const;
  double min_memory_bytes() const;
  double min_bf16_flops() const;
  const GpuSpec& slowest_gpu() const;  // the GPU type of the smallest bf16 peak (the first such group)
  bool one_gpu_type() const;
  void validate() const;
};

// Parallel layout and training settings. Mesh order, innermost first:
// tp, cp, ep, dp (its dp / dp_replicate shard ranks, then dp_replicate), pp (tp groups are consecutive ranks). Expert-parallel ranks
// see different tokens: dense parameters are data-parallel over dp x ep and
// expert parameters over dp. A step trains micro_batch x num_microbatches x
// dp x ep sequences of seq_len tokens (context parallelism splits each sequence).
struct Layout {
  int64_t tp = 1, pp = 1, dp = 1, cp = 1, ep = 1;
  // Ulysses ranks within cp (an all-to-all to head shards and back): 1 is ring attention over all cp ranks,
  // cp Ulysses over all of them, and between the two cp / cp_ulysses ring ranks around Ulysses groups
  // (hybrid_attention). It sets how cp communicates (estimate.cpp), not what a rank holds.
  int64_t cp_ulysses = 1;
  // How the sequence is cut over the ring ranks (Ulysses ranks share every query, whatever the order), and
  // the documents packed in each sequence: log-normal lengths of median `document_median` tokens and
  // log-space deviation `document_sigma` (document_median 0: one document per sequence). They set the
  // attention's work and its spread over the ring ranks (documents.h), which the slowest rank pays.
  CpOrder cp_order = CpOrder::kZigzag;
  double document_median = 0;
  double document_sigma = 1.2;
  // HSDP: the replicas among the dp ranks (1: none). The ZeRO shards span dp x cp x ep / dp_replicate ranks of
  // one replica (a dp axis of dp / dp_replicate ranks), the replicas all-reduce the sharded gradients across
  // dp_replicate groups (the next axis out, before pp). Needs zero_stage >= 1 and must divide dp.
  int64_t dp_replicate = 1;
  int zero_stage = 0;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::kNone;
  // Whether recompute reaches the MoE layers' router and experts. When it does not (FSDP2 units of their own
  // that a checkpoint would all-gather again in its rerun), the layer is the main job's MoE block: its norms
  // and attention recomputed each on its own, keeping its input, the MoE all that recompute="none" keeps
  // (memory.h); under full recompute the experts' forward GEMMs and the SP gather of their input are not
  // rerun (estimate.cpp).
  bool recompute_experts = true;
  // The busiest ep rank's routed (token, expert) rows over the mean, in [1, ep]: 1 is uniform routing; a capacity
  // factor c bounds that rank's rows by c T k / ep (the dropless mean). That rank's experts keep and compute
  // that many times the rows (memory.h, estimate.cpp, which also prices what it sends).
  double expert_imbalance = 1.0;
  AttentionKernel attention = AttentionKernel::kFlash;  // what the attention stores for the backward
  NormKernel norm = NormKernel::kFused;  // RMSNorm's kernel: CUDA's fused one, or torch's CPU composite
  int64_t micro_batch = 1;
  int64_t num_microbatches = 1;
  Schedule schedule = Schedule::k1F1B;
  int64_t virtual_stages = 1;
  int64_t seq_len = 4096;
  Precision precision = Precision::kBf16Mixed;
  // torch.compile of the blocks: the memory-bound ops fused into few kernels (compute.h), not each its own.
  bool compiled = false;
  // fp8 recipe (with fp8 GEMMs: precision fp8-mixed or fp8-fp32)
  int64_t fp8_amax_history = 1024;
  Fp8GradFormat fp8_grad_format = Fp8GradFormat::kE5M2;
  bool fp8_attention = false;  // fp8 around softmax (attention GEMMs in fp8)

  int64_t world_size() const { return tp * pp * dp * cp * ep; }
  int64_t sequences_per_step() const { return micro_batch * num_microbatches * dp * ep; }
  // Whether the schedule splits each backward, deferring the weight gradients to W passes (zb-h1, zb-v).
  bool defers_weight_grads() const { return pp > 1 && (schedule == Schedule::kZbH1 || schedule == Schedule::kZbV); }
  // Stride of an axis in the mesh order: the product of the inner axes' sizes.
  int64_t stride(const std::string& axis) const;
  void validate() const;
  // What keeps this layout from running `model` on `cluster` at all (sizes that do not multiply to the
  // cluster or do not divide the model, a schedule without the micro-batches it needs): one message per
  // problem, empty when it can run. check() reports them as TDX008 errors.
  std::vector<std::string> problems_for(const ModelSpec& model, const ClusterSpec& cluster) const;
  // validate() and the model and cluster's own checks, then throws std::invalid_argument with the first of
  // problems_for().
  void validate_for(const ModelSpec& model, const ClusterSpec& cluster) const;
};

}  // namespace tdx::planner
