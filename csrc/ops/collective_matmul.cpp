#include "ops/collective_matmul.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/library.h>

#include <functional>

#include "comm/ring.h"

namespace tdx::ops {
namespace {

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

// Calls consume(block, owner) once for every rank's block of the all-gather of
// `shard`, starting with this rank's own. The next block travels from the
// previous rank while consume() works on the current one (double-buffered).
void for_each_gathered_block(
    comm::Ring& ring, const at::Tensor& shard,
    const std::function<void(const at::Tensor&, int64_t)>& consume) {
  const int n = ring.size();
  at::Tensor buffers[2];
  if (n > 1) {
    buffers[0] = at::empty_like(shard);
    buffers[1] = at::empty_like(shard);
  }
  at::Tensor current = shard;
  for (int step = 0; step < n; ++step) {
    const int64_t owner = (ring.rank() - step + n) % n;
    comm::PendingExchange pending;
    at::Tensor incoming;
    if (step + 1 < n) {
      incoming = buffers[step % 2];
      pending = ring.exchange(current, incoming, step);
    }
    consume(current, owner);
    pending.wait();
    current = incoming;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> all_gather_matmul(
    const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
    int64_t gather_dim, bool return_gathered) {
  const int64_t dim = sharded_dim("all_gather_matmul", x, gather_dim);
  check_matmul_operands("all_gather_matmul", x, weight);
  comm::Ring ring(group_name);
  const int64_t n = ring.size();
  const auto shard = x.contiguous();
  const auto shape = block_shape(shard, dim, 1);
  const int64_t out_features = weight.size(0);

  auto out_sizes = shard.sizes().vec();
  out_sizes[dim] *= n;
  auto gathered_sizes = out_sizes;
  out_sizes.back() = out_features;
  auto out = at::empty(out_sizes, shard.options());
  const auto out_blocks = out.view({shape.outer, n * shape.rows, out_features});
  auto gathered = at::empty(return_gathered ? gathered_sizes : std::vector<int64_t>{0}, shard.options());

  const auto weight_t = weight.t();
  for_each_gathered_block(ring, shard, [&](const at::Tensor& block, int64_t owner) {
    const auto rows = block.view({shape.outer * shape.rows, shape.features});
    matmul_into(out_blocks.narrow(1, owner * shape.rows, shape.rows), rows, weight_t);
    if (return_gathered) {
      gathered.view({shape.outer, n * shape.rows, shape.features})
          .narrow(1, owner * shape.rows, shape.rows)
          .copy_(block.view({shape.outer, shape.rows, shape.features}));
    }
  });
  return {out, gathered};
}

at::Tensor matmul_reduce_scatter(
    const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
    int64_t scatter_dim) {
  const int64_t dim = sharded_dim("matmul_reduce_scatter", x, scatter_dim);
  check_matmul_operands("matmul_reduce_scatter", x, weight);
  comm::Ring ring(group_name);
  const int n = ring.size();
  TORCH_CHECK(
      x.size(dim) % n == 0, "matmul_reduce_scatter: x.size(", dim, ")=", x.size(dim),
      " must be divisible by the group size ", n);
  const auto input = x.contiguous();
  const auto shape = block_shape(input, dim, n);
  const int64_t out_features = weight.size(0);
  const auto in_blocks = input.view({shape.outer, n * shape.rows, shape.features});
  const auto weight_t = weight.t();

  // Step s works on block (rank - s - 1) mod n and adds the running sum that
  // arrives from the previous rank; the last step's block is this rank's own.
  auto block_product = [&](int step, at::Tensor& into) {
    const int64_t block = ((ring.rank() - step - 1) % n + n) % n;
    const auto rows = in_blocks.narrow(1, block * shape.rows, shape.rows)
                          .reshape({shape.outer * shape.rows, shape.features});
    at::mm_out(into, rows, weight_t);
  };
  // Two running-sum buffers in the output's shape (the last one written is
  // returned as is), seen as [rows, out] matrices.
  auto out_sizes = input.sizes().vec();
  out_sizes[dim] /= n;
  out_sizes.back() = out_features;
  const auto options = input.options();
  at::Tensor sums[2] = {at::empty(out_sizes, options), at::empty(out_sizes, options)};
  at::Tensor sum_rows[2] = {sums[0].view({-1, out_features}), sums[1].view({-1, out_features})};
  at::Tensor incoming = n > 1 ? at::empty_like(sum_rows[0]) : at::Tensor();
  int current = 0;
  block_product(0, sum_rows[current]);
  for (int step = 1; step < n; ++step) {
    auto pending = ring.exchange(sum_rows[current], incoming, step);
    auto& next = sum_rows[1 - current];
    block_product(step, next);
    pending.wait();
    next.add_(incoming);
    current = 1 - current;
  }
  return sums[current];
}

at::Tensor all_gather_weight_grad(
    const at::Tensor& dense, const at::Tensor& shard, c10::string_view group_name,
    int64_t gather_dim) {
  const int64_t dim = sharded_dim("all_gather_weight_grad", shard, gather_dim);
  check_same_kind("all_gather_weight_grad", dense, "dense", shard, "shard");
  comm::Ring ring(group_name);
  const int64_t n = ring.size();
  TORCH_CHECK(
      dense.dim() == shard.dim(), "all_gather_weight_grad: dense and shard must have the same number ",
      "of dims, got shapes ", dense.sizes(), " and ", shard.sizes());
  for (int64_t d = 0; d < shard.dim() - 1; ++d) {
    const int64_t expected = d == dim ? shard.size(d) * n : shard.size(d);
    TORCH_CHECK(
        dense.size(d) == expected, "all_gather_weight_grad: dense.size(", d, ")=", dense.size(d),
        " must be ", expected, " for shard shape ", shard.sizes(), " gathered over ", n, " ranks on dim ",
        dim);
  }
  const auto shard_c = shard.contiguous();
  const auto shape = block_shape(shard_c, dim, 1);
  const int64_t a = dense.size(-1);
  const auto dense_blocks = dense.contiguous().view({shape.outer, n * shape.rows, a});
  // Half-precision inputs accumulate the n block products in fp32.
  const bool reduced = at::isReducedFloatingType(dense.scalar_type());
  auto acc = at::zeros({a, shape.features}, dense.options().dtype(reduced ? at::kFloat : dense.scalar_type()));
  for_each_gathered_block(ring, shard_c, [&](const at::Tensor& block, int64_t owner) {
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

TORCH_LIBRARY_IMPL(tdx, CPU, m) {
  m.impl("all_gather_matmul", &all_gather_matmul);
  m.impl("matmul_reduce_scatter", &matmul_reduce_scatter);
  m.impl("all_gather_weight_grad", &all_gather_weight_grad);
}

}  // namespace tdx::ops
