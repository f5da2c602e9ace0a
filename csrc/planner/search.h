#pragma once
// Layout search: every layout the model and cluster admit, estimated and
// checked; the feasible ones (fit in memory, no error-level finding), fastest first.

#include <utility>
#include <vector>

#include "planner/estimate.h"

namespace tdx::planner {

// Enumerates tp (powers of two up to the NVLink domain and the heads), pp (dividing the layers),
// cp (powers of two dividing the sequence, up to 16), ep (dividing the experts), dp = the rest;
// ZeRO 1 and 3; recompute none / selective / full; micro-batch 1, 2, 4; sequence parallelism when
// tp > 1; 1f1b or interleaved (2 virtual stages) when pp > 1. The global batch (sequences) fixes
// the number of micro-batches. Layouts with experts are priced at the given routing imbalance
// (Layout::expert_imbalance, at most ep: with ep ranks the busiest can hold every row); every layout is
// eager or every one compiled (Layout::compiled).
std::vector<std::pair<Layout, Estimate>> search(const ModelSpec& model, const ClusterSpec& cluster, long seq_len,
                                                long global_batch, long top, double expert_imbalance = 1.0,
                                                bool compiled = false);

}  // namespace tdx::planner
