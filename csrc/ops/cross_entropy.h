#pragma once
// Vocab-parallel cross-entropy, host side shared by CPU and CUDA: argument
// checks and the cross-rank combination of per-shard statistics. Each device
// file supplies its kernels as the callbacks below.

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace tdx::ops {

// Fills stats [3, rows] (rows: max, sum of exp(logit - max), target logit) of
// the contiguous logits [rows, vocab_local] of this rank's shard.
using ShardStatsKernel = void (*)(const at::Tensor& logits, const at::Tensor& target,
                                  int64_t vocab_start, at::Tensor& stats);

// Writes grad_logits [rows, vocab_local] from grad_loss [rows] and lse [rows].
using ShardGradKernel = void (*)(const at::Tensor& grad_loss, const at::Tensor& logits,
                                 const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start,
                                 int64_t ignore_index, at::Tensor& grad_logits);

std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy(
    ShardStatsKernel kernel, const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
    int64_t vocab_size, int64_t ignore_index, c10::string_view group_name);

at::Tensor vocab_parallel_cross_entropy_backward(
    ShardGradKernel kernel, const at::Tensor& grad_loss, const at::Tensor& logits,
    const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index);

// The gradient written over logits, which must be contiguous.
void vocab_parallel_cross_entropy_backward_(
    ShardGradKernel kernel, const at::Tensor& grad_loss, const at::Tensor& logits,
    const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index);

}  // namespace tdx::ops
