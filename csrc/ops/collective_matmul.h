#pragma once
// Sequence-parallel GEMMs decomposed into ring steps: while one chunk's GEMM
// runs, the next chunk (or the running partial sum) is in flight to the
// neighbour. Device-generic host code (ATen GEMMs + c10d P2P), registered for
// CPU in collective_matmul.cpp and for CUDA in collective_matmul_cuda.cpp.
//
// Shapes: along the sharded dimension `dim` each rank holds an equal,
// contiguous block, rank r the r-th block (torch.chunk order).

#include <ATen/core/Tensor.h>

#include <c10/util/string_view.h>
#include <tuple>

namespace tdx::ops {

// x: [..., S/n, ..., in] (shard along gather_dim), weight: [out, in].
// Returns (all_gather(x, gather_dim) @ weight.T  [..., S, ..., out],
//          all_gather(x, gather_dim) if return_gathered else an empty tensor).
std::tuple<at::Tensor, at::Tensor> all_gather_matmul(
    const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
    int64_t gather_dim, bool return_gathered);

// x: [..., S, ..., in] with S divisible by n, weight: [out, in].
// Returns this rank's block of sum_over_ranks(x @ weight.T): [..., S/n, ..., out].
at::Tensor matmul_reduce_scatter(
    const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
    int64_t scatter_dim);

// dense: [..., S, ..., a], shard: [..., S/n, ..., b] (block along gather_dim).
// Returns [a, b] = dense.flatten(0, -2).T @ all_gather(shard, gather_dim).flatten(0, -2).
at::Tensor all_gather_weight_grad(
    const at::Tensor& dense, const at::Tensor& shard, c10::string_view group_name,
    int64_t gather_dim);

}  // namespace tdx::ops
