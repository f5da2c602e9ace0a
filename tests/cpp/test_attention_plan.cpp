// The block plans of context-parallel attention (csrc/ops/attention_plan.h)
// against brute force: for every order, rank pair and document mix, the tasks
// cover each visible (query, key) pair exactly once and nothing else.

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "ops/attention_plan.h"

using tdx::ops::AttentionTask;

namespace {

// Global position of local row i of ring rank r (shards of `seq` rows of ranks * seq).
int64_t position(int64_t i, int rank, int ranks, int64_t seq, bool zigzag) {
  if (!zigzag) return rank * seq + i;
  const int64_t half = seq / 2;
  const int64_t chunk = i < half ? rank : 2 * ranks - 1 - rank;
  return chunk * half + i % half;
}

// Packed documents of random lengths (some of length 1 and some longer than a shard), padding (-1) at the
// end of odd rows, and one id reused in a later document to check that equal ids need not be contiguous.
std::vector<int64_t> random_documents(std::mt19937& gen, int64_t batch, int64_t total_seq) {
  std::vector<int64_t> ids(batch * total_seq);
  std::uniform_int_distribution<int64_t> length(1, total_seq / 2);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t id = 0;
    for (int64_t i = 0; i < total_seq;) {
      const int64_t end = std::min(total_seq, i + length(gen));
      for (; i < end; ++i) ids[b * total_seq + i] = id;
      id = (id + 1) % 3;
    }
    if (b % 2) {
      for (int64_t i = total_seq - total_seq / 4; i < total_seq; ++i) ids[b * total_seq + i] = -1;
    }
  }
  return ids;
}

void expect_exact_cover(const std::vector<int64_t>& ids, int64_t batch, int64_t total_seq, int ranks, bool zigzag,
                        bool causal) {
  const int64_t seq = total_seq / ranks;
  int64_t visible_total = 0, covered_total = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto q_ids = tdx::ops::shard_ids(ids.data(), batch, total_seq, ranks, r, zigzag);
    for (int s = 0; s < ranks; ++s) {
      const auto k_ids = tdx::ops::shard_ids(ids.data(), batch, total_seq, ranks, s, zigzag);
      const auto tasks = tdx::ops::split_by_document(tdx::ops::plan_ring_block(causal, zigzag, r, s, seq),
                                                     q_ids.data(), k_ids.data(), batch, seq);
      std::vector<int> covered(batch * seq * seq, 0);
      for (const AttentionTask& t : tasks) {
        ASSERT_GE(t.batch, 0);
        if (t.causal) ASSERT_EQ(t.q_start, t.kv_start);
        if (t.causal) ASSERT_EQ(t.q_len, t.kv_len);
        for (int64_t i = t.q_start; i < t.q_start + t.q_len; ++i) {
          for (int64_t j = t.kv_start; j < t.kv_start + t.kv_len; ++j) {
            if (!t.causal || j - t.kv_start <= i - t.q_start) ++covered[(t.batch * seq + i) * seq + j];
          }
        }
        covered_total += t.scores();
      }
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < seq; ++i) {
          for (int64_t j = 0; j < seq; ++j) {
            const int64_t qi = q_ids[b * seq + i], kj = k_ids[b * seq + j];
            const bool visible = qi >= 0 && qi == kj &&
                                 (!causal || position(j, s, ranks, seq, zigzag) <= position(i, r, ranks, seq, zigzag));
            visible_total += visible;
            ASSERT_EQ(covered[(b * seq + i) * seq + j], visible ? 1 : 0)
                << "rank " << r << " source " << s << " batch " << b << " q " << i << " k " << j;
          }
        }
      }
    }
  }
  EXPECT_EQ(covered_total, visible_total);
  int64_t work = 0;
  for (int64_t w : tdx::ops::ring_attention_work(ids.data(), batch, total_seq, ranks, zigzag, causal)) work += w;
  EXPECT_EQ(work, visible_total);
}

}  // namespace

TEST(AttentionPlan, DocumentTasksCoverExactlyTheVisiblePairs) {
  std::mt19937 gen(0);
  for (int ranks : {1, 2, 4}) {
    for (bool zigzag : {false, true}) {
      for (bool causal : {false, true}) {
        for (int trial = 0; trial < 5; ++trial) {
          const int64_t total_seq = 8 * ranks;
          expect_exact_cover(random_documents(gen, 3, total_seq), 3, total_seq, ranks, zigzag, causal);
        }
      }
    }
  }
}

TEST(AttentionPlan, OneDocumentNeedsOneTaskPerBlock) {
  // Without documents a block is one call over every batch row; with one document it is one call per row.
  const int ranks = 4;
  const int64_t seq = 8, batch = 2;
  const std::vector<int64_t> ids(batch * ranks * seq, 7);
  for (bool zigzag : {false, true}) {
    for (int r = 0; r < ranks; ++r) {
      for (int s = 0; s < ranks; ++s) {
        const auto block = tdx::ops::plan_ring_block(true, zigzag, r, s, seq);
        const auto q_ids = tdx::ops::shard_ids(ids.data(), batch, ranks * seq, ranks, r, zigzag);
        const auto tasks = tdx::ops::split_by_document(block, q_ids.data(), q_ids.data(), batch, seq);
        EXPECT_EQ(tasks.size(), block.size() * batch);
        if (!zigzag) EXPECT_EQ(block.empty(), s > r);  // contiguous causal: later blocks are skipped
        if (zigzag) EXPECT_EQ(block.size(), 1u);       // zigzag: every block has work
      }
    }
  }
}

TEST(AttentionPlan, ZigzagBalancesCausalWork) {
  // One document of 4 ranks x 8 rows: zigzag gives every rank the same causal work, contiguous does not.
  const int ranks = 4;
  for (bool zigzag : {false, true}) {
    const auto work = tdx::ops::ring_attention_work(nullptr, 1, ranks * 8, ranks, zigzag, true);
    std::vector<int64_t> per_rank(ranks, 0);
    for (int r = 0; r < ranks; ++r) {
      for (int s = 0; s < ranks; ++s) per_rank[r] += work[r * ranks + s];
    }
    if (zigzag) {
      for (int r = 1; r < ranks; ++r) EXPECT_EQ(per_rank[r], per_rank[0]);
    } else {
      EXPECT_EQ(per_rank[0], 8 * 9 / 2);
      EXPECT_EQ(per_rank[3], 3 * 64 + 8 * 9 / 2);
    }
  }
}
