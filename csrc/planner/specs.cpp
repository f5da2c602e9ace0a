#include "planner/specs.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "planner/pipeline.h"

namespace tdx::planner {
namespace {

[[noreturn]] void invalid(const std::string& message) { throw std::invalid_argument(message); }

template <typename T>
std::string str(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

void require_positive(const char* field, double value) {
  if (!(value > 0)) invalid(std::string(field) + " must be positive, got " + str(value));
}

}  // namespace

void ModelSpec::validate() const {
  require_positive("ModelSpec.num_layers", num_layers);
  require_positive("ModelSpec.hidden", hidden);
  require_positive("ModelSpec.num_heads", num_heads);
  require_positive("ModelSpec.num_kv_heads", num_kv_heads);
  require_positive("ModelSpec.vocab_size", vocab_size);
  require_positive("ModelSpec.num_experts", num_experts);
  require_positive("ModelSpec.experts_per_token", experts_per_token);
  if (hidden % num_heads) {
    invalid("ModelSpec.hidden=" + str(hidden) + " must be divisible by num_heads=" + str(num_heads));
  }
  if (num_heads % num_kv_heads) {
    invalid("ModelSpec.num_heads=" + str(num_heads) + " must be divisible by num_kv_heads=" + str(num_kv_heads));
  }
  if (experts_per_token > num_experts) {
    invalid("ModelSpec.experts_per_token=" + str(experts_per_token) + " must not exceed num_experts=" +
            str(num_experts));
  }
  if (is_moe()) require_positive("ModelSpec.moe_ffn_hidden", moe_ffn_hidden);
  if (!is_moe() || num_dense_layers > 0) require_positive("ModelSpec.ffn_hidden", ffn_hidden);
  if (num_dense_layers < 0 || num_dense_layers > num_layers) {
    invalid("ModelSpec.num_dense_layers=" + str(num_dense_layers) + " must lie in [0, num_layers=" +
            str(num_layers) + "]");
  }
  if (num_shared_experts < 0) invalid("ModelSpec.num_shared_experts must be >= 0, got " + str(num_shared_experts));
  if (num_params < 0) invalid("ModelSpec.num_params must be positive (or 0: counted), got " + str(num_params));
}

ParamCount count_params(const ModelSpec& m) {
  m.validate();
  const double h = static_cast<double>(m.hidden);
  const double kv_width = static_cast<double>(m.num_kv_heads) * m.head_dim();
  ParamCount count;
  // q and o are h x h; k and v are h x (kv_heads * head_dim); two RMSNorm weights.
  count.per_layer_dense = 2 * h * h + 2 * h * kv_width + 2 * h;
  const double dense_mlp = 3 * h * m.ffn_hidden;  // SwiGLU: gate, up, down
  const double expert_mlp = 3 * h * m.moe_ffn_hidden;
  const double router = h * m.num_experts;
  const int64_t dense_layers = m.is_moe() ? m.num_dense_layers : m.num_layers;
  const int64_t moe_layers = m.num_moe_layers();
  count.embedding = 2 * h * m.vocab_size + h;  // input embedding, LM head, final norm
  count.expert = moe_layers * m.num_experts * expert_mlp;
  const double shared = moe_layers * (m.num_shared_experts * expert_mlp + router);
  count.total = m.num_layers * count.per_layer_dense + dense_layers * dense_mlp + count.expert + shared +
                count.embedding;
  count.routed_active = moe_layers * m.experts_per_token * expert_mlp;
  count.moe_active = shared + count.routed_active;
  count.active = count.total - count.expert - shared + count.moe_active;
  if (m.num_params > 0) {
    const double scale = m.num_params / count.total;
    count.total *= scale;
    count.active *= scale;
    count.expert *= scale;
    count.moe_active *= scale;
    count.routed_active *= scale;
  }
  return count;
}

void GpuSpec::validate() const {
  require_positive(("GpuSpec(" + name + ").memory_bytes").c_str(), memory_bytes);
  require_positive(("GpuSpec(" + name + ").bf16_flops").c_str(), bf16_flops);
  require_positive(("GpuSpec(" + name + ").nvlink_bytes_per_s").c_str(), nvlink_bytes_per_s);
  require_positive(("GpuSpec(" + name + ").internode_bytes_per_s").c_str(), internode_bytes_per_s);
  require_positive(("GpuSpec(" + name + ").hbm_bytes_per_s").c_str(), hbm_bytes_per_s);
  if (!(fp8_flops >= 0)) invalid("GpuSpec(" + name + ").fp8_flops must be >= 0 (0: no fp8), got " + str(fp8_flops));
  auto share = [&](const char* field, double value) {
    if (!(value > 0 && value <= 1)) {
      invalid("GpuSpec(" + name + ")." + field + " must lie in (0, 1], got " + str(value));
    }
  };
  share("gemm_efficiency", gemm_efficiency);
  share("attention_efficiency", attention_efficiency);
  if (fp8_flops > 0) share("fp8_gemm_efficiency", fp8_gemm_efficiency);
}

int64_t ClusterSpec::num_gpus() const {
  int64_t total = 0;
  for (const auto& group : groups) total += group.second;
  return total;
}

const GpuSpec& ClusterSpec::gpu_of_rank(int64_t rank) const {
  for (const auto& group : groups) {
    if (rank < group.second) return group.first;
    rank -= group.second;
  }
  invalid("ClusterSpec: rank out of range");
}

double ClusterSpec::min_memory_bytes() const {
  double least = groups.at(0).first.memory_bytes;
  for (const auto& group : groups) least = std::min(least, group.first.memory_bytes);
  return least;
}

double ClusterSpec::min_bf16_flops() const {
  double least = groups.at(0).first.bf16_flops;
  for (const auto& group : groups) least = std::min(least, group.first.bf16_flops);
  return least;
}

const GpuSpec& ClusterSpec::slowest_gpu() const {
  const GpuSpec* slowest = &groups.at(0).first;
  for (const auto& group : groups) slowest = group.first.bf16_flops < slowest->bf16_flops ? &group.first : slowest;
  return *slowest;
}

bool ClusterSpec::one_gpu_type() const {
  for (const auto& group : groups) {
    if (group.first.name != groups.at(0).first.name) return false;
  }
  return true;
}

void ClusterSpec::validate() const {
  if (groups.empty()) invalid("ClusterSpec needs at least one group of GPUs");
  for (const auto& group : groups) {
    group.first.validate();
    require_positive("ClusterSpec GPU count", group.second);
  }
  require_positive("ClusterSpec.gpus_per_domain", gpus_per_domain);
  // The checks walk a mixed cluster's ranks; no cluster built comes near this.
  constexpr int64_t kMaxGpus = int64_t{1} << 24;
  if (num_gpus() > kMaxGpus) {
    invalid("ClusterSpec has " + str(num_gpus()) + " GPUs; the planner models at most " + str(kMaxGpus));
  }
}

int64_t Layout::stride(const std::string& axis) const {
  const std::pair<const char*, int64_t> order[] = {
      {"tp", tp}, {"cp", cp}, {"ep", ep}, {"dp", dp / dp_replicate}, {"dp_replicate", dp_replicate}, {"pp", pp}};
  int64_t stride = 1;
  for (const auto& [name, size] : order) {
    if (axis == name) return stride;
    stride *= size;
  }
  invalid("Layout: unknown axis '" + axis + "'");
}

void Layout::validate() const {
  require_positive("Layout.tp", tp);
  require_positive("Layout.pp", pp);
  require_positive("Layout.dp", dp);
  require_positive("Layout.cp", cp);
  require_positive("Layout.ep", ep);
  require_positive("Layout.cp_ulysses", cp_ulysses);
  require_positive("Layout.dp_replicate", dp_replicate);
  if (dp % dp_replicate) {
    invalid("Layout.dp_replicate=" + str(dp_replicate) + " must divide Layout.dp=" + str(dp) +
            " (HSDP's replicas are groups of the dp ranks)");
  }
  if (cp % cp_ulysses) {
    invalid("Layout.cp_ulysses=" + str(cp_ulysses) + " must divide Layout.cp=" + str(cp) +
            " (the Ulysses ranks are a part of the cp ranks)");
  }
  require_positive("Layout.micro_batch", micro_batch);
  require_positive("Layout.num_microbatches", num_microbatches);
  require_positive("Layout.virtual_stages", virtual_stages);
  require_positive("Layout.seq_len", seq_len);
  require_positive("Layout.fp8_amax_history", fp8_amax_history);
  if (!(document_median >= 0 && document_median <= 1e12)) {
    invalid("Layout.document_median must be >= 0 tokens (0: one document per sequence), got " + str(document_median));
  }
  if (!(document_sigma > 0 && document_sigma <= 10)) {
    invalid("Layout.document_sigma must lie in (0, 10] (the log-normal's deviation), got " + str(document_sigma));
  }
  if (!(expert_imbalance >= 1 && expert_imbalance <= static_cast<double>(ep))) {
    invalid("Layout.expert_imbalance must lie in [1, ep=" + str(ep) +
            "] (the busiest ep rank's routed rows over the mean), got " + str(expert_imbalance));
  }
  if (zero_stage < 0 || zero_stage > 3) invalid("Layout.zero_stage must be 0, 1, 2 or 3, got " + str(zero_stage));
  if (dp_replicate > 1 && zero_stage == 0) {
    invalid("Layout.dp_replicate=" + str(dp_replicate) + " needs zero_stage >= 1 (HSDP shards within a replica; " +
            "with zero_stage=0 every dp rank is a replica already)");
  }
  if (schedule != Schedule::kInterleaved && virtual_stages != 1) {
    invalid("Layout.virtual_stages=" + str(virtual_stages) + " needs schedule='interleaved-1f1b', got '" +
            option_name(schedule) + "'");
  }
  // The products the estimates form must fit their int64 (the counts are real, the sizes plausible).
  for (const auto& [what, factors] :
       {std::pair<const char*, std::vector<int64_t>>{"tp x pp x dp x cp x ep", {tp, pp, dp, cp, ep}},
        {"micro_batch x num_microbatches x seq_len x dp", {micro_batch, num_microbatches, seq_len, dp}},
        {"pp x virtual_stages x 2", {pp, virtual_stages, 2}}}) {
    int64_t product = 1;
    std::string values;
    bool overflows = false;
    for (const int64_t factor : factors) {
      values += (values.empty() ? "" : " x ") + str(factor);
      overflows |= __builtin_mul_overflow(product, factor, &product);
    }
    if (overflows) {
      invalid(std::string("Layout: ") + what + " = " + values + " overflows a 64-bit integer: the sizes are out " +
              "of range");
    }
  }
}

std::vector<std::string> Layout::problems_for(const ModelSpec& model, const ClusterSpec& cluster) const {
  std::vector<std::string> problems;
  if (world_size() != cluster.num_gpus()) {
    problems.push_back("Layout: tp x pp x dp x cp x ep = " + str(tp) + " x " + str(pp) + " x " + str(dp) + " x " +
                       str(cp) + " x " + str(ep) + " = " + str(world_size()) + " must equal the cluster's " +
                       str(cluster.num_gpus()) + " GPUs");
  }
  if (model.num_heads % tp) {
    problems.push_back("Layout.tp=" + str(tp) + " must divide ModelSpec.num_heads=" + str(model.num_heads));
  }
  const int64_t stages = pp * chunks_per_rank(schedule, virtual_stages);
  if (stages > model.num_layers) {
    problems.push_back(std::string("Layout: pp x stages per rank (") + option_name(schedule) + ") = " + str(stages) +
                       " pipeline stages must not exceed ModelSpec.num_layers=" + str(model.num_layers));
  }
  if (model.num_experts % ep) {
    problems.push_back("Layout.ep=" + str(ep) + " must divide ModelSpec.num_experts=" + str(model.num_experts));
  }
  // Ulysses gives each of its ranks whole heads of the tp rank's: q heads split evenly, kv heads too or
  // replicated to one per rank (ulysses_attention).
  if (cp_ulysses > 1 && model.num_heads % tp == 0 && (model.num_heads / tp) % cp_ulysses) {
    problems.push_back("Layout.cp_ulysses=" + str(cp_ulysses) +
                       " must divide the heads of a tp rank, num_heads / tp = " + str(model.num_heads / tp));
  }
  if (cp_ulysses > 1 && model.num_kv_heads % tp == 0) {
    const int64_t kv_heads = model.num_kv_heads / tp;
    if (kv_heads % cp_ulysses && cp_ulysses % kv_heads) {
      problems.push_back("Layout.cp_ulysses=" + str(cp_ulysses) + " must divide or be a multiple of the kv heads " +
                         "of a tp rank, num_kv_heads / tp = " + str(kv_heads));
    }
  }
  if (seq_len % cp) problems.push_back("Layout.cp=" + str(cp) + " must divide Layout.seq_len=" + str(seq_len));
  for (const auto& [gpu, count] : cluster.groups) {
    if (uses_fp8_gemms(precision) && !(gpu.fp8_flops > 0)) {
      problems.push_back(std::string("Layout.precision=") + option_name(precision) + " runs fp8 GEMMs: GPU " +
                         gpu.name + " has no fp8 tensor cores (GpuSpec.fp8_flops = 0)");
      break;
    }
  }
  if (sequence_parallel && (seq_len / cp) % tp) {
    problems.push_back("Layout: with sequence_parallel, tp=" + str(tp) + " must divide seq_len / cp = " +
                       str(seq_len / cp));
  }
  // Interleaved 1F1B runs its micro-batches in rounds of pp (Narayanan et al. 2021; Megatron and our runtime).
  if (schedule == Schedule::kInterleaved && pp > 1 && num_microbatches % pp) {
    problems.push_back("Layout: schedule 'interleaved-1f1b' needs num_microbatches divisible by pp=" + str(pp) +
                       ", got " + str(num_microbatches));
  }
  return problems;
}

void Layout::validate_for(const ModelSpec& model, const ClusterSpec& cluster) const {
  validate();
  model.validate();
  cluster.validate();
  const std::vector<std::string> problems = problems_for(model, cluster);
  if (!problems.empty()) invalid(problems.front());
}

}  // namespace tdx::planner
