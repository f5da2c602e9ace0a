#include "planner/documents.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "ops/sequence_plan.h"

namespace tdx::planner {
namespace {

constexpr int64_t kSampledTokens = 16384;  // the longest row sampled
constexpr int kRows = 128;  // rows per estimate: the mean spread within ~3 % (its deviation over rows is ~0.3)
constexpr unsigned kSeed = 20261207;

// One row of `seq` tokens: documents of log-normal lengths (at least one token), the last one cut to fit.
std::vector<int64_t> draw_row(std::mt19937_64& gen, int64_t seq, double median, double sigma) {
  std::lognormal_distribution<double> length(std::log(median), sigma);
  std::vector<int64_t> ids(seq);
  int64_t id = 0;
  for (int64_t i = 0; i < seq; ++id) {
    const auto n = std::max<int64_t>(1, std::llround(length(gen)));
    for (const int64_t end = std::min(seq, i + n); i < end; ++i) ids[i] = id;
  }
  return ids;
}

// The ring rank holding position p of a row of `seq` tokens cut contiguously or zigzag over `ranks`.
int64_t rank_of(int64_t p, int64_t seq, int64_t ranks, CpOrder order) {
  if (order == CpOrder::kContiguous) return p / (seq / ranks);
  const int64_t chunk = p / (seq / (2 * ranks));
  return chunk < ranks ? chunk : 2 * ranks - 1 - chunk;
}

std::vector<double> rank_work(const std::vector<int64_t>& ids, int64_t ranks, CpOrder order) {
  const int64_t seq = static_cast<int64_t>(ids.size());
  std::vector<double> work(ranks, 0.0);
  if (order == CpOrder::kBalanced) {
    const auto plan = ops::balanced_row_plan(ids.data(), seq, static_cast<int>(ranks));
    for (int64_t r = 0; r < ranks; ++r) work[r] = static_cast<double>(plan.costs[r]);
    return work;
  }
  const auto token = ops::token_work(ids.data(), seq);
  for (int64_t p = 0; p < seq; ++p) work[rank_of(p, seq, ranks, order)] += static_cast<double>(token[p]);
  return work;
}

AttentionBalance sample(int64_t seq_len, int64_t ranks, CpOrder order, double median, double sigma) {
  // The sampled row: at most kSampledTokens, a multiple of 2 x ranks (zigzag's chunks), lengths scaled alike.
  const int64_t unit = 2 * ranks;
  const int64_t seq = std::max(unit, std::min(seq_len, kSampledTokens) / unit * unit);
  const double scaled_median = median > 0 ? median * static_cast<double>(seq) / static_cast<double>(seq_len) : 0;
  const double one_document = static_cast<double>(seq) * static_cast<double>(seq + 1) / 2;
  std::mt19937_64 gen(kSeed);
  AttentionBalance balance{0.0, 0.0};
  const int rows = scaled_median > 0 ? kRows : 1;
  for (int row = 0; row < rows; ++row) {
    const auto ids = scaled_median > 0 ? draw_row(gen, seq, scaled_median, sigma) : std::vector<int64_t>(seq, 0);
    const auto work = rank_work(ids, ranks, order);
    const double total = std::accumulate(work.begin(), work.end(), 0.0);
    balance.work_share += total / one_document / rows;
    balance.spread += (*std::max_element(work.begin(), work.end()) * static_cast<double>(ranks) / total - 1) / rows;
  }
  return balance;
}

}  // namespace

AttentionBalance attention_balance(int64_t seq_len, int64_t ranks, CpOrder order, double median, double sigma) {
  using Key = std::tuple<int64_t, int64_t, CpOrder, double, double>;
  static std::mutex mutex;
  static std::map<Key, AttentionBalance> cache;
  const Key key{seq_len, ranks, order, median, median > 0 ? sigma : 0.0};
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = cache.find(key);
    if (found != cache.end()) return found->second;
  }
  const AttentionBalance balance = ranks <= 1 && median <= 0 ? AttentionBalance{} : sample(seq_len, ranks, order,
                                                                                            median, sigma);
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, balance);
  return balance;
}

AttentionBalance attention_balance(const Layout& l) {
  return attention_balance(l.seq_len, l.cp / l.cp_ulysses, l.cp_order, l.document_median, l.document_sigma);
}

}  // namespace tdx::planner
