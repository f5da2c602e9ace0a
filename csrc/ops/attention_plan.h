#pragma once
// Which query rows attend to which key rows in one block of context-parallel
// attention: the causal structure of the sequence order (ops/sequence_order.h),
// refined by per-token document ids for packed sequences. Torch-free: the ops
// (ops/attention.cpp) run the tasks; GoogleTest checks the plans
// (tests/cpp/test_attention_plan.cpp).
//
// A task is one block-attention call over a rectangle of (query, key) rows that
// is either fully visible or, on the diagonal, causal (top-left aligned, query
// range == key range). Tasks never overlap and every visible pair is in exactly
// one task, so their log-sum-exp merge is the masked attention.
//
// Documents: a token attends only to tokens of its own document (equal id); a
// negative id is padding (attends to and is seen by nothing). Runs of equal id
// in the local rows become rectangles; a query run and a key run of one
// document on the diagonal are either the same run (causal), earlier keys
// (fully visible) or later keys (skipped).
//
// Positions: with a sequence plan (ops/sequence_plan.h) a rank's rows are not
// one of the two orders but any set of global positions, carried per row. A
// query then sees the keys of its document at positions <= its own. Runs of
// consecutive positions in one document become intervals; a query interval
// and a key interval meet in at most three tasks: the keys before every query
// (fully visible), the positions both hold (causal, square) and the queries
// after those keys (fully visible).

#include <cstdint>
#include <vector>

namespace tdx::ops {

struct AttentionTask {
  int64_t batch = -1;  // the batch row, or -1: every row (no document ids)
  int64_t q_start = 0, q_len = 0, kv_start = 0, kv_len = 0;
  bool causal = false;

  // The (query, key) pairs the task attends over, per batch row and head.
  int64_t scores() const { return causal ? q_len * (q_len + 1) / 2 : q_len * kv_len; }
};

// The tasks of the key block held by ring rank `source` for the queries of ring
// rank `rank`, both shards of `seq` rows (zigzag: chunks r and 2N-1-r of seq / 2
// rows each; else contiguous); empty when the block is fully masked.
std::vector<AttentionTask> plan_ring_block(bool causal, bool zigzag, int rank, int source, int64_t seq);

// `block`'s tasks (batch -1) cut into the rectangles where query and key
// documents agree. `q_ids` and `k_ids` are [batch, seq] row-major: this rank's
// ids and those of the block's keys.
std::vector<AttentionTask> split_by_document(const std::vector<AttentionTask>& block, const int64_t* q_ids,
                                             const int64_t* k_ids, int64_t batch, int64_t seq);

// The tasks of a query block over a key block whose rows carry global
// positions `q_pos` / `k_pos` and documents `q_ids` / `k_ids` (null: one
// document), all [batch, seq] row-major (one rank's rows against another's, or
// a whole sequence against itself).
std::vector<AttentionTask> plan_by_position(const int64_t* q_pos, const int64_t* k_pos, const int64_t* q_ids,
                                            const int64_t* k_ids, int64_t batch, int64_t seq, bool causal);

// Ring rank `rank`'s shard ([batch, total_seq / ranks] row-major) of the ids
// [batch, total_seq] of the sequence in order.
std::vector<int64_t> shard_ids(const int64_t* ids, int64_t batch, int64_t total_seq, int ranks, int rank,
                               bool zigzag);

// The attention scores (query, key pairs, summed over batch rows) that ring
// rank r computes for the key block of rank s, at [r * ranks + s], for the ids
// [batch, total_seq] of the sequence in order (null: one document, no padding).
std::vector<int64_t> ring_attention_work(const int64_t* ids, int64_t batch, int64_t total_seq, int ranks,
                                         bool zigzag, bool causal);

}  // namespace tdx::ops
