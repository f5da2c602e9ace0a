#pragma once
// Torch-free CPU kernels of the vocab-parallel cross-entropy. Logits are this
// rank's contiguous vocab shard, row-major [rows, vocab_local], holding
// columns [vocab_start, vocab_start + vocab_local) of the full vocabulary.
// Statistics and lse are fp64 for fp64 logits and fp32 otherwise (`Acc`).

#include <cstdint>

#include "kernels/dtype.h"

namespace tdx::kernels::cpu {

// For rows [row_begin, row_end): row_max = max of the shard's logits,
// row_sumexp = sum exp(logit - row_max), target_logit = the target's logit if
// it lies in this shard, else 0. Each output points at a [rows] array.
template <typename Acc>
void vocab_shard_stats(
    ElementType type, const void* logits, const int64_t* target, int64_t row_begin, int64_t row_end,
    int64_t vocab_local, int64_t vocab_start, Acc* row_max, Acc* row_sumexp, Acc* target_logit);

// grad_logits[i, v] = grad_loss[i] * (exp(logits[i, v] - lse[i]) - [vocab_start + v == target[i]]),
// and 0 for rows whose target is ignore_index. grad_loss and grad_logits have
// the logits' element type; grad_logits may be logits (in place).
template <typename Acc>
void vocab_shard_grad(
    ElementType type, const void* grad_loss, const void* logits, const int64_t* target, const Acc* lse,
    int64_t row_begin, int64_t row_end, int64_t vocab_local, int64_t vocab_start, int64_t ignore_index,
    void* grad_logits);

}  // namespace tdx::kernels::cpu
