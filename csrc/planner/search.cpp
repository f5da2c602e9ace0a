#include "planner/search.h"

#include <algorithm>
#include <stdexcept>

#include "planner/checks.h"

namespace tdx::planner {
namespace {

std::vector<long> divisors(long n) {
  std::vector<long> out;
  for (long d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

bool is_power_of_two(long n) { return n > 0 && (n & (n - 1)) == 0; }

}  // namespace

std::vector<std::pair<Layout, Estimate>> search(const ModelSpec& model, const ClusterSpec& cluster, long seq_len,
                                                long global_batch, long top) {
  model.validate();
  cluster.validate();
  if (seq_len < 1) throw std::invalid_argument("seq_len must be positive");
  if (global_batch < 1) throw std::invalid_argument("global_batch must be positive");
  if (top < 1) throw std::invalid_argument("top must be positive");
  const long gpus = cluster.num_gpus();
  std::vector<std::pair<Layout, Estimate>> feasible;
  for (long tp : divisors(gpus)) {
    if (!is_power_of_two(tp) || tp > cluster.gpus_per_domain || model.num_heads % tp) continue;
    for (long pp : divisors(gpus / tp)) {
      if (model.num_layers % pp) continue;  // the search keeps stages even
      for (long cp : divisors(gpus / tp / pp)) {
        if (!is_power_of_two(cp) || cp > 16 || seq_len % (cp * tp)) continue;
        for (long ep : divisors(gpus / tp / pp / cp)) {
          if (model.num_experts % ep) continue;
          const long dp = gpus / tp / pp / cp / ep;
          for (long micro_batch : {1L, 2L, 4L}) {
            if (global_batch % (dp * ep * micro_batch)) continue;
            const long microbatches = global_batch / (dp * ep * micro_batch);
            for (int zero : {1, 3}) {
              for (const char* recompute : {"none", "selective", "full"}) {
                for (long virtual_stages : {1L, 2L}) {
                  if (virtual_stages == 2 && (pp == 1 || model.num_layers % (pp * 2))) continue;
                  Layout l;
                  l.tp = tp, l.pp = pp, l.cp = cp, l.ep = ep, l.dp = dp;
                  l.zero_stage = zero;
                  l.sequence_parallel = tp > 1;
                  l.recompute = recompute;
                  l.micro_batch = micro_batch;
                  l.num_microbatches = microbatches;
                  l.schedule = virtual_stages == 2 ? "interleaved" : "1f1b";
                  l.virtual_stages = virtual_stages;
                  l.seq_len = seq_len;
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
