#pragma once
// Torch-free CUDA launcher of attention's partial-result merge, with the
// contract of kernels/cpu/attention.h over all groups at once, on `stream`.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace tdx::kernels::cuda {

template <typename Acc>
void lse_merge(ElementType block_type, Acc* out, int64_t out_outer_stride, Acc* lse, int64_t lse_outer_stride,
               const void* block_out, int64_t block_out_outer_stride, const Acc* block_lse,
               int64_t block_lse_outer_stride, int64_t outer, int64_t rows, int64_t dim, cudaStream_t stream);

}  // namespace tdx::kernels::cuda
