#pragma once
// Packed documents in the planner: the attention work of sequences that pack
// documents of log-normal lengths, and how evenly each cp order spreads it
// over the ring ranks. Sampled, not closed-form: rows are drawn from the
// distribution (a fixed seed, so estimates are reproducible) and each rank's
// work counted as the ops count it (ops/sequence_plan.h's token work; the
// balanced order runs the plan itself).

#include <cstdint>

#include "planner/options.h"
#include "planner/specs.h"

namespace tdx::planner {

struct AttentionBalance {
  // The attention's (query, key) pairs over those of one causal document of the whole sequence.
  double work_share = 1.0;
  // The expected max / mean - 1 of the ring ranks' pairs: the slowest rank's excess.
  double spread = 0.0;
};

// For sequences of `seq_len` tokens packing documents of log-normal lengths (median `median` tokens,
// log-space deviation `sigma`; median 0: one document), cut over `ranks` ring ranks in `order`. Sequences
// longer than 16384 tokens are sampled at 16384 with the lengths scaled alike (the shares depend on the
// lengths relative to the sequence). Results are cached.
AttentionBalance attention_balance(int64_t seq_len, int64_t ranks, CpOrder order, double median, double sigma);

// The layout's: its sequence, ring ranks (cp / cp_ulysses: Ulysses ranks share every query), order and documents.
AttentionBalance attention_balance(const Layout& layout);

}  // namespace tdx::planner
