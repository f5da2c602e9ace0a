#include "planner/pipeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

namespace tdx::planner {

double bubble_fraction(long p, long m, Schedule schedule, long v) {
  if (p < 1 || m < 1 || v < 1) throw std::invalid_argument("pp, num_microbatches and virtual_stages must be >= 1");
  const double stages = static_cast<double>(p), micro = static_cast<double>(m);
  switch (schedule) {
    case Schedule::kGPipe:
    case Schedule::k1F1B: return (stages - 1) / (micro + stages - 1);
    case Schedule::kInterleaved: return (stages - 1) / (static_cast<double>(v) * micro + stages - 1);
    case Schedule::kZbH1:
    case Schedule::kZbV:
      // Too few micro-batches for the closed form: the simulated value.
      if (m < p || (schedule == Schedule::kZbV && m < 2 * p - 1)) {
        return idle_fraction(simulate_schedule(p, m, schedule), p);
      }
      return (stages - 1) / ((schedule == Schedule::kZbH1 ? 3 : 6) * micro + stages - 1);
  }
  throw std::invalid_argument("bubble_fraction: unknown schedule");
}

namespace {

struct OrderedPass {
  char kind;
  long chunk;
  long microbatch;
};

// One pass in a device's fixed order: its pipeline stage, kind, micro-batch, chunk and cost.
struct FixedPass {
  long stage;
  char kind;
  long microbatch;
  long chunk;
  double cost;
};

// Runs each device's passes in their fixed order over `stages` pipeline stages: a pass starts as soon as its
// device is free and its inputs exist (F after the previous stage's F; B after its own F and the next
// stage's B; W after its own B), an input from another device `message` after it was made.
std::vector<ScheduledPass> run_fixed_orders(const std::vector<std::vector<FixedPass>>& orders, long stages,
                                            const char* what, double message = 0.0) {
  const long p = static_cast<long>(orders.size());
  std::map<std::tuple<long, char, long>, std::pair<double, long>> finished;  // (stage, kind, mb) -> (end, device)
  std::vector<size_t> cursor(p, 0);
  std::vector<double> free_at(p, 0.0);
  std::vector<ScheduledPass> timeline;
  size_t remaining = 0;
  for (const auto& order : orders) remaining += order.size();
  while (remaining > 0) {
    bool progressed = false;
    for (long d = 0; d < p; ++d) {
      if (cursor[d] == orders[d].size()) continue;
      const FixedPass& pass = orders[d][cursor[d]];
      std::vector<std::tuple<long, char, long>> inputs;
      if (pass.kind == 'F' && pass.stage > 0) inputs.emplace_back(pass.stage - 1, 'F', pass.microbatch);
      if (pass.kind == 'B') {
        inputs.emplace_back(pass.stage, 'F', pass.microbatch);
        if (pass.stage + 1 < stages) inputs.emplace_back(pass.stage + 1, 'B', pass.microbatch);
      }
      if (pass.kind == 'W') inputs.emplace_back(pass.stage, 'B', pass.microbatch);
      double start = free_at[d];
      bool ready = true;
      for (const auto& input : inputs) {
        const auto found = finished.find(input);
        if (found == finished.end()) {
          ready = false;
          break;
        }
        const auto [end, device] = found->second;
        start = std::max(start, end + (device == d ? 0.0 : message));
      }
      if (!ready) continue;
      timeline.push_back({d, pass.kind, pass.microbatch, start, start + pass.cost, pass.chunk});
      finished[{pass.stage, pass.kind, pass.microbatch}] = {start + pass.cost, d};
      free_at[d] = start + pass.cost;
      ++cursor[d];
      --remaining;
      progressed = true;
    }
    if (!progressed) throw std::logic_error(std::string(what) + ": the pass orders deadlock");
  }
  return timeline;
}

// Megatron-LM's interleaved 1F1B order on device d (forward_backward_pipelining_with_interleaving):
// forwards walk micro-batches in groups of p through chunks 0..v-1, backwards through v-1..0;
// (p - d - 1) * 2 + (v - 1) * p warm-up forwards, then one forward / one backward, then the rest.
std::vector<OrderedPass> interleaved_order(long d, long p, long m, long v) {
  const long total = m * v;
  auto forward = [&](long f) { return OrderedPass{'F', (f / p) % v, (f / (p * v)) * p + f % p}; };
  auto backward = [&](long b) { return OrderedPass{'B', v - 1 - (b / p) % v, (b / (p * v)) * p + b % p}; };
  std::vector<OrderedPass> order;
  const long warmup = std::min((p - d - 1) * 2 + (v - 1) * p, total);
  long f = 0, b = 0;
  for (; f < warmup; ++f) order.push_back(forward(f));
  while (f < total) {
    order.push_back(forward(f++));
    order.push_back(backward(b++));
  }
  while (b < total) order.push_back(backward(b++));
  return order;
}

// Runs fixed per-device orders over p * v virtual stages (chunk c of device d is stage c * p + d).
std::vector<ScheduledPass> simulate_interleaved(long p, long m, long v) {
  if (m % p) throw std::invalid_argument("the interleaved schedule needs num_microbatches divisible by pp");
  const double forward_cost = 1.0 / static_cast<double>(v), backward_cost = 2.0 / static_cast<double>(v);
  std::vector<std::vector<FixedPass>> orders(p);
  for (long d = 0; d < p; ++d) {
    for (const OrderedPass& pass : interleaved_order(d, p, m, v)) {
      orders[d].push_back({stage_of(d, pass.chunk, p, Schedule::kInterleaved), pass.kind, pass.microbatch, pass.chunk,
                           pass.kind == 'F' ? forward_cost : backward_cost});
    }
  }
  return run_fixed_orders(orders, p * v, "simulate_schedule (interleaved)");
}

// ZB-H1 (Qi et al. 2024) as fixed orders: stage s runs 1F1B's p - s warm-up forwards, then for each
// micro-batch its B, a W once more than s weight gradients wait, and the next F; the waiting W last. Stage
// s holds at most p - s micro-batches' activations, or right after a B p - s - 1 and s + 1 deferred W
// inputs (w units each): at most p units for w <= 1, 1F1B's peak (its stage 0), where running each W only
// where a stage would idle piles up to m on the last stage. With
// T_F = T_B = T_W the idle fraction is still (p - 1) / (3m + p - 1) for m >= p (tested): the s deferred
// W of stage s fill the s units it waits for the first B at the start of the drain.
std::vector<ScheduledPass> simulate_zb_h1(long p, long m) {
  std::vector<std::vector<FixedPass>> orders(p);
  for (long s = 0; s < p; ++s) {
    long f = 0, b = 0, w = 0;
    const auto put = [&](char kind, long& next) { orders[s].push_back({s, kind, next++, 0, 1.0}); };
    while (f < std::min(p - s, m)) put('F', f);
    while (b < m) {
      put('B', b);
      if (b - w > s) put('W', w);
      if (f < m) put('F', f);
    }
    while (w < m) put('W', w);
  }
  return run_fixed_orders(orders, p, "simulate_schedule (zb-h1)");
}

// ZB-V (Qi et al. 2024, section 6): device d holds chunk 0 = stage d (the way down) and chunk 1 = stage
// 2p-1-d (the way back up); every pass of a chunk costs 1/2.
//
// With m > p the order is the paper's handcrafted one (as torch's ScheduleZBVZeroBubble writes it): device
// d runs 2(p-d)-1 forwards of chunk 0, d pairs (F chunk 1, F chunk 0), p-d triples (F, B, W of chunk 1);
// then, while forwards remain, F B W of chunk 0 and F B W of chunk 1; then d pairs (B chunk 0, B chunk 1)
// and p-d pairs (B, W of chunk 0); the waiting W last. It is laid out for max(m, 2p-1) micro-batches and the
// passes of micro-batches >= m dropped. A device holds at most 2p chunk units, 1F1B's p stages (tested for
// W inputs of 0, 1/2 and 1 activations' worth), and for m >= 2p-1 the idle fraction is exactly
// (p - 1) / (6m + p - 1) (from m >= 3p/2 on, as simulated for p <= 8; below, more: 0.118 against 0.091 at
// p = 4, m = 5).
//
// The greedy order: a free device starts, in order of preference, a ready backward (chunk 0 first: it ends
// a micro-batch), a ready forward on chunk 1, a ready forward on chunk 0, then a pending weight gradient;
// a forward only while device d holds fewer than caps[d] <= 2p chunk units (forwards whose W has not run:
// at most 1F1B's memory whatever the W inputs weigh, up to a whole unit). A cap below 2p holds a forward back
// so that a later one, or a backward, finds its device free: the lookahead a greedy order lacks. With m <= p
// no order holds more than 2m <= 2p units, and the greedy order under 2p reaches the closed form at m = p,
// where the handcrafted order (laid out for 2p-1) idles 0.20 against 0.11 at p = 4. For p < m < 2p - 1 the
// step runs the handcrafted order or the greedy one under a cap profile, the first to reach the closed form
// (no order idles less) or else the least idle: the profiles min(2p, c + floor(k d / 2)) for c in [1, 2p] and
// k in {0, 1, 2}, then min(2p, max(a, c + d)) for a in [1, 2p] and c within 2 of m (a device nearer the V's
// turn gets no less room). That reaches the closed form for every such m up to p = 16 (p = 5, m = 6: 0.100,
// where the better of the greedy order under 2p and the handcrafted one idled 0.122; p = 8, m = 9: 0.115
// against 0.169; the plateaus for p = 11, m = 13 and five more at p = 13 and 15). Returns nothing where an
// order stalls (a cap too small for the V to turn).
std::optional<std::vector<ScheduledPass>> simulate_zb_v_greedy(long p, long m, const std::vector<long>& caps) {
  const long stages = 2 * p;
  auto device_of = [&](long stage) { return stage < p ? stage : stages - 1 - stage; };
  // When each (stage, micro-batch)'s F and B end (infinity until they run).
  std::vector<double> forward_end(static_cast<size_t>(stages * m), std::numeric_limits<double>::infinity());
  std::vector<double> backward_end = forward_end;
  auto done_by = [&](long stage, char kind, long micro, double t) {
    return (kind == 'F' ? forward_end : backward_end).at(static_cast<size_t>(stage * m + micro)) <= t;
  };
  std::vector<long> next_forward(stages, 0), next_backward(stages, 0);
  std::vector<std::vector<std::pair<long, long>>> pending_weights(p);  // (stage, micro-batch)
  std::vector<double> free_at(p, 0.0);
  std::vector<long> held(p, 0);  // forwards whose W has not run, per device
  std::vector<ScheduledPass> timeline;
  const size_t total = static_cast<size_t>(3 * stages * m);
  for (double t = 0; timeline.size() < total; t += 0.5) {
    if (t > static_cast<double>(total)) return std::nullopt;  // every device idles for good
    for (long d = 0; d < p; ++d) {
      if (free_at[d] > t) continue;
      const long down = d, up = stages - 1 - d;
      char kind = 0;
      long stage = 0, micro = 0;
      for (long candidate : {down, up}) {
        const long b = next_backward[candidate];
        if (b < m && done_by(candidate, 'F', b, t) &&
            (candidate == stages - 1 || done_by(candidate + 1, 'B', b, t))) {
          kind = 'B', stage = candidate, micro = b;
          break;
        }
      }
      for (long candidate : {up, down}) {
        if (kind == 0 && held[d] < caps[d] && next_forward[candidate] < m &&
            (candidate == 0 || done_by(candidate - 1, 'F', next_forward[candidate], t))) {
          kind = 'F', stage = candidate, micro = next_forward[candidate];
        }
      }
      if (kind == 0 && !pending_weights[d].empty()) {
        kind = 'W';
        std::tie(stage, micro) = pending_weights[d].front();
        pending_weights[d].erase(pending_weights[d].begin());
      }
      if (kind == 0) continue;
      timeline.push_back({device_of(stage), kind, micro, t, t + 0.5, stage == down ? 0L : 1L});
      if (kind != 'W') (kind == 'F' ? forward_end : backward_end).at(static_cast<size_t>(stage * m + micro)) = t + 0.5;
      free_at[d] = t + 0.5;
      if (kind == 'F') ++next_forward[stage], ++held[d];
      if (kind == 'W') --held[d];
      if (kind == 'B') {
        ++next_backward[stage];
        pending_weights[d].emplace_back(stage, micro);
      }
    }
  }
  return timeline;
}

std::vector<ScheduledPass> simulate_zb_v_handcrafted(long p, long m) {
  const long laid_out = std::max(m, 2 * p - 1);
  std::vector<std::vector<FixedPass>> orders(p);
  for (long d = 0; d < p; ++d) {
    const long down = d, up = 2 * p - 1 - d;
    long forward[2] = {0, 0}, backward[2] = {0, 0}, weight[2] = {0, 0};
    const auto put = [&](long chunk, char kind, long* next) {
      if (next[chunk] < m) orders[d].push_back({chunk == 0 ? down : up, kind, next[chunk], chunk, 0.5});
      ++next[chunk];
    };
    for (long i = 0; i < 2 * (p - d) - 1; ++i) put(0, 'F', forward);
    for (long i = 0; i < d; ++i) put(1, 'F', forward), put(0, 'F', forward);
    for (long i = 0; i < p - d; ++i) put(1, 'F', forward), put(1, 'B', backward), put(1, 'W', weight);
    while (forward[1] < forward[0] || forward[0] < laid_out) {
      if (forward[0] < laid_out) put(0, 'F', forward);
      put(0, 'B', backward), put(0, 'W', weight);
      put(1, 'F', forward), put(1, 'B', backward), put(1, 'W', weight);
    }
    for (long i = 0; i < d; ++i) put(0, 'B', backward), put(1, 'B', backward);
    for (long i = 0; i < p - d; ++i) put(0, 'B', backward), put(0, 'W', weight);
    while (weight[1] < backward[1]) put(1, 'W', weight);
    while (weight[0] < backward[0]) put(0, 'W', weight);
  }
  return run_fixed_orders(orders, 2 * p, "simulate_schedule (zb-v)");
}

std::vector<ScheduledPass> simulate_zb_v(long p, long m) {
  const long units = 2 * p;
  if (m <= p) {
    auto greedy = simulate_zb_v_greedy(p, m, std::vector<long>(p, units));
    if (!greedy) throw std::logic_error("simulate_schedule (zb-v): the greedy order stalled");
    return *greedy;
  }
  auto best = simulate_zb_v_handcrafted(p, m);
  if (m >= 2 * p - 1) return best;
  // No order idles less than the warm-up of the closed form: the search stops at the first that reaches it.
  const double closed_form = static_cast<double>(p - 1) / static_cast<double>(6 * m + p - 1);
  double least_idle = idle_fraction(best, p);
  auto reaches_closed_form = [&](auto cap_of_device) {
    std::vector<long> caps(p);
    for (long d = 0; d < p; ++d) caps[d] = std::min(units, cap_of_device(d));
    if (auto greedy = simulate_zb_v_greedy(p, m, caps)) {
      const double idle = idle_fraction(*greedy, p);
      if (idle < least_idle - 1e-12) least_idle = idle, best = std::move(*greedy);
    }
    return least_idle <= closed_form + 1e-12;
  };
  if (least_idle <= closed_form + 1e-12) return best;
  for (long c = 1; c <= units; ++c) {
    for (long k = 0; k <= 2; ++k) {
      if (reaches_closed_form([&](long d) { return c + k * d / 2; })) return best;
    }
  }
  for (long c = std::max(1L, m - 2); c <= m + 2; ++c) {
    for (long plateau = 1; plateau <= units; ++plateau) {
      if (reaches_closed_form([&](long d) { return std::max(plateau, c + d); })) return best;
    }
  }
  return best;
}

}  // namespace

std::vector<ScheduledPass> simulate_schedule(long p, long m, Schedule schedule, long v) {
  if (p < 1 || m < 1 || v < 1) throw std::invalid_argument("pp, num_microbatches and virtual_stages must be >= 1");
  if (schedule == Schedule::kInterleaved) return simulate_interleaved(p, m, v);
  if (schedule == Schedule::kZbV) return simulate_zb_v(p, m);
  if (schedule == Schedule::kZbH1) return simulate_zb_h1(p, m);
  const bool gpipe = schedule == Schedule::kGPipe;
  // Every stage, whenever it is free at an integer time, starts the first ready pass by priority:
  //   gpipe  F, then B (all forwards first);
  //   1f1b   B, then F while fewer than p - s micro-batches are forwarded but not backwarded.
  // A B costs 2 (it computes the weight gradient too).
  std::map<std::tuple<long, char, long>, double> finished;
  auto done_by = [&](long stage, char kind, long micro, double t) {
    const auto found = finished.find({stage, kind, micro});
    return found != finished.end() && found->second <= t;
  };
  std::vector<long> next_forward(p, 0), next_backward(p, 0);
  std::vector<double> free_at(p, 0.0);
  std::vector<ScheduledPass> timeline;
  const size_t total = static_cast<size_t>(p * m * 2);
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
      }
      if (kind == 0) continue;
      const double cost = kind == 'B' ? 2.0 : 1.0;
      timeline.push_back({s, kind, micro, t, t + cost});
      finished[{s, kind, micro}] = t + cost;
      free_at[s] = t + cost;
      if (kind == 'F') ++next_forward[s];
      if (kind == 'B') ++next_backward[s];
    }
  }
  return timeline;
}

long chunks_per_rank(Schedule schedule, long virtual_stages) {
  return schedule == Schedule::kZbV ? 2 : (schedule == Schedule::kInterleaved ? virtual_stages : 1);
}

long stage_of(long rank, long chunk, long pp, Schedule schedule) {
  if (schedule == Schedule::kZbV) return chunk == 0 ? rank : 2 * pp - 1 - rank;
  return chunk * pp + rank;
}

double busiest_rank_boundary_sends(long pp, Schedule schedule, long virtual_stages) {
  const long chunks = chunks_per_rank(schedule, virtual_stages), stages = pp * chunks;
  std::vector<long> rank_of(static_cast<size_t>(stages));
  for (long rank = 0; rank < pp; ++rank) {
    for (long chunk = 0; chunk < chunks; ++chunk) rank_of[static_cast<size_t>(stage_of(rank, chunk, pp, schedule))] = rank;
  }
  std::vector<long> sends(static_cast<size_t>(pp), 0);
  for (long stage = 0; stage < stages; ++stage) {
    const long rank = rank_of[static_cast<size_t>(stage)];
    if (stage + 1 < stages && rank_of[static_cast<size_t>(stage + 1)] != rank) sends[static_cast<size_t>(rank)] += 1;
    if (stage > 0 && rank_of[static_cast<size_t>(stage - 1)] != rank) sends[static_cast<size_t>(rank)] += 1;
  }
  return static_cast<double>(*std::max_element(sends.begin(), sends.end()));
}

std::vector<ScheduledPass> replay_schedule(long p, long m, Schedule schedule, long v, const std::vector<double>& forward,
                                           const std::vector<double>& backward, const std::vector<double>& weight,
                                           double message) {
  if (!(message >= 0)) throw std::invalid_argument("replay_schedule: the message time must be >= 0");
  const auto simulated = simulate_schedule(p, m, schedule, v);
  const bool split = schedule == Schedule::kZbH1 || schedule == Schedule::kZbV;
  const long stages = p * chunks_per_rank(schedule, v);
  const auto per_stage = static_cast<size_t>(stages), per_pass = static_cast<size_t>(stages * m);
  for (const auto* costs : {&forward, &backward, &weight}) {
    if (costs->size() != 1 && costs->size() != per_stage && costs->size() != per_pass) {
      throw std::invalid_argument("replay_schedule: give one cost per kind, one per stage (" + std::to_string(stages) +
                                  ") or one per stage and micro-batch (" + std::to_string(stages * m) + "), got " +
                                  std::to_string(costs->size()));
    }
    for (double cost : *costs) {
      if (!(cost >= 0)) throw std::invalid_argument("replay_schedule: the forward, backward and weight costs must be >= 0");
    }
  }
  auto cost_of = [&](const std::vector<double>& costs, long stage, long micro) {
    if (costs.size() == 1) return costs[0];
    return costs.size() == per_stage ? costs[stage] : costs[stage * m + micro];
  };
  std::vector<std::vector<ScheduledPass>> simulated_orders(p);
  for (const auto& pass : simulated) simulated_orders[pass.rank].push_back(pass);
  std::vector<std::vector<FixedPass>> orders(p);
  for (long d = 0; d < p; ++d) {
    std::stable_sort(simulated_orders[d].begin(), simulated_orders[d].end(),
                     [](const ScheduledPass& a, const ScheduledPass& b) { return a.start < b.start; });
    for (const ScheduledPass& pass : simulated_orders[d]) {
      const long stage = stage_of(d, pass.chunk, p, schedule);
      const long micro = pass.microbatch;
      const double cost = pass.kind == 'F'   ? cost_of(forward, stage, micro)
                          : pass.kind == 'W' ? cost_of(weight, stage, micro)
                                             : cost_of(backward, stage, micro) + (split ? 0.0 : cost_of(weight, stage, micro));
      orders[d].push_back({stage, pass.kind, pass.microbatch, pass.chunk, cost});
    }
  }
  return run_fixed_orders(orders, stages, "replay_schedule", message);
}

std::vector<double> peak_held_bytes_per_rank(const std::vector<ScheduledPass>& timeline, long p, Schedule schedule,
                                             const std::vector<StageBytes>& stages) {
  // Interleaved timelines have any number of chunks; the other schedules one, zb-v two.
  const long last_chunk = schedule == Schedule::kInterleaved ? std::numeric_limits<long>::max()
                                                              : chunks_per_rank(schedule, 1) - 1;
  long needed = 0;
  for (const auto& pass : timeline) {
    if (pass.rank < 0 || pass.rank >= p || pass.chunk < 0 || pass.chunk > last_chunk) {
      throw std::invalid_argument("peak_held_bytes_per_rank: a pass on rank " + std::to_string(pass.rank) +
                                  ", chunk " + std::to_string(pass.chunk) + " is not in a " + std::to_string(p) +
                                  "-rank timeline of this schedule");
    }
    needed = std::max(needed, stage_of(pass.rank, pass.chunk, p, schedule) + 1);
  }
  if (static_cast<long>(stages.size()) < needed) {
    throw std::invalid_argument("peak_held_bytes_per_rank: the timeline runs " + std::to_string(needed) +
                                " stages, stages has " + std::to_string(stages.size()));
  }
  for (const auto& stage : stages) {
    if (!(stage.forward >= 0 && stage.weight_input >= 0 && stage.backward_peak >= 0)) {
      throw std::invalid_argument(
          "peak_held_bytes_per_rank: a stage's forward, weight_input and backward_peak bytes must be >= 0");
    }
  }
  const bool deferred = std::any_of(timeline.begin(), timeline.end(), [](const ScheduledPass& pass) {
    return pass.kind == 'W';
  });
  std::vector<std::vector<ScheduledPass>> orders(p);
  for (const auto& pass : timeline) orders.at(pass.rank).push_back(pass);
  std::vector<double> peaks;
  for (auto& order : orders) {
    std::stable_sort(order.begin(), order.end(),
                     [](const ScheduledPass& a, const ScheduledPass& b) { return a.start < b.start; });
    double held = 0, peak = 0;
    for (const auto& pass : order) {
      const StageBytes& bytes = stages.at(static_cast<size_t>(stage_of(pass.rank, pass.chunk, p, schedule)));
      if (pass.kind == 'F') {
        held += bytes.forward;
      } else if (pass.kind == 'W') {
        held -= bytes.weight_input;
      } else {
        peak = std::max(peak, held + bytes.backward_peak);
        held += (deferred ? bytes.weight_input : 0) - bytes.forward;
      }
      peak = std::max(peak, held);
    }
    peaks.push_back(peak);
  }
  return peaks;
}

std::vector<double> peak_held_activations_per_rank(const std::vector<ScheduledPass>& timeline, long p,
                                                   double weight_inputs) {
  if (!(weight_inputs >= 0)) throw std::invalid_argument("peak_held_activations: weight_inputs must be >= 0");
  long chunks = 1;
  for (const auto& pass : timeline) chunks = std::max(chunks, pass.chunk + 1);
  // Equal stages: the chunks' placement does not matter (round-robin's numbering is the simplest).
  return peak_held_bytes_per_rank(timeline, p, Schedule::kInterleaved,
                                  std::vector<StageBytes>(static_cast<size_t>(p * chunks), {1.0, weight_inputs}));
}

std::vector<double> held_activations_per_rank(long p, long m, Schedule schedule, long v, double weight_inputs) {
  if (schedule == Schedule::kZbH1 || schedule == Schedule::kZbV) {
    return peak_held_activations_per_rank(simulate_schedule(p, m, schedule, v), p, weight_inputs);
  }
  std::vector<double> held;
  for (long r = 0; r < p; ++r) {
    const long units = schedule == Schedule::kGPipe        ? m
                       : schedule == Schedule::kInterleaved ? std::min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)
                                                            : std::min(p - r, m);
    held.push_back(static_cast<double>(units));
  }
  return held;
}

double peak_held_activations(const std::vector<ScheduledPass>& timeline, long p, double weight_inputs) {
  const auto peaks = peak_held_activations_per_rank(timeline, p, weight_inputs);
  return peaks.empty() ? 0.0 : *std::max_element(peaks.begin(), peaks.end());
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
