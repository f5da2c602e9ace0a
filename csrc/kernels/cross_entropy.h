#pragma once
// Vocab-parallel cross-entropy: the kernel table and argument layouts shared by
// the host (csrc/ops/cross_entropy.cpp), the CPU kernels
// (kernels/cpu/cross_entropy.cpp) and the CUDA kernels (kernels/cuda/cross_entropy.cu).
//
// Logits are this rank's contiguous vocab shard, row-major [rows, vocab_local],
// holding columns [vocab_start, vocab_start + vocab_local) of the vocabulary.
// Statistics and lse are in the accumulator type of the logits' element type
// (accumulator_t: double for fp64 logits, float otherwise). A launch's work
// items are rows.

#include <cstdint>

#include "kernels/cpu/isa.h"
#include "kernels/dtype.h"
#include "kernels/launch.h"

namespace tdx::kernels {

struct VocabShard {
  ElementType type;  // of logits, grad_loss and grad_logits
  int64_t rows;
  int64_t vocab_local;
  int64_t vocab_start;
};

// stats = [3, rows] accumulators: each row's max, sum of exp(logit - max), and
// its target's logit if this shard holds the target (else 0). A -inf logit
// counts for nothing; a NaN logit makes the row's sum NaN.
struct ShardStatsArgs {
  VocabShard shard;
  const void* logits;     // [rows, vocab_local]
  const int64_t* target;  // [rows]
  void* stats;            // [3, rows]
};

// grad_logits[i, v] = grad_loss[i] * (exp(logits[i, v] - lse[i]) - [vocab_start + v == target[i]]),
// and exactly 0 on rows whose target is ignore_index (even where exp() is not finite).
struct ShardGradArgs {
  VocabShard shard;
  const void* grad_loss;  // [rows], the logits' element type
  const void* logits;     // [rows, vocab_local]
  const int64_t* target;  // [rows]
  const void* lse;        // [rows] accumulators
  int64_t ignore_index;
  void* grad_logits;  // [rows, vocab_local], the logits' element type; may be logits (in place)
};

struct CrossEntropyKernels {
  void (*shard_stats)(const ShardStatsArgs&, const Launch&);
  void (*shard_grad)(const ShardGradArgs&, const Launch&);

  static const CrossEntropyKernels& cpu(CpuIsa isa);  // kernels/cpu/cross_entropy.cpp
  static const CrossEntropyKernels& cuda();           // kernels/cuda/cross_entropy.cu (CUDA builds)
};

}  // namespace tdx::kernels
