#pragma once
// Mixture-of-experts token exchange and permutation: the kernel table and
// argument layouts shared by the host (csrc/ops/moe.cpp), the CPU kernels
// (kernels/cpu/moe.cpp) and the CUDA kernels (kernels/cuda/moe.cu).
//
// Exchange (moe_dispatch, moe_combine): a rank's `tokens` tokens each name
// `top_k` global experts (-1: none); expert e lives on rank e / experts_per_rank.
// A token travels once to every rank holding one of its experts, in the send
// buffer's block of that rank, the rank's tokens in increasing token order.
//
// An expert id outside [-1, num_experts) (possible only with index checks off)
// poisons what it touches: its token's sum comes back NaN (sum_rows), its slot's
// row and weight gradient are NaN (sort_slots marks it kInvalidSlot), never a
// plausible value. So does a token that capacity mode cannot send, its rank's
// block being full (route_tokens marks it kOverflowRow): with index checks on,
// moe_dispatch refuses such a token instead.
//
// Permutation (moe_permute, moe_unpermute): a rank holds `rows` received tokens, each with `top_k` slots naming a local
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

// The position of a slot whose expert id lies outside [-1, num_experts).
inline constexpr int64_t kInvalidSlot = -2;

// send_rows of a token whose destination's block is full (capacity mode). (Equal to kInvalidSlot by
// chance: they mark different arrays, send_rows and positions.)
inline constexpr int64_t kOverflowRow = -2;

// Slots per block of the CUDA sort. Its scratch holds, for each block of
// kSortBlockSlots slots, one count per expert, and one more row of totals.
inline constexpr int64_t kSortBlockSlots = 256;

// The int64 entries of SortSlotsArgs::scratch for `slots` slots and `num_experts` experts.
inline int64_t sort_scratch_size(int64_t slots, int64_t num_experts) {
  return ((slots + kSortBlockSlots - 1) / kSortBlockSlots + 1) * num_experts;
}

// positions[slot] = the slot's row in expert-major order (-1 for no expert, or
// past the expert's segment; kInvalidSlot for an id out of range), and
// segment_ends[e] = one past expert e's last row (torch._grouped_mm's offsets). Each expert's
// rows its slots leave empty (capacity padding) are zeroed in `sorted`, so the
// caller need not clear it. Work items: experts (the CPU kernels; the CUDA
// kernels take every slot at once, so their launch must cover all experts
// [0, num_experts): a rank within each block of slots, the blocks' offsets per
// expert, then the positions).
struct SortSlotsArgs {
  const int64_t* experts;  // [rows, top_k]
  int64_t rows;
  int64_t top_k;
  int64_t num_experts;
  int64_t capacity;       // rows reserved per expert; -1: dropless (segments packed by `starts`)
  const int64_t* starts;  // [num_experts] each segment's first row (dropless; unused with a capacity)
  const int64_t* ends;    // [num_experts] one past its last row (dropless): slots past it get -1
  int64_t* positions;     // [rows, top_k]
  void* sorted;           // [sorted rows, row_bytes / element size]: the padding rows are zeroed
  int64_t row_bytes;
  int64_t* scratch;  // [sort_scratch_size(rows * top_k, num_experts)], any contents (the CUDA kernels; CPU: unused)
  int32_t* segment_ends;  // [num_experts]
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

// sorted[positions[r, j]] = weights[r, j] * x[r] for every slot with a position
// (rows without a slot are left as they are). Work items: rows.
struct ScatterRowsArgs {
  SlotRows slots;
  const void* x;  // [rows, dim]
  void* sorted;   // [sorted rows, dim]
};

// y[r] = sum over j = 0..top_k-1 of weights[r, j] * sorted[positions[r, j]], in the
// accumulator type, in that order (0 for a row without slots; NaN with an invalid
// slot). Work items: rows.
struct GatherSumRowsArgs {
  SlotRows slots;
  const void* sorted;  // [sorted rows, dim]
  void* y;             // [rows, dim]
};

// dots[r, j] = <g[r], sorted[positions[r, j]]> in the accumulator type (0 without a
// position, NaN for an invalid slot): the gradient of a slot's weight. Work items: rows.
struct SlotDotsArgs {
  SlotRows slots;
  const void* g;       // [rows, dim]
  const void* sorted;  // [sorted rows, dim]
  void* dots;          // [rows, top_k] accumulator type
};

// send_rows[t, r] = the row of the send buffer carrying token t to rank r, -1 (no
// expert of t on r) or kOverflowRow (rank r's block [starts[r], ends[r]) already full).
// Work items: ranks.
struct RouteTokensArgs {
  const int64_t* experts;  // [tokens, top_k] global experts, -1: none
  int64_t tokens;
  int64_t top_k;
  int64_t ranks;
  int64_t experts_per_rank;
  const int64_t* starts;  // [ranks] the first row of each rank's block
  const int64_t* ends;    // [ranks] one past its last row
  int64_t* send_rows;     // [tokens, ranks]
};

// The token rows of the exchange, and the routing of route_tokens.
struct ExchangeRows {
  ElementType type;
  int64_t tokens;
  int64_t top_k;
  int64_t dim;
  int64_t ranks;
  int64_t experts_per_rank;
  const int64_t* experts;    // [tokens, top_k] global experts, -1: none
  const int64_t* send_rows;  // [tokens, ranks] from route_tokens
};

// For every token t and rank r with a row: rows[row] = x[t]; local_experts[row, j] =
// the slot's expert on r (expert - r * experts_per_rank), or -1 where the slot's
// expert is not on r; row_weights[row, j] = weights[t, j] there, else 0. Rows no
// token is sent in are left as they are. Work items: tokens.
struct PackRowsArgs {
  ExchangeRows exchange;
  const void* x;         // [tokens, dim]
  const void* weights;   // [tokens, top_k] accumulator type
  void* rows;            // [send rows, dim]
  int64_t* local_experts;  // [send rows, top_k]
  void* row_weights;     // [send rows, top_k] accumulator type
};

// out[t] = the sum over r = 0..ranks-1 of rows[send_rows[t, r]], in the accumulator
// type, in that order (0 for a token sent nowhere; NaN for a token with an expert
// id out of range or a kOverflowRow); out_weights[t, j] = row_weights[send_rows[t, rank of the slot's
// expert], j] (0 without one, NaN out of range; skipped when row_weights is
// nullptr). Work items: tokens.
struct SumRowsArgs {
  ExchangeRows exchange;
  const void* rows;         // [send rows, dim]
  const void* row_weights;  // [send rows, top_k] accumulator type, or nullptr
  void* out;                // [tokens, dim]
  void* out_weights;        // [tokens, top_k] accumulator type
};

struct MoeKernels {
  void (*route_tokens)(const RouteTokensArgs&, const Launch&);
  void (*pack_rows)(const PackRowsArgs&, const Launch&);
  void (*sum_rows)(const SumRowsArgs&, const Launch&);
  void (*sort_slots)(const SortSlotsArgs&, const Launch&);
  void (*scatter_rows)(const ScatterRowsArgs&, const Launch&);
  void (*gather_sum_rows)(const GatherSumRowsArgs&, const Launch&);
  void (*slot_dots)(const SlotDotsArgs&, const Launch&);

  static const MoeKernels& cpu(CpuIsa isa);  // kernels/cpu/moe.cpp
  static const MoeKernels& cuda();           // kernels/cuda/moe.cu (CUDA builds)
};

}  // namespace tdx::kernels
