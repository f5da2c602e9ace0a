// CPU kernels of the MoE token permutation (contracts: kernels/moe.h).

#include "kernels/moe.h"

#include <type_traits>

#include "kernels/cpu/element.h"
#include "kernels/cpu/isa_clones.h"

namespace tdx::kernels {
namespace cpu {
namespace {

void sort_slots(const SortSlotsArgs& args, const Launch& launch) {
  const int64_t slots = args.rows * args.top_k;
  for (int64_t e = launch.begin; e < launch.end; ++e) {
    int64_t next = args.capacity >= 0 ? e * args.capacity : args.starts[e];
    const int64_t end = args.capacity >= 0 ? next + args.capacity : INT64_MAX;
    for (int64_t slot = 0; slot < slots; ++slot) {
      if (args.experts[slot] != e) continue;
      args.positions[slot] = next < end ? next++ : -1;
    }
  }
  // Slots without a local expert belong to no work item: the item of expert 0 marks them.
  if (launch.begin == 0) {
    for (int64_t slot = 0; slot < slots; ++slot) {
      const int64_t e = args.experts[slot];
      if (e < 0 || e >= args.num_experts) args.positions[slot] = -1;
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
        const Acc w = slot_weight<Acc>(s, r * s.top_k + j);
        const T* from = x + r * s.dim;
        T* to = sorted + position * s.dim;
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
        dots[r * s.top_k + j] = dot;
      }
    }
  });
}

}  // namespace
}  // namespace cpu

const MoeKernels& MoeKernels::cpu(CpuIsa isa) {
  return cpu_kernel_table<MoeKernels, &cpu::sort_slots, &cpu::scatter_rows, &cpu::gather_sum_rows,
                          &cpu::slot_dots>(isa);
}

}  // namespace tdx::kernels
