#pragma once
// Torch-free CUDA launchers of the vocab-parallel cross-entropy, with the same
// contracts as kernels/cpu/cross_entropy.h over all rows at once, enqueued on
// `stream`. Acc is float, or double for fp64 logits.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace tdx::kernels::cuda {

template <typename Acc>
void vocab_shard_stats(ElementType type, const void* logits, const int64_t* target, int64_t rows,
                       int64_t vocab_local, int64_t vocab_start, Acc* row_max, Acc* row_sumexp,
                       Acc* target_logit, cudaStream_t stream);

template <typename Acc>
void vocab_shard_grad(ElementType type, const void* grad_loss, const void* logits, const int64_t* target,
                      const Acc* lse, int64_t rows, int64_t vocab_local, int64_t vocab_start,
                      int64_t ignore_index, void* grad_logits, cudaStream_t stream);

}  // namespace tdx::kernels::cuda
