#pragma once
// How a sequence is sharded over the N ranks of a context-parallel group
// (shards of S_local = S / N tokens):
//   contiguous  rank r holds chunk r of N.
//   zigzag      rank r holds chunks r and 2N-1-r of 2N (each S_local / 2 tokens),
//               which gives every rank the same causal work.

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <string>

namespace tdx::ops {

enum class SequenceOrder { kContiguous, kZigzag };

inline SequenceOrder parse_sequence_order(const char* op, c10::string_view name) {
  if (name == "contiguous") return SequenceOrder::kContiguous;
  if (name == "zigzag") return SequenceOrder::kZigzag;
  TORCH_CHECK_VALUE(false, op, ": order must be 'contiguous' or 'zigzag', got '", std::string(name), "'");
}

}  // namespace tdx::ops
