#include "ops/sequence_plan.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>

namespace tdx::ops {
namespace {

constexpr int64_t kLongShare = 32;  // a run is long when its work exceeds the mean rank's / kLongShare

struct Run {
  int64_t start, len;
};

std::vector<Run> id_runs(const int64_t* ids, int64_t seq) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < seq;) {
    int64_t end = i + 1;
    while (end < seq && ids[end] == ids[i]) ++end;
    runs.push_back({i, end - i});
    i = end;
  }
  return runs;
}

class Placement {
 public:
  Placement(const std::vector<int64_t>& work, int ranks, int64_t per_rank)
      : prefix_(work.size() + 1, 0), pieces_(ranks), tokens_(ranks, 0), costs_(ranks, 0), per_rank_(per_rank) {
    std::partial_sum(work.begin(), work.end(), prefix_.begin() + 1);
  }

  int64_t work(int64_t start, int64_t len) const { return prefix_[start + len] - prefix_[start]; }
  int64_t total() const { return prefix_.back(); }
  int64_t room(int r) const { return per_rank_ - tokens_[r]; }
  int64_t tokens(int r) const { return tokens_[r]; }
  int64_t cost(int r) const { return costs_[r]; }
  int ranks() const { return static_cast<int>(tokens_.size()); }

  void place(int r, int64_t start, int64_t len) {
    if (len == 0) return;
    pieces_[r].push_back({start, len});
    tokens_[r] += len;
    costs_[r] += work(start, len);
  }

  RowPlan plan() {
    RowPlan out;
    for (int r = 0; r < ranks(); ++r) {
      auto& pieces = pieces_[r];
      std::sort(pieces.begin(), pieces.end(), [](const Run& a, const Run& b) { return a.start < b.start; });
      for (const auto& piece : pieces) {
        for (int64_t i = 0; i < piece.len; ++i) out.indices.push_back(piece.start + i);
      }
    }
    out.costs = costs_;
    return out;
  }

 private:
  std::vector<int64_t> prefix_;
  std::vector<std::vector<Run>> pieces_;
  std::vector<int64_t> tokens_, costs_;
  int64_t per_rank_;
};

// Step 1: a long run cut into 2N chunks, rank r taking chunks r and 2N-1-r.
void place_zigzag(Placement& placement, const Run& run) {
  const int ranks = placement.ranks();
  const int64_t chunks = 2 * ranks;
  std::vector<int64_t> sizes(chunks, run.len / chunks);
  std::vector<int> fewest(ranks);
  std::iota(fewest.begin(), fewest.end(), 0);
  std::stable_sort(fewest.begin(), fewest.end(),
                   [&](int a, int b) { return placement.tokens(a) < placement.tokens(b); });
  for (int64_t extra = 0; extra < run.len % chunks; ++extra) {
    const int r = fewest[extra % ranks];
    ++sizes[extra < ranks ? r : chunks - 1 - r];
  }
  int64_t start = run.start;
  std::vector<int64_t> starts(chunks);
  for (int64_t c = 0; c < chunks; ++c) {
    starts[c] = start;
    start += sizes[c];
  }
  for (int r = 0; r < ranks; ++r) {
    placement.place(r, starts[r], sizes[r]);
    placement.place(r, starts[chunks - 1 - r], sizes[chunks - 1 - r]);
  }
}

// Step 2: a short run on the least-loaded rank with room for it, or split over the ranks with the most room.
void place_whole(Placement& placement, Run run) {
  while (run.len > 0) {
    int best = -1;
    for (int r = 0; r < placement.ranks(); ++r) {
      if (placement.room(r) >= run.len && (best < 0 || placement.cost(r) < placement.cost(best))) best = r;
    }
    int64_t take = run.len;
    if (best < 0) {
      best = 0;
      for (int r = 1; r < placement.ranks(); ++r) {
        if (placement.room(r) > placement.room(best)) best = r;
      }
      take = placement.room(best);
    }
    placement.place(best, run.start, take);
    run.start += take;
    run.len -= take;
  }
}

}  // namespace

std::vector<int64_t> token_work(const int64_t* ids, int64_t seq) {
  std::vector<int64_t> work(seq, 0);
  std::unordered_map<int64_t, int64_t> seen;
  for (int64_t i = 0; i < seq; ++i) {
    if (ids[i] >= 0) work[i] = ++seen[ids[i]];
  }
  return work;
}

RowPlan balanced_row_plan(const int64_t* ids, int64_t seq, int ranks) {
  Placement placement(token_work(ids, seq), ranks, seq / ranks);
  const auto runs = id_runs(ids, seq);
  std::vector<Run> short_runs;
  for (const auto& run : runs) {
    const bool long_run = run.len >= 2 * ranks &&
                          placement.work(run.start, run.len) * kLongShare * ranks > placement.total();
    if (long_run) {
      place_zigzag(placement, run);
    } else {
      short_runs.push_back(run);
    }
  }
  std::stable_sort(short_runs.begin(), short_runs.end(), [&](const Run& a, const Run& b) {
    const int64_t wa = placement.work(a.start, a.len), wb = placement.work(b.start, b.len);
    return wa != wb ? wa > wb : a.len > b.len;
  });
  for (const auto& run : short_runs) place_whole(placement, run);
  return placement.plan();
}

}  // namespace tdx::ops
