// CPU kernels of the MoE token exchange and permutation (contracts: kernels/moe.h).

#include "kernels/moe.h"

#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/element.h"
#include "kernels/cpu/isa_clones.h"

namespace tdx::kernels {
namespace cpu {
namespace {

// The rank holding expert e, or -1 for no expert.
inline int64_t rank_of(int64_t expert, int64_t experts_per_rank) {
  return expert >= 0 ? expert / experts_per_rank : -1;
}

inline bool out_of_range(int64_t expert, int64_t num_experts) { return expert < -1 || expert >= num_experts; }

bool has_expert_on(const int64_t* experts, int64_t top_k, int64_t experts_per_rank, int64_t rank) {
  for (int64_t j = 0; j < top_k; ++j) {
    if (rank_of(experts[j], experts_per_rank) == rank) return true;
  }
  return false;
}

void route_tokens(const RouteTokensArgs& args, const Launch& launch) {
  for (int64_t r = launch.begin; r < launch.end; ++r) {
    int64_t next = args.starts[r];
    for (int64_t t = 0; t < args.tokens; ++t) {
      const bool sent = has_expert_on(args.experts + t * args.top_k, args.top_k, args.experts_per_rank, r);
      args.send_rows[t * args.ranks + r] = !sent ? -1 : next < args.ends[r] ? next++ : kOverflowRow;
    }
  }
}

void pack_rows(const PackRowsArgs& args, const Launch& launch) {
  const ExchangeRows& e = args.exchange;
  visit_element_type(e.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    const T* x = static_cast<const T*>(args.x);
    const Acc* weights = static_cast<const Acc*>(args.weights);
    T* rows = static_cast<T*>(args.rows);
    Acc* row_weights = static_cast<Acc*>(args.row_weights);
    for (int64_t t = launch.begin; t < launch.end; ++t) {
      for (int64_t r = 0; r < e.ranks; ++r) {
        const int64_t row = e.send_rows[t * e.ranks + r];
        if (row < 0) continue;
        std::memcpy(rows + row * e.dim, x + t * e.dim, e.dim * sizeof(T));
        for (int64_t j = 0; j < e.top_k; ++j) {
          const int64_t expert = e.experts[t * e.top_k + j];
          const bool here = rank_of(expert, e.experts_per_rank) == r;
          args.local_experts[row * e.top_k + j] = here ? expert - r * e.experts_per_rank : -1;
          row_weights[row * e.top_k + j] = here ? weights[t * e.top_k + j] : Acc(0);
        }
      }
    }
  });
}

void sum_rows(const SumRowsArgs& args, const Launch& launch) {
  const ExchangeRows& e = args.exchange;
  visit_element_type(e.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    const T* rows = static_cast<const T*>(args.rows);
    const Acc* row_weights = static_cast<const Acc*>(args.row_weights);
    T* out = static_cast<T*>(args.out);
    Acc* out_weights = static_cast<Acc*>(args.out_weights);
    constexpr int64_t kChunk = 256;  // features summed at a time, in an Acc buffer
    constexpr Acc kNaN = std::numeric_limits<Acc>::quiet_NaN();
    const int64_t num_experts = e.ranks * e.experts_per_rank;
    Acc sum[kChunk];
    for (int64_t t = launch.begin; t < launch.end; ++t) {
      const int64_t* send_rows = e.send_rows + t * e.ranks;
      bool poisoned = false;
      for (int64_t j = 0; j < e.top_k; ++j) poisoned |= out_of_range(e.experts[t * e.top_k + j], num_experts);
      for (int64_t r = 0; r < e.ranks; ++r) poisoned |= send_rows[r] == kOverflowRow;
      for (int64_t begin = 0; begin < e.dim; begin += kChunk) {
        const int64_t n = e.dim - begin < kChunk ? e.dim - begin : kChunk;
        for (int64_t d = 0; d < n; ++d) sum[d] = poisoned ? kNaN : Acc(0);
        for (int64_t r = 0; r < e.ranks; ++r) {
          if (send_rows[r] < 0) continue;
          const T* from = rows + send_rows[r] * e.dim + begin;
          for (int64_t d = 0; d < n; ++d) sum[d] += static_cast<Acc>(load(from[d]));
        }
        for (int64_t d = 0; d < n; ++d) store(out[t * e.dim + begin + d], sum[d]);
      }
      if (row_weights == nullptr) continue;
      for (int64_t j = 0; j < e.top_k; ++j) {
        const int64_t expert = e.experts[t * e.top_k + j];
        const int64_t r = rank_of(expert, e.experts_per_rank);
        const int64_t row = out_of_range(expert, num_experts) || r < 0 ? -1 : send_rows[r];
        out_weights[t * e.top_k + j] =
            out_of_range(expert, num_experts) || row == kOverflowRow ? kNaN
            : row >= 0                                              ? row_weights[row * e.top_k + j]
                                                                    : Acc(0);
      }
    }
  });
}

void sort_slots(const SortSlotsArgs& args, const Launch& launch) {
  const int64_t slots = args.rows * args.top_k;
  // One pass over the slots for this call's experts [launch.begin, launch.end): each expert's next row and end.
  std::vector<int64_t> next(launch.end - launch.begin), end(launch.end - launch.begin);
  for (int64_t e = launch.begin; e < launch.end; ++e) {
    const size_t i = static_cast<size_t>(e - launch.begin);
    next[i] = args.capacity >= 0 ? e * args.capacity : args.starts[e];
    end[i] = args.capacity >= 0 ? next[i] + args.capacity : args.ends[e];
    args.segment_ends[e] = static_cast<int32_t>(end[i]);
  }
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t e = args.experts[slot] - launch.begin;
    if (e < 0 || e >= launch.end - launch.begin) continue;
    args.positions[slot] = next[e] < end[e] ? next[e]++ : -1;
  }
  for (size_t e = 0; e < next.size(); ++e) {
    if (end[e] > next[e]) {
      std::memset(static_cast<char*>(args.sorted) + next[e] * args.row_bytes, 0, (end[e] - next[e]) * args.row_bytes);
    }
  }
  // Slots without a local expert belong to no work item: the item of expert 0 marks them.
  if (launch.begin == 0) {
    for (int64_t slot = 0; slot < slots; ++slot) {
      const int64_t e = args.experts[slot];
      if (out_of_range(e, args.num_experts)) {
        args.positions[slot] = kInvalidSlot;
      } else if (e < 0) {
        args.positions[slot] = -1;
      }
    }
  }
}

template <typename Acc>
Acc slot_weight(const SlotRows& slots, int64_t slot) {
  return slots.weights == nullptr ? Acc(1) : static_cast<const Acc*>(slots.weights)[slot];
}

void scatter_rows(const ScatterRowsArgs& args, const Launch& launch) {
  const SlotRows& s = args.slots;
  visit_element_type(s.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    const T* x = static_cast<const T*>(args.x);
    T* sorted = static_cast<T*>(args.sorted);
    for (int64_t r = launch.begin; r < launch.end; ++r) {
      for (int64_t j = 0; j < s.top_k; ++j) {
        const int64_t position = s.positions[r * s.top_k + j];
        if (position < 0) continue;
        const T* from = x + r * s.dim;
        T* to = sorted + position * s.dim;
        if (s.weights == nullptr) {
          std::memcpy(to, from, s.dim * sizeof(T));
          continue;
        }
        const Acc w = slot_weight<Acc>(s, r * s.top_k + j);
        for (int64_t d = 0; d < s.dim; ++d) store(to[d], w * static_cast<Acc>(load(from[d])));
      }
    }
  });
}

void gather_sum_rows(const GatherSumRowsArgs& args, const Launch& launch) {
  const SlotRows& s = args.slots;
  visit_element_type(s.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    const T* sorted = static_cast<const T*>(args.sorted);
    T* y = static_cast<T*>(args.y);
    constexpr int64_t kChunk = 256;  // features summed at a time, in an Acc buffer
    Acc sum[kChunk];
    for (int64_t r = launch.begin; r < launch.end; ++r) {
      for (int64_t begin = 0; begin < s.dim; begin += kChunk) {
        const int64_t n = s.dim - begin < kChunk ? s.dim - begin : kChunk;
        for (int64_t d = 0; d < n; ++d) sum[d] = 0;
        for (int64_t j = 0; j < s.top_k; ++j) {
          const int64_t position = s.positions[r * s.top_k + j];
          if (position == kInvalidSlot) {
            for (int64_t d = 0; d < n; ++d) sum[d] = std::numeric_limits<Acc>::quiet_NaN();
          }
          if (position < 0) continue;
          const Acc w = slot_weight<Acc>(s, r * s.top_k + j);
          const T* from = sorted + position * s.dim + begin;
          for (int64_t d = 0; d < n; ++d) sum[d] += w * static_cast<Acc>(load(from[d]));
        }
        for (int64_t d = 0; d < n; ++d) store(y[r * s.dim + begin + d], sum[d]);
      }
    }
  });
}

void slot_dots(const SlotDotsArgs& args, const Launch& launch) {
  const SlotRows& s = args.slots;
  visit_element_type(s.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    const T* g = static_cast<const T*>(args.g);
    const T* sorted = static_cast<const T*>(args.sorted);
    Acc* dots = static_cast<Acc*>(args.dots);
    for (int64_t r = launch.begin; r < launch.end; ++r) {
      for (int64_t j = 0; j < s.top_k; ++j) {
        const int64_t position = s.positions[r * s.top_k + j];
        Acc dot = 0;
        if (position >= 0) {
          const T* a = g + r * s.dim;
          const T* b = sorted + position * s.dim;
          for (int64_t d = 0; d < s.dim; ++d) dot += static_cast<Acc>(load(a[d])) * static_cast<Acc>(load(b[d]));
        }
        dots[r * s.top_k + j] = position == kInvalidSlot ? std::numeric_limits<Acc>::quiet_NaN() : dot;
      }
    }
  });
}

}  // namespace
}  // namespace cpu

const MoeKernels& MoeKernels::cpu(CpuIsa isa) {
  return cpu_kernel_table<MoeKernels, &cpu::route_tokens, &cpu::pack_rows, &cpu::sum_rows, &cpu::sort_slots, &cpu::scatter_rows, &cpu::gather_sum_rows,
                          &cpu::slot_dots>(isa);
}

}  // namespace tdx::kernels
