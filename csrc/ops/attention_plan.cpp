#include "ops/attention_plan.h"

#include <algorithm>
#include <unordered_map>

namespace tdx::ops {
namespace {

struct Run {
  int64_t start, len, id;
};

// Maximal runs of one non-negative id in ids[start, start + len), in row coordinates.
std::vector<Run> document_runs(const int64_t* ids, int64_t start, int64_t len) {
  std::vector<Run> runs;
  for (int64_t i = start; i < start + len;) {
    int64_t end = i + 1;
    while (end < start + len && ids[end] == ids[i]) ++end;
    if (ids[i] >= 0) runs.push_back({i, end - i, ids[i]});
    i = end;
  }
  return runs;
}

// An interval of global positions [pos, pos + len) of one document at local rows [row, row + len).
struct Interval {
  int64_t row, len, pos, id;
};

// Maximal runs of rows of one non-negative id and consecutive positions (ids null: id 0).
std::vector<Interval> position_runs(const int64_t* pos, const int64_t* ids, int64_t seq) {
  const auto id_at = [&](int64_t i) { return ids == nullptr ? int64_t{0} : ids[i]; };
  std::vector<Interval> runs;
  for (int64_t i = 0; i < seq;) {
    int64_t end = i + 1;
    while (end < seq && id_at(end) == id_at(i) && pos[end] == pos[end - 1] + 1) ++end;
    if (id_at(i) >= 0) runs.push_back({i, end - i, pos[i], id_at(i)});
    i = end;
  }
  return runs;
}

// The tasks of query interval q over key interval k of the same document, in batch row b.
void add_interval_tasks(std::vector<AttentionTask>& tasks, int64_t b, const Interval& q, const Interval& k,
                        bool causal) {
  if (!causal) {
    tasks.push_back({b, q.row, q.len, k.row, k.len, false});
    return;
  }
  const int64_t before = std::min(k.pos + k.len, q.pos) - k.pos;  // keys before the first query: seen by all
  if (before > 0) tasks.push_back({b, q.row, q.len, k.row, before, false});
  const int64_t shared = std::max(q.pos, k.pos);  // positions both hold: [shared, shared + both)
  const int64_t both = std::min(q.pos + q.len, k.pos + k.len) - shared;
  if (both <= 0) return;  // (keys after the last query are never seen)
  const int64_t q_off = shared - q.pos, k_off = shared - k.pos;
  tasks.push_back({b, q.row + q_off, both, k.row + k_off, both, true});
  const int64_t after = q.len - q_off - both;  // queries after the shared keys see all of them
  if (after > 0) tasks.push_back({b, q.row + q_off + both, after, k.row + k_off, both, false});
}

}  // namespace

std::vector<AttentionTask> plan_by_position(const int64_t* q_pos, const int64_t* k_pos, const int64_t* q_ids,
                                            const int64_t* k_ids, int64_t batch, int64_t seq, bool causal) {
  std::vector<AttentionTask> tasks;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t offset = b * seq;
    std::unordered_map<int64_t, std::vector<Interval>> key_runs;
    for (const auto& run : position_runs(k_pos + offset, k_ids ? k_ids + offset : nullptr, seq)) {
      key_runs[run.id].push_back(run);
    }
    for (const auto& q : position_runs(q_pos + offset, q_ids ? q_ids + offset : nullptr, seq)) {
      const auto found = key_runs.find(q.id);
      if (found == key_runs.end()) continue;
      for (const auto& k : found->second) add_interval_tasks(tasks, b, q, k, causal);
    }
  }
  return tasks;
}

std::vector<AttentionTask> plan_ring_block(bool causal, bool zigzag, int rank, int source, int64_t seq) {
  const AttentionTask all{-1, 0, seq, 0, seq, false};
  if (!causal) return {all};
  if (source == rank) return {{-1, 0, seq, 0, seq, true}};  // the local chunks in order: causal on their concatenation
  if (!zigzag) {
    if (source < rank) return {all};  // an earlier chunk: fully visible
    return {};                        // a later chunk: fully masked
  }
  // zigzag: this rank holds chunks (r, 2N-1-r), the source (j, 2N-1-j).
  const int64_t half = seq / 2;
  if (source < rank) return {{-1, 0, seq, 0, half, false}};  // every query sees chunk j only
  return {{-1, half, half, 0, seq, false}};                   // only chunk 2N-1-r sees both
}

std::vector<AttentionTask> split_by_document(const std::vector<AttentionTask>& block, const int64_t* q_ids,
                                             const int64_t* k_ids, int64_t batch, int64_t seq) {
  std::vector<AttentionTask> tasks;
  for (const auto& task : block) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t* q_row = q_ids + b * seq;
      const int64_t* k_row = k_ids + b * seq;
      std::unordered_map<int64_t, std::vector<Run>> key_runs;
      for (const auto& run : document_runs(k_row, task.kv_start, task.kv_len)) key_runs[run.id].push_back(run);
      for (const auto& q : document_runs(q_row, task.q_start, task.q_len)) {
        const auto found = key_runs.find(q.id);
        if (found == key_runs.end()) continue;
        for (const auto& k : found->second) {
          if (task.causal) {
            if (k.start > q.start) continue;  // later keys (distinct runs never overlap)
            const bool diagonal = k.start == q.start;
            tasks.push_back({b, q.start, q.len, k.start, diagonal ? q.len : k.len, diagonal});
          } else {
            tasks.push_back({b, q.start, q.len, k.start, k.len, false});
          }
        }
      }
    }
  }
  return tasks;
}

std::vector<int64_t> shard_ids(const int64_t* ids, int64_t batch, int64_t total_seq, int ranks, int rank,
                               bool zigzag) {
  const int64_t seq = total_seq / ranks;
  std::vector<int64_t> shard(batch * seq);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* row = ids + b * total_seq;
    int64_t* out = shard.data() + b * seq;
    if (!zigzag) {
      std::copy(row + rank * seq, row + (rank + 1) * seq, out);
      continue;
    }
    const int64_t half = seq / 2;
    std::copy(row + rank * half, row + (rank + 1) * half, out);
    const int64_t mirror = 2 * ranks - 1 - rank;
    std::copy(row + mirror * half, row + (mirror + 1) * half, out + half);
  }
  return shard;
}

std::vector<int64_t> ring_attention_work(const int64_t* ids, int64_t batch, int64_t total_seq, int ranks,
                                         bool zigzag, bool causal) {
  const int64_t seq = total_seq / ranks;
  std::vector<std::vector<int64_t>> shards;
  if (ids != nullptr) {
    for (int r = 0; r < ranks; ++r) shards.push_back(shard_ids(ids, batch, total_seq, ranks, r, zigzag));
  }
  std::vector<int64_t> work(static_cast<size_t>(ranks) * ranks, 0);
  for (int r = 0; r < ranks; ++r) {
    for (int s = 0; s < ranks; ++s) {
      auto tasks = plan_ring_block(causal, zigzag, r, s, seq);
      if (ids != nullptr) tasks = split_by_document(tasks, shards[r].data(), shards[s].data(), batch, seq);
      int64_t& total = work[static_cast<size_t>(r) * ranks + s];
      for (const auto& task : tasks) total += task.scores() * (task.batch < 0 ? batch : 1);
    }
  }
  return work;
}

}  // namespace tdx::ops
