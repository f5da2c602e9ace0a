#pragma once
// A balanced sequence plan for context parallelism: which global positions of
// a packed row each of N ranks holds, so that every rank holds S / N tokens
// and about the same causal attention work. Torch-free: the op
// (ops/attention.cpp, tdx::balanced_sequence_plan) runs it per batch row;
// GoogleTest checks it (tests/cpp/test_sequence_plan.cpp).
//
// A token's work is the number of keys it attends to: the tokens of its
// document (equal non-negative id) at or before it; padding (negative id) has
// none. A rank's cost is the sum over its tokens.
//
// The algorithm (its reasoning: docs/architecture.md, "Balanced context
// parallelism"):
//   1. Runs of one id whose work exceeds 1/32 of a rank's mean are long: each
//      is cut into 2N chunks, rank r taking chunks r and 2N-1-r (zigzag within
//      the run, whose work grows linearly: equal up to the chunks' rounding).
//      The rounding's extra tokens go to the ranks holding the fewest, so the
//      ranks' token counts never differ by more than one.
//   2. The other runs (and padding) are placed whole, most work first, on the
//      least-loaded rank with room for them (list scheduling); a run that no
//      rank has room for fills the rank with the most room and its rest is
//      placed again.
// Bound: every rank holds exactly S / N tokens. While no rank's room binds,
// the most loaded rank exceeds the mean by at most the largest short run's
// work (< 1/32 of the mean) plus the long runs' rounding (Graham's bound for
// list scheduling); rooms bind only for the last, cheapest runs.

#include <cstdint>
#include <vector>

namespace tdx::ops {

// Each token's work (see above) for the ids of one row of `seq` tokens.
std::vector<int64_t> token_work(const int64_t* ids, int64_t seq);

struct RowPlan {
  std::vector<int64_t> indices;  // [ranks, seq / ranks]: each rank's global positions, ascending
  std::vector<int64_t> costs;    // [ranks]: each rank's work
};

// The plan of one row of `seq` tokens (a multiple of `ranks`) over `ranks` ranks.
RowPlan balanced_row_plan(const int64_t* ids, int64_t seq, int ranks);

}  // namespace tdx::ops
