#pragma once
// The checks every implementation of a kernel table entry must pass: the CPU
// clones (test_cross_entropy.cpp, test_attention.cpp, once per ISA) and the
// CUDA kernels (cuda_emulation/test_cuda_kernels.cpp, on the CPU stand-in of the
// CUDA runtime). Each compares a kernel with a direct double-precision
// computation on the same stored inputs, within the bounds of error_bounds.h:
// every element type, row lengths around the CPU blocks and the GPU's warps and
// thread blocks, targets in and out of the shard, ignored, masked and NaN rows,
// in-place gradients, strided merges with padding left untouched.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "error_bounds.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/fp8.h"
#include "kernels/init.h"
#include "kernels/moe.h"

namespace tdx::test {

using kernels::ElementType;

inline constexpr ElementType kAllTypes[] = {ElementType::kFloat32, ElementType::kFloat64, ElementType::kBFloat16,
                                            ElementType::kFloat16};

inline const char* type_name(ElementType type) {
  switch (type) {
    case ElementType::kFloat32: return "fp32";
    case ElementType::kFloat64: return "fp64";
    case ElementType::kBFloat16: return "bf16";
    case ElementType::kFloat16: return "fp16";
  }
  return "?";
}

// Values stored in one element type, readable back as double.
class Elements {
 public:
  Elements(ElementType type, const std::vector<double>& values) : type_(type), bytes_(values.size() * size()) {
    for (size_t i = 0; i < values.size(); ++i) set(i, values[i]);
  }

  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  size_t count() const { return bytes_.size() / size(); }
  size_t element_size() const { return size(); }
  bool operator==(const Elements& other) const { return bytes_ == other.bytes_; }

  double get(size_t i) const {
    switch (type_) {
      case ElementType::kFloat32: return as<float>()[i];
      case ElementType::kFloat64: return as<double>()[i];
      case ElementType::kBFloat16: return kernels::load(as<kernels::BFloat16>()[i]);
      case ElementType::kFloat16: return kernels::load(as<kernels::Float16>()[i]);
    }
    return NAN;
  }

  std::vector<double> values(size_t begin, size_t end) const {
    std::vector<double> out;
    for (size_t i = begin; i < end; ++i) out.push_back(get(i));
    return out;
  }

 private:
  size_t size() const { return type_ == ElementType::kFloat64 ? 8 : type_ == ElementType::kFloat32 ? 4 : 2; }

  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(bytes_.data());
  }

  void set(size_t i, double v) {
    void* p = bytes_.data() + i * size();
    switch (type_) {
      case ElementType::kFloat32: *static_cast<float*>(p) = static_cast<float>(v); break;
      case ElementType::kFloat64: *static_cast<double*>(p) = v; break;
      case ElementType::kBFloat16:
        *static_cast<kernels::BFloat16*>(p) = kernels::to_bfloat16(static_cast<float>(v));
        break;
      case ElementType::kFloat16: *static_cast<kernels::Float16*>(p) = kernels::to_float16(static_cast<float>(v)); break;
    }
  }

  ElementType type_;
  std::vector<unsigned char> bytes_;
};

// Equal as floating-point values within `tolerance` (absolute): NaN matches NaN, an infinity only itself.
inline ::testing::AssertionResult close(double actual, double expected, double tolerance) {
  const bool ok = std::isnan(expected)   ? std::isnan(actual)
                  : std::isinf(expected) ? actual == expected
                                         : std::abs(actual - expected) <= tolerance;
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << actual << " vs " << expected << " (bound " << tolerance << ")";
}

inline std::vector<double> normal_values(size_t n, double stddev, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<double> values(n);
  for (double& v : values) v = normal(gen);
  return values;
}

// Logits of one vocab shard: rows of random values with, past row 3, a fully
// masked row (-inf), a row masked but for its last column, a row with a NaN,
// and a row that rises along the vocabulary (every column raises the maximum).
struct Shard {
  static constexpr int64_t kRows = 8;
  static constexpr int64_t kIgnore = -100;
  int64_t vocab_local;
  int64_t vocab_start;
  std::vector<double> logits;
  std::vector<int64_t> target;

  explicit Shard(int64_t vocab)
      : vocab_local(vocab), vocab_start(3 * vocab), logits(normal_values(kRows * vocab, 3.0, 7)) {
    double* masked = &logits[4 * vocab];
    double* masked_but_last = &logits[5 * vocab];
    for (int64_t v = 0; v < vocab; ++v) masked[v] = -INFINITY;
    for (int64_t v = 0; v + 1 < vocab; ++v) masked_but_last[v] = -INFINITY;
    logits[6 * vocab + vocab / 2] = NAN;
    for (int64_t v = 0; v < vocab; ++v) logits[7 * vocab + v] = 0.01 * v;
    const int64_t last = vocab_start + vocab - 1;
    // In the shard, at its first and last column, in another shard, ignored (the masked row too).
    target = {vocab_start + vocab / 3, vocab_start, last, 1, kIgnore, last, kIgnore, vocab_start + vocab / 2};
  }
};

// Row lengths: one element, under a warp, not a multiple of the warp, a GPU
// thread block and one past it, several elements per thread, past a CPU block.
inline const std::vector<int64_t> kVocabSizes = {1, 31, 100, 256, 257, 3001};

// check(Acc{}, type, size) for every element type and size, with the kernels' accumulator type.
template <typename Check>
void for_each_type_and_size(const std::vector<int64_t>& sizes, Check check) {
  for (const int64_t size : sizes) {
    for (const ElementType type : kAllTypes) {
      if (type == ElementType::kFloat64) {
        check(double{}, type, size);
      } else {
        check(float{}, type, size);
      }
    }
  }
}

inline double row_max(const std::vector<double>& row) {
  double m = -INFINITY;
  for (double x : row) m = std::max(m, x);
  return m;
}

// The exact sum of exp(x - max) over the row's finite values (NaN if one is NaN).
inline double row_sumexp(const std::vector<double>& row) {
  const double m = row_max(row);
  double s = 0;
  for (double x : row) {
    if (std::isnan(x)) return NAN;
    if (x != -INFINITY) s += std::exp(x - m);
  }
  return s;
}

// shard_stats over a Shard of `vocab` columns stored as `type`, its terms summed along path(vocab).
template <typename Acc>
void check_shard_stats(const kernels::CrossEntropyKernels& table, SumexpPath (*path)(int64_t), ElementType type,
                       int64_t vocab) {
  SCOPED_TRACE(std::string(type_name(type)) + ", vocab_local " + std::to_string(vocab));
  const Shard shard(vocab);
  const Elements logits(type, shard.logits);
  const int64_t rows = Shard::kRows;
  std::vector<Acc> stats(3 * rows, Acc(-7));
  const kernels::ShardStatsArgs args{{type, rows, vocab, shard.vocab_start}, logits.data(), shard.target.data(),
                                     stats.data()};
  table.shard_stats(args, kernels::Launch{0, rows, nullptr});
  for (int64_t r = 0; r < rows; ++r) {
    const auto row = logits.values(r * vocab, (r + 1) * vocab);
    if (r != 6) {  // a NaN logit may or may not become the row's maximum, by the order of comparisons
      EXPECT_EQ(stats[r], row_max(row)) << "max, row " << r;
    }
    EXPECT_TRUE(close(stats[rows + r], row_sumexp(row), sumexp_bound<Acc>(row, path(vocab)))) << "sumexp, row " << r;
    const int64_t local = shard.target[r] - shard.vocab_start;
    EXPECT_EQ(stats[2 * rows + r], local >= 0 && local < vocab ? row[local] : 0.0) << "target logit, row " << r;
  }
  EXPECT_EQ(stats[4], -INFINITY);  // fully masked: the sum is 0, the row's lse -inf
  EXPECT_EQ(stats[rows + 4], 0);
  EXPECT_EQ(stats[rows + 5], 1);  // one finite logit
  EXPECT_TRUE(std::isnan(stats[rows + 6])) << "a NaN logit reaches the sum";

  // A launch over rows [2, 5) writes those rows only.
  std::vector<Acc> part(3 * rows, Acc(-7));
  table.shard_stats({args.shard, args.logits, args.target, part.data()}, kernels::Launch{2, 5, nullptr});
  for (int64_t s = 0; s < 3; ++s) {
    for (int64_t r = 0; r < rows; ++r) {
      if (r >= 2 && r < 5) {
        EXPECT_TRUE(close(part[s * rows + r], stats[s * rows + r], 0)) << "stat " << s << ", row " << r;
      } else {
        EXPECT_EQ(part[s * rows + r], Acc(-7)) << "stat " << s << ", row " << r << " is outside the launch";
      }
    }
  }
}

// shard_grad over a Shard stored as `type`, with the exact lse of its rows rounded to Acc.
template <typename Acc>
void check_shard_grad(const kernels::CrossEntropyKernels& table, ElementType type, int64_t vocab) {
  SCOPED_TRACE(std::string(type_name(type)) + ", vocab_local " + std::to_string(vocab));
  const Shard shard(vocab);
  const int64_t rows = Shard::kRows;
  const Elements logits(type, shard.logits);
  std::vector<double> upstream_values(rows);
  for (int64_t r = 0; r < rows; ++r) upstream_values[r] = 0.25 * (r + 1);
  const Elements upstream(type, upstream_values);
  std::vector<Acc> lse(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const auto row = logits.values(r * vocab, (r + 1) * vocab);
    lse[r] = static_cast<Acc>(row_max(row) + std::log(row_sumexp(row)));
  }
  const std::vector<double> zeros(logits.count(), 0.0);
  Elements grad(type, zeros);
  const kernels::VocabShard layout{type, rows, vocab, shard.vocab_start};
  table.shard_grad({layout, upstream.data(), logits.data(), shard.target.data(), lse.data(), Shard::kIgnore,
                    grad.data()},
                   kernels::Launch{0, rows, nullptr});
  for (int64_t r = 0; r < rows; ++r) {
    const double g = upstream.get(r);
    for (int64_t v = 0; v < vocab; ++v) {
      const size_t i = r * vocab + v;
      if (shard.target[r] == Shard::kIgnore) {
        EXPECT_EQ(grad.get(i), 0.0) << "ignored row " << r << ", column " << v;
        continue;
      }
      const double x = logits.get(i), onehot = shard.vocab_start + v == shard.target[r] ? 1.0 : 0.0;
      const double expected = g * (std::exp(x - lse[r]) - onehot);
      EXPECT_TRUE(close(grad.get(i), expected, grad_bound<Acc>(g, x, lse[r], onehot, type)))
          << "row " << r << ", column " << v;
    }
  }
  Elements in_place = logits;
  table.shard_grad({layout, upstream.data(), in_place.data(), shard.target.data(), lse.data(), Shard::kIgnore,
                    in_place.data()},
                   kernels::Launch{0, rows, nullptr});
  EXPECT_TRUE(in_place == grad) << "in place differs from out of place";
}

// Three partial results merged one after another into an empty accumulator
// (lse -inf): `groups` groups of `rows` query rows of `dim` features, the
// accumulator and the blocks with padding between groups, some block rows
// without visible keys (lse -inf).
template <typename Acc>
void check_lse_merges(const kernels::AttentionKernels& table, ElementType block_type, int64_t dim) {
  SCOPED_TRACE(std::string(type_name(block_type)) + ", dim " + std::to_string(dim));
  constexpr int64_t groups = 3, rows = 4, padding = 5;
  const int64_t out_stride = rows * dim + padding, lse_stride = rows + 1;
  std::vector<Acc> out(groups * out_stride, Acc(0)), lse(groups * lse_stride, -INFINITY);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t p = 0; p < padding; ++p) out[g * out_stride + rows * dim + p] = Acc(99);
  }
  MergeReference reference(groups * rows, dim);
  for (unsigned block = 0; block < 3; ++block) {
    const Elements block_out(block_type, normal_values(groups * out_stride, 1.0, 10 + block));
    std::vector<Acc> block_lse(groups * lse_stride);
    const std::vector<double> lse_values = normal_values(block_lse.size(), 2.0, 20 + block);
    for (size_t i = 0; i < block_lse.size(); ++i) {
      block_lse[i] = (i + block) % 3 == 0 ? -INFINITY : static_cast<Acc>(lse_values[i]);
    }
    const kernels::MergeShape shape{block_type, groups, rows, dim, out_stride, lse_stride, out_stride, lse_stride};
    table.lse_merge({shape, out.data(), lse.data(), block_out.data(), block_lse.data()},
                    kernels::Launch{0, groups, nullptr});
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t i = 0; i < rows; ++i) {
        const auto values = block_out.values(g * out_stride + i * dim, g * out_stride + (i + 1) * dim);
        reference.merge<Acc>(g * rows + i, values.data(), block_lse[g * lse_stride + i]);
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = g * rows + i;
      EXPECT_TRUE(close(lse[g * lse_stride + i], reference.lse[r], reference.lse_error[r])) << "lse, row " << r;
      for (int64_t d = 0; d < dim; ++d) {
        EXPECT_TRUE(close(out[g * out_stride + i * dim + d], reference.out[r * dim + d],
                          reference.out_error[r * dim + d]))
            << "row " << r << ", feature " << d;
      }
    }
    for (int64_t p = 0; p < padding; ++p) EXPECT_EQ(out[g * out_stride + rows * dim + p], Acc(99)) << "padding";
    EXPECT_EQ(lse[g * lse_stride + rows], -INFINITY) << "lse padding";
  }
}

// The MoE permutation kernels: `rows` received rows with top_k slots over `experts` local experts (the
// last expert gets no slot; -1 slots are blank), sorted expert-major dropless or with a capacity that
// one expert overflows; rows scattered there (with and without weights), gathered back weighted, and
// the weights' gradients. Positions are exact; values within one product and one sum per slot
// (error_bounds.h's model) plus the element type's rounding.
template <typename Acc>
void check_moe_permutation(const kernels::MoeKernels& table, ElementType type, int64_t dim) {
  SCOPED_TRACE(std::string(type_name(type)) + ", dim " + std::to_string(dim));
  constexpr int64_t rows = 131, top_k = 3, experts = 5;  // 393 slots: past one GPU sort block of 256
  std::mt19937 gen(13);
  std::uniform_int_distribution<int64_t> pick(-1, experts - 2);  // expert experts-1 stays idle
  std::vector<int64_t> ids(rows * top_k);
  for (auto& id : ids) id = pick(gen);
  ids[7] = experts;  // out of range (index checks off): the slot is poisoned
  ids[20] = -4;
  const auto invalid = [](int64_t id) { return id < -1 || id >= experts; };
  std::vector<int64_t> counts(experts, 0);
  for (const int64_t id : ids) {
    if (id >= 0 && !invalid(id)) ++counts[id];
  }
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  for (const int64_t capacity : {int64_t{-1}, most - 2}) {
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    std::vector<int64_t> starts(experts, 0), ends(experts, 0);  // dropless: expert 1's segment one row short
    for (int64_t e = 0; e < experts; ++e) {
      ends[e] = starts[e] + counts[e] - (e == 1);
      if (e + 1 < experts) starts[e + 1] = ends[e];
    }
    const int64_t sorted_rows = capacity >= 0 ? experts * capacity : ends[experts - 1];
    const Elements x(type, normal_values(rows * dim, 1.0, 21));
    const std::vector<double> stale(sorted_rows * dim, 9.0);  // what sort_slots must zero where no slot lands
    Elements sorted(type, stale), scaled(type, stale);
    std::vector<int64_t> positions(rows * top_k, -7), scratch(kernels::sort_scratch_size(rows * top_k, experts), -7);
    std::vector<int32_t> segment_ends(experts, -7);
    for (Elements* buffer : {&sorted, &scaled}) {
      table.sort_slots({ids.data(), rows, top_k, experts, capacity, starts.data(), ends.data(), positions.data(),
                        buffer->data(), static_cast<int64_t>(x.element_size()) * dim, scratch.data(),
                        segment_ends.data()},
                       kernels::Launch{0, experts, nullptr});
    }
    for (int64_t e = 0; e < experts; ++e) {
      EXPECT_EQ(segment_ends[e], capacity >= 0 ? (e + 1) * capacity : ends[e]) << "expert " << e;
    }
    std::vector<int64_t> taken(experts, 0);
    for (int64_t slot = 0; slot < rows * top_k; ++slot) {  // the expected order: slot order within an expert
      const int64_t e = ids[slot];
      int64_t want = invalid(e) ? kernels::kInvalidSlot : -1;
      if (e >= 0 && !invalid(e)) {
        const int64_t rank = taken[e]++;
        const int64_t first = capacity >= 0 ? e * capacity : starts[e];
        const int64_t end = capacity >= 0 ? first + capacity : ends[e];
        if (first + rank < end) want = first + rank;
      }
      EXPECT_EQ(positions[slot], want) << "slot " << slot;
    }
    const Elements g(type, normal_values(rows * dim, 1.0, 22));
    std::vector<double> weight_values = normal_values(rows * top_k, 1.0, 23);
    std::vector<Acc> weights(weight_values.begin(), weight_values.end());
    const kernels::SlotRows plain{type, rows, top_k, dim, positions.data(), nullptr};
    const kernels::SlotRows weighted{type, rows, top_k, dim, positions.data(), weights.data()};
    table.scatter_rows({plain, x.data(), sorted.data()}, kernels::Launch{0, rows, nullptr});
    table.scatter_rows({weighted, x.data(), scaled.data()}, kernels::Launch{0, rows, nullptr});
    const double u = unit_roundoff<Acc>(), rounding = store_roundoff(type);
    std::vector<bool> used(sorted_rows, false);
    for (int64_t slot = 0; slot < rows * top_k; ++slot) {
      if (positions[slot] < 0) continue;
      used[positions[slot]] = true;
      for (int64_t d = 0; d < dim; ++d) {
        const double value = x.get((slot / top_k) * dim + d), w = weights[slot];
        EXPECT_EQ(sorted.get(positions[slot] * dim + d), value) << "slot " << slot;
        EXPECT_TRUE(close(scaled.get(positions[slot] * dim + d), w * value,
                          (u + rounding) * std::abs(w * value) + store_underflow(type)))
            << "weighted, slot " << slot;
      }
    }
    for (int64_t row = 0; row < sorted_rows; ++row) {
      if (used[row]) continue;
      for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(sorted.get(row * dim + d), 0.0) << "padding row " << row;
    }
    // Back: y[r] = sum_j w[r, j] sorted[pos(r, j)], and the weights' gradients <g[r], sorted[pos(r, j)]>.
    Elements y(type, std::vector<double>(rows * dim, 5.0));
    table.gather_sum_rows({weighted, sorted.data(), y.data()}, kernels::Launch{0, rows, nullptr});
    std::vector<Acc> dots(rows * top_k, Acc(-9));
    table.slot_dots({weighted, g.data(), sorted.data(), dots.data()}, kernels::Launch{0, rows, nullptr});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t d = 0; d < dim; ++d) {
        double want = 0, magnitude = 0;
        for (int64_t j = 0; j < top_k; ++j) {
          if (positions[r * top_k + j] == kernels::kInvalidSlot) want = NAN;
          if (positions[r * top_k + j] < 0) continue;
          const double term = weights[r * top_k + j] * x.get(r * dim + d);
          want += term;
          magnitude += std::abs(term);
        }
        EXPECT_TRUE(close(y.get(r * dim + d), want, 2 * top_k * u * magnitude * (1 + rounding) +
                                                        rounding * std::abs(want) + store_underflow(type)))
            << "row " << r << ", feature " << d;
      }
      for (int64_t j = 0; j < top_k; ++j) {
        double want = 0, magnitude = 0;
        if (positions[r * top_k + j] >= 0) {
          for (int64_t d = 0; d < dim; ++d) {
            const double term = g.get(r * dim + d) * x.get(r * dim + d);
            want += term;
            magnitude += std::abs(term);
          }
        }
        if (positions[r * top_k + j] == kernels::kInvalidSlot) want = NAN;
        // A sum of dim products: each product and add rounds (the GPU's tree adds as many levels as the CPU's chain).
        EXPECT_TRUE(close(dots[r * top_k + j], want, 2 * (dim + 1) * u * magnitude)) << "dot, row " << r << ", slot " << j;
      }
    }
  }
}

// The exchange of moe_dispatch/moe_combine: route_tokens numbers each rank's tokens in token order from
// its block's first row (past the block's end: -1), pack_rows copies a token to its rows with the slots
// re-addressed to the rank's experts, sum_rows adds a token's rows back in rank order and picks each
// slot's weight from the row on its expert's rank.
template <typename Acc>
void check_moe_exchange(const kernels::MoeKernels& table, ElementType type, int64_t dim) {
  SCOPED_TRACE(std::string(type_name(type)) + ", dim " + std::to_string(dim));
  constexpr int64_t tokens = 300, top_k = 3, ranks = 3, experts_per_rank = 2;  // past one GPU block of 256
  std::mt19937 gen(17);
  std::uniform_int_distribution<int64_t> pick(-1, ranks * experts_per_rank - 1);
  std::vector<int64_t> ids(tokens * top_k);
  for (auto& id : ids) id = pick(gen);
  ids[5 * top_k + 1] = ranks * experts_per_rank;  // out of range (index checks off): the token comes back NaN
  ids[9 * top_k] = -3;
  const auto invalid = [](int64_t id) { return id < -1 || id >= ranks * experts_per_rank; };
  const auto rank_of = [](int64_t expert) { return expert >= 0 ? expert / experts_per_rank : -1; };
  const auto goes_to = [&](int64_t t, int64_t r) {
    for (int64_t j = 0; j < top_k; ++j) {
      if (rank_of(ids[t * top_k + j]) == r) return true;
    }
    return false;
  };
  std::vector<int64_t> wanted(ranks, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t r = 0; r < ranks; ++r) wanted[r] += goes_to(t, r);
  }
  for (const int64_t short_by : {int64_t{0}, int64_t{5}}) {  // every token sent; each block 5 rows short
    SCOPED_TRACE("blocks short by " + std::to_string(short_by));
    std::vector<int64_t> starts(ranks), ends(ranks);
    for (int64_t r = 0, first = 0; r < ranks; ++r) {
      starts[r] = first;
      ends[r] = first + wanted[r] - short_by;
      first = ends[r] + 2;  // two padding rows after each block
    }
    const int64_t send_rows = ends[ranks - 1] + 2;
    std::vector<int64_t> routed(tokens * ranks, -7);
    table.route_tokens({ids.data(), tokens, top_k, ranks, experts_per_rank, starts.data(), ends.data(),
                        routed.data()},
                       kernels::Launch{0, ranks, nullptr});
    std::vector<int64_t> next = starts;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t r = 0; r < ranks; ++r) {
        const int64_t want = !goes_to(t, r) ? -1 : next[r] < ends[r] ? next[r]++ : kernels::kOverflowRow;
        EXPECT_EQ(routed[t * ranks + r], want) << "token " << t << ", rank " << r;
      }
    }
    const kernels::ExchangeRows exchange{type, tokens, top_k, dim, ranks, experts_per_rank, ids.data(),
                                         routed.data()};
    const Elements x(type, normal_values(tokens * dim, 1.0, 31));
    const std::vector<double> weight_values = normal_values(tokens * top_k, 1.0, 32);
    const std::vector<Acc> weights(weight_values.begin(), weight_values.end());
    Elements rows(type, std::vector<double>(send_rows * dim, 3.0));
    std::vector<int64_t> local(send_rows * top_k, -7);
    std::vector<Acc> row_weights(send_rows * top_k, Acc(-7));
    table.pack_rows({exchange, x.data(), weights.data(), rows.data(), local.data(), row_weights.data()},
                    kernels::Launch{0, tokens, nullptr});
    std::vector<bool> used(send_rows, false);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t r = 0; r < ranks; ++r) {
        const int64_t row = routed[t * ranks + r];
        if (row < 0) continue;
        used[row] = true;
        for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(rows.get(row * dim + d), x.get(t * dim + d)) << "row " << row;
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t expert = ids[t * top_k + j];
          const bool here = rank_of(expert) == r;
          EXPECT_EQ(local[row * top_k + j], here ? expert - r * experts_per_rank : -1) << "row " << row;
          EXPECT_EQ(row_weights[row * top_k + j], here ? weights[t * top_k + j] : Acc(0)) << "row " << row;
        }
      }
    }
    for (int64_t row = 0; row < send_rows; ++row) {
      if (used[row]) continue;
      EXPECT_EQ(local[row * top_k], -7) << "row " << row << " sends no token and stays untouched";
      for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(rows.get(row * dim + d), 3.0) << "row " << row;
    }
    // Back: other rows (the experts' outputs) summed per token in rank order.
    const Elements back(type, normal_values(send_rows * dim, 1.0, 33));
    const std::vector<double> back_weight_values = normal_values(send_rows * top_k, 1.0, 34);
    const std::vector<Acc> back_weights(back_weight_values.begin(), back_weight_values.end());
    Elements out(type, std::vector<double>(tokens * dim, 5.0));
    std::vector<Acc> out_weights(tokens * top_k, Acc(-9));
    table.sum_rows({exchange, back.data(), back_weights.data(), out.data(), out_weights.data()},
                   kernels::Launch{0, tokens, nullptr});
    const double u = unit_roundoff<Acc>(), rounding = store_roundoff(type);
    for (int64_t t = 0; t < tokens; ++t) {
      bool poisoned = false;  // an expert id out of range, or a token its rank's full block could not take
      for (int64_t j = 0; j < top_k; ++j) poisoned |= invalid(ids[t * top_k + j]);
      for (int64_t r = 0; r < ranks; ++r) poisoned |= routed[t * ranks + r] == kernels::kOverflowRow;
      for (int64_t d = 0; d < dim; ++d) {
        double want = poisoned ? NAN : 0, magnitude = 0;
        for (int64_t r = 0; r < ranks; ++r) {
          const int64_t row = routed[t * ranks + r];
          if (row < 0) continue;
          want += back.get(row * dim + d);
          magnitude += std::abs(back.get(row * dim + d));
        }
        // ranks - 1 additions in the accumulator, then one store.
        EXPECT_TRUE(close(out.get(t * dim + d), want, (ranks - 1) * u * magnitude * (1 + rounding) +
                                                        rounding * std::abs(want) + store_underflow(type)))
            << "token " << t << ", feature " << d;
      }
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t r = rank_of(ids[t * top_k + j]);
        const int64_t row = r >= 0 && !invalid(ids[t * top_k + j]) ? routed[t * ranks + r] : -1;
        const bool nan = invalid(ids[t * top_k + j]) || row == kernels::kOverflowRow;
        const double want = nan ? NAN : row >= 0 ? back_weights[row * top_k + j] : 0;
        EXPECT_TRUE(close(out_weights[t * top_k + j], want, 0)) << "token " << t << ", slot " << j;
      }
    }
  }
}

// The value of an fp8 byte (NaN for NaN codes), decoded from the format's definition.
inline double fp8_value(uint8_t byte, kernels::Fp8Format format) {
  const bool e4m3 = format == kernels::Fp8Format::kE4M3;
  const int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int exponent = (byte & 0x7f) >> mantissa_bits, mantissa = byte & ((1 << mantissa_bits) - 1);
  const double sign = byte & 0x80 ? -1.0 : 1.0;
  if (e4m3 && (byte & 0x7f) == 0x7f) return NAN;
  if (!e4m3 && exponent == 31) return mantissa ? NAN : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);
  return sign * std::ldexp((1 << mantissa_bits) + mantissa, exponent - bias - mantissa_bits);
}

// The fp8 value an element x must become: NaN for inf and NaN, else the nearest finite value to the fp32
// product x * scale after saturating it (an overflowing product too) to the largest one, ties to the code
// with an even mantissa (found by trying all 256).
inline double expected_fp8(float x, float scale, kernels::Fp8Format format) {
  if (!std::isfinite(x)) return NAN;
  const double limit = format == kernels::Fp8Format::kE4M3 ? 448.0 : 57344.0;
  const double v = std::min(std::max(static_cast<double>(x * scale), -limit), limit);
  int best = -1;
  for (int code = 0; code < 256; ++code) {
    const double candidate = fp8_value(static_cast<uint8_t>(code), format);
    if (!std::isfinite(candidate)) continue;
    if (best < 0) {
      best = code;
      continue;
    }
    const double gap = std::abs(candidate - v), best_gap = std::abs(fp8_value(static_cast<uint8_t>(best), format) - v);
    if (gap < best_gap || (gap == best_gap && (code & 1) == 0 && (best & 1) == 1)) best = code;
  }
  return fp8_value(static_cast<uint8_t>(best), format);
}

// cast_amax: every byte the nearest fp8 value of x * scale (saturated; inf and NaN to NaN), and each
// chunk's amax the largest |x| (NaN with a NaN). Inputs: normal values at several magnitudes, values in
// the fp8 subnormal range, halfway cases, overflow, +-0, +-inf, NaN.
inline void check_fp8_cast_amax(const kernels::Fp8Kernels& table, ElementType type) {
  for (const auto format : {kernels::Fp8Format::kE4M3, kernels::Fp8Format::kE5M2}) {
    SCOPED_TRACE(std::string(type_name(type)) + (format == kernels::Fp8Format::kE4M3 ? ", e4m3" : ", e5m2"));
    std::vector<double> values = normal_values(1000, 1.0, 41);
    for (size_t i = 0; i < values.size(); ++i) values[i] *= std::ldexp(1.0, static_cast<int>(i % 40) - 24);
    for (int code = 0; code < 256; ++code) {  // every fp8 value and the points halfway to its neighbour
      const double v = fp8_value(static_cast<uint8_t>(code), format);
      const double next = fp8_value(static_cast<uint8_t>(code + 1), format);
      if (!std::isfinite(v)) continue;
      values.push_back(v);
      if (std::isfinite(next) && (code & 0x7f) != 0x7f) values.push_back((v + next) / 2);
    }
    for (const double special : {0.0, -0.0, 1e6, -1e6, double(INFINITY), double(-INFINITY)}) values.push_back(special);
    const Elements x(type, values);
    const int64_t count = static_cast<int64_t>(values.size()), chunk = 256;
    const int64_t items = (count + chunk - 1) / chunk;
    for (const float scale : {1.0f, 0.75f, 3.0e3f, 3.0e38f}) {  // the last overflows fp32 for |x| > 1
      SCOPED_TRACE("scale " + std::to_string(scale));
      for (const bool with_nan : {false, true}) {
        Elements input = x;
        if (with_nan) input = Elements(type, [&] { auto v = values; v[300] = NAN; return v; }());
        std::vector<uint8_t> out(count, 0xAA);
        std::vector<float> amax(items, -1.0f);
        table.cast_amax({type, format, count, chunk, input.data(), &scale, out.data(), amax.data()},
                        kernels::Launch{0, items, nullptr});
        for (int64_t i = 0; i < count; ++i) {
          const float stored = static_cast<float>(input.get(i));
          EXPECT_TRUE(close(fp8_value(out[i], format), expected_fp8(stored, scale, format), 0))
              << "element " << i << " = " << stored;
        }
        for (int64_t item = 0; item < items; ++item) {
          double want = 0;
          for (int64_t i = item * chunk; i < std::min(count, (item + 1) * chunk); ++i) {
            const double v = input.get(i);
            want = std::isnan(v) || std::isnan(want) ? NAN : std::max(want, std::abs(v));
          }
          EXPECT_TRUE(close(amax[item], want, 0)) << "chunk " << item;
        }
      }
    }
  }
}

// cast_transpose_amax: out as cast_amax writes it, out_t its transpose with row length ld_t (the columns
// past rows untouched), each tile's amax; shapes with partial tiles, one element, and a padded ld_t.
inline void check_fp8_cast_transpose_amax(const kernels::Fp8Kernels& table, ElementType type) {
  const std::vector<double> pool = [] {
    std::vector<double> v = normal_values(997, 1.0, 43);
    for (size_t i = 0; i < v.size(); ++i) v[i] *= std::ldexp(1.0, static_cast<int>(i % 30) - 15);
    v[11] = 0.0, v[12] = -0.0, v[13] = 1e6, v[14] = INFINITY;
    return v;
  }();
  struct Shape {
    int64_t rows, cols, ld_t;
  };
  for (const auto format : {kernels::Fp8Format::kE4M3, kernels::Fp8Format::kE5M2}) {
    for (const Shape shape : {Shape{1, 1, 1}, Shape{37, 70, 48}, Shape{64, 32, 64}, Shape{5, 100, 16}}) {
      SCOPED_TRACE(std::string(type_name(type)) + (format == kernels::Fp8Format::kE4M3 ? ", e4m3 " : ", e5m2 ") +
                   std::to_string(shape.rows) + "x" + std::to_string(shape.cols) + " ld_t " +
                   std::to_string(shape.ld_t));
      const int64_t count = shape.rows * shape.cols;
      std::vector<double> values(count);
      for (int64_t i = 0; i < count; ++i) values[i] = pool[i % pool.size()];
      for (const bool with_nan : {false, true}) {
        if (with_nan) values[count / 2] = NAN;
        const Elements x(type, values);
        const int64_t tiles_per_row = (shape.cols + kernels::kFp8Tile - 1) / kernels::kFp8Tile;
        const int64_t items = tiles_per_row * ((shape.rows + kernels::kFp8Tile - 1) / kernels::kFp8Tile);
        std::vector<uint8_t> out(count, 0xAA), out_t(shape.cols * shape.ld_t, 0xAA);
        std::vector<float> amax(items, -1.0f);
        const float scale = 0.75f;
        table.cast_transpose_amax({type, format, shape.rows, shape.cols, shape.ld_t, x.data(), &scale, out.data(),
                                   out_t.data(), amax.data()},
                                  kernels::Launch{0, items, nullptr});
        std::vector<double> want_amax(items, 0.0);
        for (int64_t r = 0; r < shape.rows; ++r) {
          for (int64_t c = 0; c < shape.cols; ++c) {
            const float stored = static_cast<float>(x.get(r * shape.cols + c));
            EXPECT_TRUE(close(fp8_value(out[r * shape.cols + c], format), expected_fp8(stored, scale, format), 0))
                << "element (" << r << ", " << c << ") = " << stored;
            EXPECT_EQ(out_t[c * shape.ld_t + r], out[r * shape.cols + c]) << "transposed (" << c << ", " << r << ")";
            double& want = want_amax[(r / kernels::kFp8Tile) * tiles_per_row + c / kernels::kFp8Tile];
            want = std::isnan(stored) || std::isnan(want) ? NAN : std::max(want, std::abs(double(stored)));
          }
        }
        for (int64_t c = 0; c < shape.cols; ++c) {
          for (int64_t r = shape.rows; r < shape.ld_t; ++r) EXPECT_EQ(out_t[c * shape.ld_t + r], 0xAA) << "padding";
        }
        for (int64_t item = 0; item < items; ++item) EXPECT_TRUE(close(amax[item], want_amax[item], 0)) << item;
      }
    }
  }
}

// cast_blockwise: each block's scale from its own amax (fp8_max / max(amax, eps), 1 where the amax is not
// finite, a power of two with power_of_2), every element to its nearest fp8 value under it, the inverse
// scales; rowwise, columnwise, 1 x 128 and 128 x 128 blocks with partial edges, an all-zero block, a NaN.
inline void check_fp8_cast_blockwise(const kernels::Fp8Kernels& table, ElementType type) {
  struct Case {
    int64_t rows, cols, block_rows, block_cols;
  };
  for (const auto format : {kernels::Fp8Format::kE4M3, kernels::Fp8Format::kE5M2}) {
    for (const Case shape : {Case{37, 300, 1, 128}, Case{150, 260, 128, 128}, Case{5, 70, 1, 70},
                             Case{40, 9, 40, 1}, Case{1, 1, 1, 1}}) {
      for (const bool power_of_2 : {false, true}) {
        SCOPED_TRACE(std::string(type_name(type)) + (format == kernels::Fp8Format::kE4M3 ? ", e4m3 " : ", e5m2 ") +
                     std::to_string(shape.rows) + "x" + std::to_string(shape.cols) + " blocks " +
                     std::to_string(shape.block_rows) + "x" + std::to_string(shape.block_cols) +
                     (power_of_2 ? " pow2" : ""));
        const int64_t count = shape.rows * shape.cols;
        std::vector<double> values = normal_values(static_cast<size_t>(count), 1.0, 47);
        for (int64_t i = 0; i < count; ++i) values[i] *= std::ldexp(1.0, static_cast<int>((i / 7) % 30) - 15);
        for (int64_t c = 0; c < std::min<int64_t>(shape.cols, shape.block_cols); ++c) values[c] = 0.0;  // block 0
        if (count > 400) values[count - 3] = NAN;
        const Elements x(type, values);
        const int64_t grid_rows = (shape.rows + shape.block_rows - 1) / shape.block_rows;
        const int64_t grid_cols = (shape.cols + shape.block_cols - 1) / shape.block_cols;
        std::vector<uint8_t> out(count, 0xAA);
        std::vector<float> inverse(grid_rows * grid_cols, -1.0f);
        const float eps = 1e-12f;
        table.cast_blockwise({type, format, shape.rows, shape.cols, shape.block_rows, shape.block_cols, eps,
                              power_of_2, x.data(), out.data(), inverse.data()},
                             kernels::Launch{0, grid_rows * grid_cols, nullptr});
        for (int64_t block = 0; block < grid_rows * grid_cols; ++block) {
          const int64_t r0 = (block / grid_cols) * shape.block_rows, c0 = (block % grid_cols) * shape.block_cols;
          const int64_t r1 = std::min(shape.rows, r0 + shape.block_rows), c1 = std::min(shape.cols, c0 + shape.block_cols);
          double amax = 0;
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t c = c0; c < c1; ++c) {
              const double v = x.get(r * shape.cols + c);
              amax = std::isnan(v) || std::isnan(amax) ? NAN : std::max(amax, std::abs(v));
            }
          }
          const float limit = format == kernels::Fp8Format::kE4M3 ? 448.0f : 57344.0f;
          float scale = std::isfinite(amax) ? limit / std::max(static_cast<float>(amax), eps) : 1.0f;
          if (power_of_2 && std::isfinite(amax)) scale = std::ldexp(1.0f, std::ilogb(scale));
          EXPECT_EQ(inverse[block], 1.0f / scale) << "block " << block;
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t c = c0; c < c1; ++c) {
              const int64_t i = r * shape.cols + c;
              EXPECT_TRUE(close(fp8_value(out[i], format), expected_fp8(static_cast<float>(x.get(i)), scale, format), 0))
                  << "element " << r << ", " << c;
            }
          }
        }
      }
    }
  }
}

// trunc_normal: each element of a block is the whole tensor's element at the same position (a function of
// its whole-tensor index alone), within [a, b], stored as the nearest value of the element type; blocks cut
// at any offsets of a 3-D tensor, in every element type, launched in two parts.
inline void check_trunc_normal(const kernels::InitKernels& table, ElementType type) {
  SCOPED_TRACE(type_name(type));
  const int64_t whole[3] = {3, 5, 37};
  const float mean = 0.5f, std = 2.0f, a = -1.0f, b = 3.0f;
  const double low = 0.5 * std::erfc(-((a - mean) / std) / std::sqrt(2.0));
  const double high = 0.5 * std::erfc(-((b - mean) / std) / std::sqrt(2.0));
  const uint64_t stream = kernels::counter_stream(7, 11);
  for (const auto& [offsets, sizes] : std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{
           {{0, 0, 0}, {3, 5, 37}}, {{1, 2, 3}, {2, 3, 33}}, {{2, 4, 36}, {1, 1, 1}}}) {
    kernels::TruncNormalArgs args{};
    args.type = type;
    args.ndim = 3;
    for (int d = 0; d < 3; ++d) args.sizes[d] = sizes[d], args.offsets[d] = offsets[d];
    args.strides[2] = 1, args.strides[1] = whole[2], args.strides[0] = whole[1] * whole[2];
    args.rows = sizes[0] * sizes[1];
    args.cols = sizes[2];
    args.stream = stream;
    args.mean = mean, args.std = std, args.a = a, args.b = b;
    args.low = static_cast<float>(low), args.high = static_cast<float>(high);
    Elements out(type, std::vector<double>(static_cast<size_t>(args.rows * args.cols), 0.0));
    args.out = out.data();
    table.trunc_normal(args, kernels::Launch{0, args.rows / 2, nullptr});
    table.trunc_normal(args, kernels::Launch{args.rows / 2, args.rows, nullptr});
    for (int64_t i = 0; i < sizes[0]; ++i) {
      for (int64_t j = 0; j < sizes[1]; ++j) {
        for (int64_t k = 0; k < sizes[2]; ++k) {
          const int64_t index = (offsets[0] + i) * args.strides[0] + (offsets[1] + j) * args.strides[1] + offsets[2] + k;
          const float value = kernels::counter_trunc_normal(stream, static_cast<uint64_t>(index), mean, std, a, b,
                                                            args.low, args.high);
          const double got = out.get(static_cast<size_t>((i * sizes[1] + j) * sizes[2] + k));
          EXPECT_EQ(got, Elements(type, {value}).get(0)) << i << ", " << j << ", " << k;
          EXPECT_TRUE(got >= a && got <= b) << got;
        }
      }
    }
  }
}

}  // namespace tdx::test
