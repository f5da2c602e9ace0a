#include "planner/pipeline.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

namespace tdx::planner {

double bubble_fraction(long p, long m, const std::string& schedule, long v) {
  if (p < 1 || m < 1 || v < 1) throw std::invalid_argument("pp, num_microbatches and virtual_stages must be >= 1");
  const double stages = static_cast<double>(p), micro = static_cast<double>(m);
  if (schedule == "gpipe" || schedule == "1f1b") return (stages - 1) / (micro + stages - 1);
  if (schedule == "interleaved") return (stages - 1) / (static_cast<double>(v) * micro + stages - 1);
  if (schedule == "zb-h1" || (schedule == "zb-v" && m < p)) return (stages - 1) / (3 * micro + stages - 1);
  if (schedule == "zb-v") return 0.0;
  throw std::invalid_argument("schedule must be one of 1f1b, gpipe, interleaved, zb-h1, zb-v, got '" + schedule + "'");
}

std::vector<ScheduledPass> simulate_schedule(long p, long m, const std::string& schedule) {
  if (p < 1 || m < 1) throw std::invalid_argument("pp and num_microbatches must be >= 1");
  const bool gpipe = schedule == "gpipe", split = schedule == "zb-h1";
  if (!gpipe && !split && schedule != "1f1b") {
    throw std::invalid_argument("simulate_schedule supports gpipe, 1f1b and zb-h1, got '" + schedule + "'");
  }
  // Every stage, whenever it is free at an integer time, starts the first ready pass by priority:
  //   gpipe  F, then B (all forwards first);
  //   1f1b   B, then F while fewer than p - s micro-batches are forwarded but not backwarded;
  //   zb-h1  as 1f1b, then W: weight gradients fill what would be bubbles (Qi et al. 2024).
  const double backward_cost = split ? 1.0 : 2.0;
  std::map<std::tuple<long, char, long>, double> finished;
  auto done_by = [&](long stage, char kind, long micro, double t) {
    const auto found = finished.find({stage, kind, micro});
    return found != finished.end() && found->second <= t;
  };
  std::vector<long> next_forward(p, 0), next_backward(p, 0);
  std::vector<std::vector<long>> pending_weights(p);
  std::vector<double> free_at(p, 0.0);
  std::vector<ScheduledPass> timeline;
  const size_t total = static_cast<size_t>(p * m * (split ? 3 : 2));
  for (double t = 0; timeline.size() < total; t += 1) {
    for (long s = 0; s < p; ++s) {
      if (free_at[s] > t) continue;
      const long f = next_forward[s], b = next_backward[s];
      const bool forward_ready = f < m && (s == 0 || done_by(s - 1, 'F', f, t));
      const bool backward_ready = b < m && done_by(s, 'F', b, t) && (s == p - 1 || done_by(s + 1, 'B', b, t));
      const bool within_memory = f - b < p - s;
      char kind = 0;
      long micro = 0;
      if (gpipe) {
        if (forward_ready) kind = 'F', micro = f;
        else if (f == m && backward_ready) kind = 'B', micro = b;
      } else if (backward_ready) {
        kind = 'B', micro = b;
      } else if (forward_ready && within_memory) {
        kind = 'F', micro = f;
      } else if (split && !pending_weights[s].empty()) {
        kind = 'W', micro = pending_weights[s].front();
        pending_weights[s].erase(pending_weights[s].begin());
      }
      if (kind == 0) continue;
      const double cost = kind == 'B' ? backward_cost : 1.0;
      timeline.push_back({s, kind, micro, t, t + cost});
      finished[{s, kind, micro}] = t + cost;
      free_at[s] = t + cost;
      if (kind == 'F') ++next_forward[s];
      if (kind == 'B') {
        ++next_backward[s];
        if (split) pending_weights[s].push_back(micro);
      }
    }
  }
  return timeline;
}

double idle_fraction(const std::vector<ScheduledPass>& timeline, long p) {
  double makespan = 0, busy = 0;
  for (const auto& pass : timeline) {
    makespan = std::max(makespan, pass.end);
    busy += pass.end - pass.start;
  }
  return 1.0 - busy / (static_cast<double>(p) * makespan);
}

}  // namespace tdx::planner
