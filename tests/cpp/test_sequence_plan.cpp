// The balanced sequence plan of context parallelism (csrc/ops/sequence_plan.h)
// against brute force: a permutation with S / N ascending positions per rank,
// costs equal to the counted (query, key) pairs, the stated balance on
// long-tailed mixes, and the block tasks of its shards (plan_by_position)
// covering exactly the visible pairs.

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "ops/attention_plan.h"
#include "ops/sequence_plan.h"

namespace {

// Documents of log-normal lengths (median ~400 tokens, clipped to [16, seq]), the last `padding` tokens -1.
std::vector<int64_t> long_tailed_mix(std::mt19937& gen, int64_t seq, int64_t padding = 0) {
  std::lognormal_distribution<double> length(6.0, 1.2);
  std::vector<int64_t> ids(seq, -1);
  int64_t id = 0;
  for (int64_t i = 0; i < seq - padding; ++id) {
    const auto n = std::clamp<int64_t>(static_cast<int64_t>(length(gen)), 16, seq);
    for (const int64_t end = std::min(seq - padding, i + n); i < end; ++i) ids[i] = id;
  }
  return ids;
}

// Short random documents, an id reused later in the row (equal ids need not be contiguous) and padding.
std::vector<int64_t> small_mix(std::mt19937& gen, int64_t seq) {
  std::uniform_int_distribution<int64_t> length(1, seq / 2);
  std::vector<int64_t> ids(seq);
  int64_t id = 0;
  for (int64_t i = 0; i < seq;) {
    for (const int64_t end = std::min(seq, i + length(gen)); i < end; ++i) ids[i] = id % 4 == 3 ? -1 : id % 3;
    ++id;
  }
  return ids;
}

// The number of visible keys of each token, counted pair by pair.
int64_t brute_work(const std::vector<int64_t>& ids, int64_t p) {
  if (ids[p] < 0) return 0;
  int64_t keys = 0;
  for (int64_t j = 0; j <= p; ++j) keys += ids[j] == ids[p];
  return keys;
}

double spread(const std::vector<int64_t>& costs) {
  const double mean = static_cast<double>(std::accumulate(costs.begin(), costs.end(), int64_t{0})) / costs.size();
  return *std::max_element(costs.begin(), costs.end()) / mean - 1.0;
}

void expect_valid_plan(const std::vector<int64_t>& ids, int ranks) {
  const int64_t seq = static_cast<int64_t>(ids.size()), per_rank = seq / ranks;
  const auto plan = tdx::ops::balanced_row_plan(ids.data(), seq, ranks);
  ASSERT_EQ(plan.indices.size(), static_cast<size_t>(seq));
  ASSERT_EQ(plan.costs.size(), static_cast<size_t>(ranks));
  std::vector<int> seen(seq, 0);
  for (int r = 0; r < ranks; ++r) {
    int64_t cost = 0;
    for (int64_t i = 0; i < per_rank; ++i) {
      const int64_t p = plan.indices[r * per_rank + i];
      ASSERT_GE(p, 0);
      ASSERT_LT(p, seq);
      if (i > 0) ASSERT_LT(plan.indices[r * per_rank + i - 1], p) << "rank " << r << " row " << i;
      ++seen[p];
      cost += brute_work(ids, p);
    }
    EXPECT_EQ(plan.costs[r], cost) << "rank " << r;
  }
  for (int64_t p = 0; p < seq; ++p) ASSERT_EQ(seen[p], 1) << "position " << p;
}

// The tasks of rank r's rows over rank s's rows cover exactly the pairs of one document with key <= query.
void expect_exact_cover(const std::vector<int64_t>& ids, int ranks, bool causal) {
  const int64_t seq = static_cast<int64_t>(ids.size()), per_rank = seq / ranks;
  const auto plan = tdx::ops::balanced_row_plan(ids.data(), seq, ranks);
  std::vector<std::vector<int64_t>> shard_ids(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < per_rank; ++i) shard_ids[r].push_back(ids[plan.indices[r * per_rank + i]]);
  }
  for (int r = 0; r < ranks; ++r) {
    const int64_t* q_pos = plan.indices.data() + r * per_rank;
    int64_t rank_work = 0;
    for (int s = 0; s < ranks; ++s) {
      const int64_t* k_pos = plan.indices.data() + s * per_rank;
      const auto tasks = tdx::ops::plan_by_position(q_pos, k_pos, shard_ids[r].data(), shard_ids[s].data(), 1,
                                                    per_rank, causal);
      std::vector<int> covered(per_rank * per_rank, 0);
      for (const auto& t : tasks) {
        if (t.causal) ASSERT_EQ(t.q_len, t.kv_len);
        for (int64_t i = t.q_start; i < t.q_start + t.q_len; ++i) {
          for (int64_t j = t.kv_start; j < t.kv_start + t.kv_len; ++j) {
            if (!t.causal || j - t.kv_start <= i - t.q_start) ++covered[i * per_rank + j];
          }
        }
        rank_work += t.scores();
      }
      for (int64_t i = 0; i < per_rank; ++i) {
        for (int64_t j = 0; j < per_rank; ++j) {
          const bool visible = shard_ids[r][i] >= 0 && shard_ids[r][i] == shard_ids[s][j] &&
                               (!causal || k_pos[j] <= q_pos[i]);
          ASSERT_EQ(covered[i * per_rank + j], visible ? 1 : 0) << "rank " << r << " source " << s << " q " << i
                                                                << " k " << j;
        }
      }
    }
    if (causal) EXPECT_EQ(rank_work, plan.costs[r]);
  }
}

}  // namespace

TEST(SequencePlan, IsAPermutationWithTheCountedCosts) {
  std::mt19937 gen(0);
  for (int ranks : {1, 2, 3, 4, 8}) {
    for (int trial = 0; trial < 4; ++trial) {
      expect_valid_plan(small_mix(gen, 16 * ranks), ranks);
      expect_valid_plan(long_tailed_mix(gen, 512 * ranks, trial * 37), ranks);
    }
  }
}

TEST(SequencePlan, ShardTasksCoverExactlyTheVisiblePairs) {
  std::mt19937 gen(1);
  for (int ranks : {1, 2, 4}) {
    for (bool causal : {false, true}) {
      for (int trial = 0; trial < 4; ++trial) expect_exact_cover(small_mix(gen, 12 * ranks), ranks, causal);
    }
    expect_exact_cover(long_tailed_mix(gen, 384 * ranks, 50), ranks, true);  // long and short runs, padding
  }
  const std::vector<int64_t> one_document(64, 5);
  expect_exact_cover(one_document, 4, true);
}

TEST(SequencePlan, OneDocumentIsZigzag) {
  // 2N chunks of equal size: rank r holds chunks r and 2N-1-r, and every rank the same work.
  const int ranks = 4;
  const std::vector<int64_t> ids(8 * 16, 0);
  const auto plan = tdx::ops::balanced_row_plan(ids.data(), 8 * 16, ranks);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(plan.indices[r * 32], r * 16);
    EXPECT_EQ(plan.indices[r * 32 + 16], (7 - r) * 16);
    EXPECT_EQ(plan.costs[r], plan.costs[0]);
  }
}

TEST(SequencePlan, BalancesLongTailedMixesWithinFivePercent) {
  // The goal on the benchmark's mix (16k tokens, log-normal lengths with median ~400), per row.
  std::mt19937 gen(2);
  for (int ranks : {4, 8}) {
    for (int trial = 0; trial < 20; ++trial) {
      const auto ids = long_tailed_mix(gen, 16384);
      const auto plan = tdx::ops::balanced_row_plan(ids.data(), 16384, ranks);
      EXPECT_LE(spread(plan.costs), 0.05) << ranks << " ranks, trial " << trial;
    }
  }
}

TEST(PositionPlan, IntervalsMeetInAtMostThreeTasks) {
  // Queries at positions [4, 10), keys at [2, 8) of one document: keys 2-3 seen by all, 4-7 causal against
  // queries 4-7, and queries 8-9 see keys 4-7 whole.
  const std::vector<int64_t> q_pos{4, 5, 6, 7, 8, 9}, k_pos{2, 3, 4, 5, 6, 7};
  const auto tasks = tdx::ops::plan_by_position(q_pos.data(), k_pos.data(), nullptr, nullptr, 1, 6, true);
  ASSERT_EQ(tasks.size(), 3u);
  EXPECT_EQ((std::vector<int64_t>{tasks[0].q_start, tasks[0].q_len, tasks[0].kv_start, tasks[0].kv_len}),
            (std::vector<int64_t>{0, 6, 0, 2}));
  EXPECT_TRUE(tasks[1].causal);
  EXPECT_EQ((std::vector<int64_t>{tasks[1].q_start, tasks[1].q_len, tasks[1].kv_start, tasks[1].kv_len}),
            (std::vector<int64_t>{0, 4, 2, 4}));
  EXPECT_EQ((std::vector<int64_t>{tasks[2].q_start, tasks[2].q_len, tasks[2].kv_start, tasks[2].kv_len}),
            (std::vector<int64_t>{4, 2, 2, 4}));
}
