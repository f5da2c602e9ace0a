// Sequence-parallel GEMMs decomposed into ring steps, host side for every
// device (ATen GEMMs and the ring pipelines of comm/ring_pipeline.h): while one
// block's GEMM runs, the next block (or the running partial sum) is in flight
// to the neighbour.
//
// Shapes: along the sharded dimension each rank holds an equal, contiguous
// block, rank r the r-th block (torch.chunk order).

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>

#include <functional>

#include "comm/agreement.h"
#include "comm/ring_pipeline.h"
#include "ops/device.h"

namespace tdx::ops {
namespace {

constexpr const char* kAllGatherMatmul = "all_gather_matmul";
constexpr const char* kMatmulReduceScatter = "matmul_reduce_scatter";
constexpr const char* kWeightGrad = "all_gather_weight_grad";
constexpr const char* kAllGatherScaledMm = "all_gather_scaled_mm";
constexpr const char* kScaledMmReduceScatter = "scaled_mm_reduce_scatter";

// A tensor sharded along `dim` seen as [outer, rows, features]: `outer` is the
// product of the sizes before `dim`, `rows` of the sizes from `dim` up to the
// last one. Rank j's block of the gathered tensor is [:, j*rows:(j+1)*rows, :].
struct BlockShape {
  int64_t outer;
  int64_t rows;
  int64_t features;
};

BlockShape block_shape(const at::Tensor& t, int64_t dim, int64_t parts) {
  int64_t outer = 1;
  int64_t rows = t.size(dim) / parts;
  for (int64_t d = 0; d < dim; ++d) outer *= t.size(d);
  for (int64_t d = dim + 1; d < t.dim() - 1; ++d) rows *= t.size(d);
  return {outer, rows, t.size(-1)};
}

int64_t sharded_dim(const char* op, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() >= 2, op, ": the activation must have at least 2 dims, got shape ", t.sizes());
  const int64_t wrapped = c10::maybe_wrap_dim(dim, t.dim());
  TORCH_CHECK(
      wrapped < t.dim() - 1, op, ": the sharded dim must not be the feature (last) dim, got dim=", dim,
      " for shape ", t.sizes());
  return wrapped;
}

// The sharded dim of x for a reduce-scatter over `ranks` ranks: it must split evenly.
int64_t scatter_dim_checked(const char* op, const at::Tensor& x, int64_t scatter_dim, int ranks) {
  const int64_t dim = sharded_dim(op, x, scatter_dim);
  TORCH_CHECK(
      x.size(dim) % ranks == 0, op, ": x.size(", dim, ")=", x.size(dim), " must be divisible by the group size ",
      ranks);
  return dim;
}

void check_same_kind(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                     const char* b_name) {
  TORCH_CHECK(
      a.scalar_type() == b.scalar_type(), op, ": ", a_name, " and ", b_name,
      " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(
      a.device() == b.device(), op, ": ", a_name, " and ", b_name,
      " must be on the same device, got ", a.device(), " and ", b.device());
}

void check_matmul_operands(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [out, in], got shape ", weight.sizes());
  TORCH_CHECK(
      x.size(-1) == weight.size(1), op, ": x.size(-1)=", x.size(-1), " must equal weight.size(1)=",
      weight.size(1));
  check_same_kind(op, x, "x", weight, "weight");
}

// dst (a [outer, rows, n] view) = a @ b, written in place when dst is contiguous.
void matmul_into(const at::Tensor& dst, const at::Tensor& a, const at::Tensor& b) {
  if (dst.is_contiguous()) {
    auto dst_2d = dst.view({a.size(0), b.size(1)});
    at::mm_out(dst_2d, a, b);
  } else {
    dst.copy_(at::mm(a, b).view(dst.sizes()));
  }
}

// The GEMM of one block's rows [rows, k] into dst, a [outer, rows, n] view of the output.
using BlockGemm = std::function<void(const at::Tensor& dst, const at::Tensor& rows)>;

bool is_fp8(at::ScalarType type) {
  return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

// The gather ring of all_gather_matmul and all_gather_scaled_mm. x: this rank's block [..., S/n, ..., k] along
// `dim` (already checked). Returns (out [..., S, ..., out_features] in out_dtype, each arriving block's GEMM
// written into its rows; the gathered x if return_gathered, else an empty tensor). fp8 blocks travel as bytes
// (c10d backends need not know the fp8 dtypes).
std::tuple<at::Tensor, at::Tensor> all_gather_gemm(comm::Ring& ring, const at::Tensor& x, int64_t dim,
                                                   int64_t out_features, at::ScalarType out_dtype,
                                                   bool return_gathered, const BlockGemm& gemm) {
  const int64_t n = ring.size();
  const auto shard = x.contiguous();
  const auto shape = block_shape(shard, dim, 1);
  auto gathered_sizes = shard.sizes().vec();
  gathered_sizes[dim] *= n;
  auto out_sizes = gathered_sizes;
  out_sizes.back() = out_features;
  auto out = at::empty(out_sizes, shard.options().dtype(out_dtype));
  auto gathered = at::empty(return_gathered ? gathered_sizes : std::vector<int64_t>{0}, shard.options());
  const auto out_blocks = out.view({shape.outer, n * shape.rows, out_features});
  const auto travelling = is_fp8(shard.scalar_type()) ? shard.view(at::kByte) : shard;
  comm::for_each_ring_block(ring, travelling, [&](const at::Tensor& arrived, int owner) {
    const auto block = arrived.view(shard.scalar_type()).view({shape.outer, shape.rows, shape.features});
    gemm(out_blocks.narrow(1, owner * shape.rows, shape.rows),
         block.view({shape.outer * shape.rows, shape.features}));
    if (return_gathered) {
      gathered.view({shape.outer, n * shape.rows, shape.features})
          .narrow(1, owner * shape.rows, shape.rows)
          .copy_(block);
    }
  });
  return {out, gathered};
}

// The reduce-scatter ring of matmul_reduce_scatter and scaled_mm_reduce_scatter. x: [..., S, ..., k] with S
// divisible by the group size, `dim` already checked (scatter_dim_checked). Returns this rank's block
// [..., S/n, ..., out_features] of the sum over ranks of the GEMMs, summed in out_dtype: each step's GEMM
// writes this rank's contribution to one block while the previous block's running sum is in flight; this
// rank's own block comes last.
at::Tensor gemm_reduce_scatter(comm::Ring& ring, const at::Tensor& x, int64_t dim, int64_t out_features,
                               at::ScalarType out_dtype, const BlockGemm& gemm) {
  const int n = ring.size();
  const auto input = x.contiguous();
  const auto shape = block_shape(input, dim, n);
  const auto in_blocks = input.view({shape.outer, n * shape.rows, shape.features});
  auto out_sizes = input.sizes().vec();
  out_sizes[dim] /= n;
  out_sizes.back() = out_features;
  comm::RingReduceScatter sums(ring, out_sizes, input.options().dtype(out_dtype),
                               comm::RingReduceScatter::Order::kOwnBlockLast);
  for (int step = 0; step < n; ++step) {
    gemm(sums.contribution(), in_blocks.narrow(1, sums.block() * shape.rows, shape.rows)
                                  .reshape({shape.outer * shape.rows, shape.features}));
    sums.pass();
  }
  return sums.result();
}

// x: [..., S/n, ..., in] (shard along gather_dim), weight: [out, in].
// Returns (all_gather(x, gather_dim) @ weight.T  [..., S, ..., out],
//          all_gather(x, gather_dim) if return_gathered else an empty tensor).
std::tuple<at::Tensor, at::Tensor> all_gather_matmul(
    const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
    int64_t gather_dim, bool return_gathered) {
  comm::Ring ring(group_name);
  int64_t dim = 0;
  comm::Agreement call(kAllGatherMatmul);
  call.tensor("x", x).value("gather_dim", gather_dim).check(ring.group(), x.device(), [&] {
    dim = sharded_dim(kAllGatherMatmul, x, gather_dim);
    check_matmul_operands(kAllGatherMatmul, x, weight);
  });
  const auto weight_t = weight.t();
  return all_gather_gemm(ring, x, dim, weight.size(0), x.scalar_type(), return_gathered,
                         [&](const at::Tensor& dst, const at::Tensor& rows) { matmul_into(dst, rows, weight_t); });
}

// x: [..., S, ..., in] with S divisible by n, weight: [out, in].
// Returns this rank's block of sum_over_ranks(x @ weight.T): [..., S/n, ..., out].
at::Tensor matmul_reduce_scatter(
    const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
    int64_t scatter_dim) {
  comm::Ring ring(group_name);
  int64_t dim = 0;
  comm::Agreement call(kMatmulReduceScatter);
  call.tensor("x", x).tensor("weight", weight).value("scatter_dim", scatter_dim);
  call.check(ring.group(), x.device(), [&] {
    dim = scatter_dim_checked(kMatmulReduceScatter, x, scatter_dim, ring.size());
    check_matmul_operands(kMatmulReduceScatter, x, weight);
  });
  const auto weight_t = weight.t();
  return gemm_reduce_scatter(ring, x, dim, weight.size(0), x.scalar_type(),
                             [&](const at::Tensor& dst, const at::Tensor& rows) { matmul_into(dst, rows, weight_t); });
}

// dense: [..., S, ..., a], shard: [..., S/n, ..., b] (block along gather_dim).
// Returns [a, b] = dense.flatten(0, -2).T @ all_gather(shard, gather_dim).flatten(0, -2).
at::Tensor all_gather_weight_grad(
    const at::Tensor& dense, const at::Tensor& shard, c10::string_view group_name,
    int64_t gather_dim) {
  comm::Ring ring(group_name);
  const int64_t n = ring.size();
  int64_t dim = 0;
  comm::Agreement call(kWeightGrad);
  call.tensor("shard", shard).value("gather_dim", gather_dim).check(ring.group(), shard.device(), [&] {
    dim = sharded_dim(kWeightGrad, shard, gather_dim);
    check_same_kind(kWeightGrad, dense, "dense", shard, "shard");
    TORCH_CHECK(
        dense.dim() == shard.dim(), kWeightGrad, ": dense and shard must have the same number ",
        "of dims, got shapes ", dense.sizes(), " and ", shard.sizes());
    for (int64_t d = 0; d < shard.dim() - 1; ++d) {
      const int64_t expected = d == dim ? shard.size(d) * n : shard.size(d);
      TORCH_CHECK(
          dense.size(d) == expected, kWeightGrad, ": dense.size(", d, ")=", dense.size(d),
          " must be ", expected, " for shard shape ", shard.sizes(), " gathered over ", n, " ranks on dim ",
          dim);
    }
  });
  const auto shard_c = shard.contiguous();
  const auto shape = block_shape(shard_c, dim, 1);
  const int64_t a = dense.size(-1);
  const auto dense_blocks = dense.contiguous().view({shape.outer, n * shape.rows, a});
  // Half-precision inputs accumulate the n block products in fp32.
  const bool reduced = at::isReducedFloatingType(dense.scalar_type());
  auto acc = at::zeros({a, shape.features}, dense.options().dtype(reduced ? at::kFloat : dense.scalar_type()));
  comm::for_each_ring_block(ring, shard_c, [&](const at::Tensor& block, int owner) {
    const auto dense_rows = dense_blocks.narrow(1, owner * shape.rows, shape.rows)
                                .reshape({shape.outer * shape.rows, a});
    const auto shard_rows = block.view({shape.outer * shape.rows, shape.features});
    if (reduced) {
      acc.add_(at::mm(dense_rows.t(), shard_rows));
    } else {
      acc.addmm_(dense_rows.t(), shard_rows);
    }
  });
  return acc.to(dense.scalar_type());
}

// ---- fp8: the same two rings with torch._scaled_mm per block ----

void check_scaled_mm_operands(const char* op, const at::Tensor& x, const at::Tensor& mat2, const at::Tensor& scale_x,
                              const at::Tensor& scale_mat2, at::ScalarType out_dtype) {
  TORCH_CHECK(
      is_fp8(x.scalar_type()) && is_fp8(mat2.scalar_type()), op,
      ": x and mat2 must be float8_e4m3fn or float8_e5m2, got ", x.scalar_type(), " and ", mat2.scalar_type());
  TORCH_CHECK(mat2.dim() == 2, op, ": mat2 must be 2-D [k, n], got shape ", mat2.sizes());
  TORCH_CHECK(
      x.size(-1) == mat2.size(0), op, ": x.size(-1)=", x.size(-1), " must equal mat2.size(0)=", mat2.size(0));
  for (const auto* scale : {&scale_x, &scale_mat2}) {
    TORCH_CHECK(
        scale->scalar_type() == at::kFloat && scale->numel() == 1, op,
        ": scale_x and scale_mat2 must be 1-element float32 tensors, got ", scale->scalar_type(), " with ",
        scale->numel(), " elements");
  }
  for (const auto* t : {&mat2, &scale_x, &scale_mat2}) {
    TORCH_CHECK(
        t->device() == x.device(), op, ": every tensor must be on x's device ", x.device(), ", got ", t->device());
  }
  TORCH_CHECK(
      out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf, op,
      ": out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  if (x.is_cuda()) {  // torch._scaled_mm's rules on a GPU, checked before any block travels
    TORCH_CHECK(
        mat2.stride(0) == 1 && mat2.size(0) % 16 == 0 && mat2.size(1) % 16 == 0, op,
        ": on CUDA mat2 must be column-major with both dims multiples of 16, got shape ", mat2.sizes(),
        " and strides ", mat2.strides());
  }
}

// dst (a [outer, rows, n] view) = (a @ b) * scale_a * scale_b in dst's dtype, written in place when dst is
// contiguous. On the CPU the exact emulation that torchdist_ext/fp8/gemm.py describes: fp8 widens
// to fp32 without rounding, so one fp32 GEMM times the scales.
void scaled_mm_into(const at::Tensor& dst, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                    const at::Tensor& scale_b) {
  if (a.is_cpu()) {
    dst.copy_(at::mm(a.to(at::kFloat), b.to(at::kFloat)).mul_(scale_a * scale_b).view(dst.sizes()));
  } else if (dst.is_contiguous()) {
    auto dst_2d = dst.view({a.size(0), b.size(1)});
    at::_scaled_mm_out(dst_2d, a, b, scale_a, scale_b, std::nullopt, std::nullopt, dst.scalar_type());
  } else {
    dst.copy_(at::_scaled_mm(a, b, scale_a, scale_b, std::nullopt, std::nullopt, dst.scalar_type()).view(dst.sizes()));
  }
}

// x: this rank's fp8 block [..., S/n, ..., k] along gather_dim, mat2: fp8 [k, n].
// Returns ((all_gather(x) @ mat2) * scale_x * scale_mat2 [..., S, ..., n] in out_dtype, all_gather(x)).
std::tuple<at::Tensor, at::Tensor> all_gather_scaled_mm(
    const at::Tensor& x, const at::Tensor& mat2, const at::Tensor& scale_x, const at::Tensor& scale_mat2,
    at::ScalarType out_dtype, c10::string_view group_name, int64_t gather_dim) {
  comm::Ring ring(group_name);
  int64_t dim = 0;
  comm::Agreement call(kAllGatherScaledMm);  // every block is multiplied by this rank's scale_x: one for all
  call.tensor("x", x).scalar("scale_x", scale_x).value("gather_dim", gather_dim);
  call.check(ring.group(), x.device(), [&] {
    dim = sharded_dim(kAllGatherScaledMm, x, gather_dim);
    check_scaled_mm_operands(kAllGatherScaledMm, x, mat2, scale_x, scale_mat2, out_dtype);
  });
  return all_gather_gemm(ring, x, dim, mat2.size(1), out_dtype, /*return_gathered=*/true,
                         [&](const at::Tensor& dst, const at::Tensor& rows) {
                           scaled_mm_into(dst, rows, mat2, scale_x, scale_mat2);
                         });
}

// x: fp8 [..., S, ..., k] with S divisible by n, mat2: fp8 [k, n_out].
// Returns this rank's block of sum_over_ranks((x @ mat2) * scale_x * scale_mat2) [..., S/n, ..., n_out],
// summed in out_dtype as the ring passes.
at::Tensor scaled_mm_reduce_scatter(const at::Tensor& x, const at::Tensor& mat2, const at::Tensor& scale_x,
                                    const at::Tensor& scale_mat2, at::ScalarType out_dtype,
                                    c10::string_view group_name, int64_t scatter_dim) {
  comm::Ring ring(group_name);
  int64_t dim = 0;
  comm::Agreement call(kScaledMmReduceScatter);
  call.tensor("x", x).tensor("mat2", mat2).text("out_dtype", c10::toString(out_dtype));
  call.value("scatter_dim", scatter_dim).check(ring.group(), x.device(), [&] {
    dim = scatter_dim_checked(kScaledMmReduceScatter, x, scatter_dim, ring.size());
    check_scaled_mm_operands(kScaledMmReduceScatter, x, mat2, scale_x, scale_mat2, out_dtype);
  });
  return gemm_reduce_scatter(ring, x, dim, mat2.size(1), out_dtype,
                             [&](const at::Tensor& dst, const at::Tensor& rows) {
                               scaled_mm_into(dst, rows, mat2, scale_x, scale_mat2);
                             });
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_collective_matmul) {
  m.impl("all_gather_matmul", &all_gather_matmul);
  m.impl("matmul_reduce_scatter", &matmul_reduce_scatter);
  m.impl("all_gather_weight_grad", &all_gather_weight_grad);
  m.impl("all_gather_scaled_mm", &all_gather_scaled_mm);
  m.impl("scaled_mm_reduce_scatter", &scaled_mm_reduce_scatter);
}

}  // namespace tdx::ops
