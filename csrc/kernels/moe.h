#pragma once
// Mixture-of-experts token permutation: the kernel table and argument layouts
// shared by the host (csrc/ops/moe.cpp), the CPU kernels (kernels/cpu/moe.cpp)
// and the CUDA kernels (kernels/cuda/moe.cu).
//
// A rank holds `rows` received tokens, each with `top_k` slots naming a local
// expert (0 <= e < num_experts) or none (-1). The expert-major order puts the
// slots of expert 0 first, then expert 1, ..., each expert's slots in
// increasing slot order (slot = row * top_k + j), so the order is the same on
// every device and run. Expert e's segment starts at the sum of the earlier
// experts' counts (dropless), or at e * capacity (capacity mode, the segment
// padded with zero rows).

#include <cstdint>

#include "kernels/cpu/isa.h"
#include "kernels/dtype.h"
#include "kernels/launch.h"

namespace tdx::kernels {

// positions[slot] = the slot's row in expert-major order (-1 for no expert, or
// past the expert's capacity). Work items: experts.
struct SortSlotsArgs {
  const int64_t* experts;  // [rows, top_k]
  int64_t rows;
  int64_t top_k;
  int64_t num_experts;
  int64_t capacity;       // rows reserved per expert; -1: dropless (segments packed by `starts`)
  const int64_t* starts;  // [num_experts] each segment's first row (dropless; unused with a capacity)
  int64_t* positions;     // [rows, top_k]
};

// Rows of `rows` x `dim` elements of `type`. Weights (nullptr: all 1) are in the
// accumulator type of `type`, [rows, top_k], one per slot.
struct SlotRows {
  ElementType type;
  int64_t rows;
  int64_t top_k;
  int64_t dim;
  const int64_t* positions;  // [rows, top_k] from sort_slots
  const void* weights;       // [rows, top_k] or nullptr
};

// sorted[positions[r, j]] = weights[r, j] * x[r] for every slot with a position;
// the caller zeroes `sorted` first (padding rows stay 0). Work items: rows.
struct ScatterRowsArgs {
  SlotRows slots;
  const void* x;  // [rows, dim]
  void* sorted;   // [sorted rows, dim]
};

// y[r] = sum over j = 0..top_k-1 of weights[r, j] * sorted[positions[r, j]], in the
// accumulator type, in that order (0 for a row without slots). Work items: rows.
struct GatherSumRowsArgs {
  SlotRows slots;
  const void* sorted;  // [sorted rows, dim]
  void* y;             // [rows, dim]
};

// dots[r, j] = <g[r], sorted[positions[r, j]]> in the accumulator type (0 without a
// position): the gradient of a slot's weight. Work items: rows.
struct SlotDotsArgs {
  SlotRows slots;
  const void* g;       // [rows, dim]
  const void* sorted;  // [sorted rows, dim]
  void* dots;          // [rows, top_k] accumulator type
};

struct MoeKernels {
  void (*sort_slots)(const SortSlotsArgs&, const Launch&);
  void (*scatter_rows)(const ScatterRowsArgs&, const Launch&);
  void (*gather_sum_rows)(const GatherSumRowsArgs&, const Launch&);
  void (*slot_dots)(const SlotDotsArgs&, const Launch&);

  static const MoeKernels& cpu(CpuIsa isa);  // kernels/cpu/moe.cpp
  static const MoeKernels& cuda();           // kernels/cuda/moe.cu (CUDA builds)
};

}  // namespace tdx::kernels
