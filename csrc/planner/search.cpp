#include "planner/search.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <stdexcept>

#include "planner/checks.h"

namespace tdx::planner {
namespace {

// Divisors of n in increasing order, found up to sqrt(n).
std::vector<long> divisors(long n) {
  std::vector<long> small, large;
  for (long d = 1; d <= n / d; ++d) {
    if (n % d) continue;
    small.push_back(d);
    if (d != n / d) large.push_back(n / d);
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

// Powers of two up to `limit` that divide n.
std::vector<long> power_of_two_divisors(long n, long limit) {
  std::vector<long> out;
  for (long d = 1; d <= limit && n % d == 0; d *= 2) out.push_back(d);
  return out;
}

}  // namespace

// The candidates per axis depend on the model and the NVLink domain, not on the cluster's
// size, so the search is bounded: tp a power of two within a domain, pp a divisor of the
// layers, cp a power of two up to 16, ep a divisor of the experts; dp takes the rest.
std::vector<std::pair<Layout, Estimate>> search(const ModelSpec& model, const ClusterSpec& cluster, long seq_len,
                                                long global_batch, long top, double expert_imbalance,
                                                bool compiled) {
  model.validate();
  cluster.validate();
  if (seq_len < 1) throw std::invalid_argument("seq_len must be positive");
  if (global_batch < 1) throw std::invalid_argument("global_batch must be positive");
  if (top < 1) throw std::invalid_argument("top must be positive");
  if (!(expert_imbalance >= 1 && std::isfinite(expert_imbalance))) {
    throw std::invalid_argument("expert_imbalance must be a finite number >= 1 (the busiest ep rank's routed rows "
                                "over the mean), got " + std::to_string(expert_imbalance));
  }
  const long gpus = cluster.num_gpus();
  std::vector<std::pair<Layout, Estimate>> feasible;
  for (long tp : power_of_two_divisors(gpus, cluster.gpus_per_domain)) {
    if (model.num_heads % tp) continue;
    for (long pp : divisors(model.num_layers)) {  // the search keeps stages even
      if ((gpus / tp) % pp) continue;
      for (long cp : power_of_two_divisors(gpus / tp / pp, 16)) {
        if (seq_len % (cp * tp)) continue;
        for (long ep : divisors(model.num_experts)) {
          if ((gpus / tp / pp / cp) % ep) continue;
          const long dp = gpus / tp / pp / cp / ep;
          for (long micro_batch : {1L, 2L, 4L}) {
            if (global_batch % (dp * ep * micro_batch)) continue;
            const long microbatches = global_batch / (dp * ep * micro_batch);
            for (int zero : {1, 3}) {
              for (const auto& [recompute, recompute_name] : OptionTable<Recompute>::kNames) {
                for (long virtual_stages : {1L, 2L}) {
                  // interleaved: layers split evenly into 2p chunks, micro-batches in rounds of p
                  if (virtual_stages == 2 && (pp == 1 || model.num_layers % (pp * 2) || microbatches % pp)) continue;
                  Layout l;
                  l.tp = tp, l.pp = pp, l.cp = cp, l.ep = ep, l.dp = dp;
                  l.zero_stage = zero;
                  l.sequence_parallel = tp > 1;
                  l.recompute = recompute;
                  l.micro_batch = micro_batch;
                  l.num_microbatches = microbatches;
                  l.schedule = virtual_stages == 2 ? Schedule::kInterleaved : Schedule::k1F1B;
                  l.virtual_stages = virtual_stages;
                  l.seq_len = seq_len;
                  l.expert_imbalance = std::min(expert_imbalance, static_cast<double>(ep));
                  l.compiled = compiled;
                  const Estimate e = estimate(model, cluster, l);
                  if (!e.fits()) continue;
                  const auto findings = check(model, cluster, l);
                  const bool has_error = std::any_of(findings.begin(), findings.end(),
                                                     [](const Finding& f) { return f.severity == "error"; });
                  if (!has_error) feasible.emplace_back(l, e);
                }
              }
            }
          }
        }
      }
    }
  }
  std::sort(feasible.begin(), feasible.end(),
            [](const auto& a, const auto& b) { return a.second.step_seconds < b.second.step_seconds; });
  if (static_cast<long>(feasible.size()) > top) feasible.resize(top);
  return feasible;
}

}  // namespace tdx::planner
