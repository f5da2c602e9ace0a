#include "planner/memory.h"

#include <algorithm>
#include <stdexcept>

namespace tdx::planner {

ModelStateBytes model_state_bytes(double num_params, int zero_stage, long dp, Precision precision) {
  if (!(num_params > 0)) throw std::invalid_argument("num_params must be positive");
  if (dp < 1) throw std::invalid_argument("dp must be >= 1");
  if (zero_stage < 0 || zero_stage > 3) throw std::invalid_argument("zero_stage must be 0, 1, 2 or 3");
  const double param_bytes = precision == Precision::kFp8Mixed ? 3 : 2;
  const double shard = 1.0 / static_cast<double>(dp);
  ModelStateBytes bytes;
  bytes.params = num_params * param_bytes * (zero_stage >= 3 ? shard : 1.0);
  bytes.grads = num_params * 2 * (zero_stage >= 2 ? shard : 1.0);
  bytes.optimizer = num_params * 12 * (zero_stage >= 1 ? shard : 1.0);
  return bytes;
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

double in_flight_microbatches(long pp, long m, Schedule schedule, long v) {
  const double held = static_cast<double>(std::min(pp, m));
  if (schedule == Schedule::kGPipe) return static_cast<double>(m);
  if (schedule == Schedule::kInterleaved) {
    return held * (1 + static_cast<double>(pp - 1) / (static_cast<double>(pp) * static_cast<double>(v)));
  }
  return held;
}

}  // namespace tdx::planner
