// CUDA registration of the collective matmuls. The host code is
// device-generic: cuBLAS GEMMs on the current stream, and NCCL P2P whose
// wait() orders the current stream after the transfer, so the next block's
// transfer overlaps the current block's GEMM.

#include <torch/library.h>

#include "ops/collective_matmul.h"

namespace tdx::ops {

TORCH_LIBRARY_IMPL(tdx, CUDA, m) {
  m.impl("all_gather_matmul", &all_gather_matmul);
  m.impl("matmul_reduce_scatter", &matmul_reduce_scatter);
  m.impl("all_gather_weight_grad", &all_gather_weight_grad);
}

}  // namespace tdx::ops
