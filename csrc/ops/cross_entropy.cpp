#include "ops/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "comm/ring.h"
#include "kernels/cpu/cross_entropy.h"
#include "ops/element_type.h"

namespace tdx::ops {
namespace {

constexpr const char* kForward = "vocab_parallel_cross_entropy";
constexpr const char* kBackward = "vocab_parallel_cross_entropy_backward";
constexpr const char* kBackwardInplace = "vocab_parallel_cross_entropy_backward_";

// fp64 logits keep fp64 statistics; every other dtype accumulates in fp32.
c10::ScalarType stats_dtype(c10::ScalarType logits_dtype) {
  return logits_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

void check_logits_and_target(const char* op, const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.dim() >= 1, op, ": logits must have a vocab dim, got a 0-d tensor");
  element_type(op, logits.scalar_type());
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, op, ": target must be int64, got ", target.scalar_type());
  TORCH_CHECK(
      target.sizes() == logits.sizes().slice(0, logits.dim() - 1), op, ": target shape ", target.sizes(),
      " must equal logits shape without its last dim, ", logits.sizes());
  TORCH_CHECK(
      target.device() == logits.device(), op, ": target and logits must be on the same device, got ",
      target.device(), " and ", logits.device());
}

void check_backward_args(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits,
                         const at::Tensor& target, const at::Tensor& lse) {
  check_logits_and_target(op, logits, target);
  TORCH_CHECK(
      grad_loss.sizes() == target.sizes() && lse.sizes() == target.sizes(), op, ": grad_loss ", grad_loss.sizes(),
      " and lse ", lse.sizes(), " must have the target's shape ", target.sizes());
  TORCH_CHECK_TYPE(
      grad_loss.scalar_type() == logits.scalar_type(), op, ": grad_loss dtype ", grad_loss.scalar_type(),
      " must equal the logits dtype ", logits.scalar_type());
  TORCH_CHECK_TYPE(
      lse.scalar_type() == stats_dtype(logits.scalar_type()), op, ": lse must be ",
      stats_dtype(logits.scalar_type()), " for ", logits.scalar_type(), " logits, got ", lse.scalar_type());
}

// Per-row loss and log-sum-exp from every rank's statistics:
// lse = M + log(sum_r s_r * exp(m_r - M)) with M = max_r m_r; the target's
// logit comes from the one rank whose shard holds it (the others give 0).
std::tuple<at::Tensor, at::Tensor> combine_over_ranks(
    const at::Tensor& stats, const at::Tensor& target, int64_t ignore_index, c10::string_view group_name) {
  auto group = comm::group_by_name(group_name);
  std::vector<at::Tensor> inputs{stats};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group->getSize(); ++r) {
    outputs[0].push_back(at::empty_like(stats));
  }
  group->allgather(outputs, inputs)->wait();
  const auto all = at::stack(outputs[0]);  // [ranks, 3, rows]
  const auto maxes = all.select(1, 0);
  const auto global_max = std::get<0>(maxes.max(0));
  const auto lse = global_max + at::log((all.select(1, 1) * at::exp(maxes - global_max)).sum(0));
  auto loss = lse - all.select(1, 2).sum(0);
  loss.masked_fill_(target.reshape(-1) == ignore_index, 0);
  return {loss, lse};
}

void cpu_shard_stats(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                     at::Tensor& stats) {
  const int64_t rows = logits.size(0);
  const int64_t vocab_local = logits.size(1);
  const auto type = element_type(kForward, logits.scalar_type());
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, vocab_local));
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), kForward, [&] {
    auto* out = stats.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      kernels::cpu::vocab_shard_stats<scalar_t>(
          type, logits.data_ptr(), target.data_ptr<int64_t>(), begin, end, vocab_local, vocab_start, out,
          out + rows, out + 2 * rows);
    });
  });
}

void cpu_shard_grad(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                    const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index, at::Tensor& grad_logits) {
  const int64_t rows = logits.size(0);
  const int64_t vocab_local = logits.size(1);
  const auto type = element_type(kBackward, logits.scalar_type());
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, vocab_local));
  AT_DISPATCH_FLOATING_TYPES(lse.scalar_type(), kBackward, [&] {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      kernels::cpu::vocab_shard_grad<scalar_t>(
          type, grad_loss.data_ptr(), logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr<scalar_t>(),
          begin, end, vocab_local, vocab_start, ignore_index, grad_logits.data_ptr());
    });
  });
}

std::tuple<at::Tensor, at::Tensor> cpu_forward(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start, int64_t vocab_size,
    int64_t ignore_index, c10::string_view group_name, bool /*inplace_backward: autograd's concern*/) {
  // Out-of-range targets are checked here; on CUDA the check would cost a sync.
  if (target.numel() > 0) {
    const auto bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index);
    TORCH_CHECK(
        !bad.any().item<bool>(), kForward, ": every target must lie in [0, vocab_size=", vocab_size,
        ") or equal ignore_index=", ignore_index);
  }
  return vocab_parallel_cross_entropy(
      &cpu_shard_stats, logits, target, vocab_start, vocab_size, ignore_index, group_name);
}

at::Tensor cpu_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                        const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index) {
  return vocab_parallel_cross_entropy_backward(
      &cpu_shard_grad, grad_loss, logits, target, lse, vocab_start, ignore_index);
}

void cpu_backward_inplace(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                          const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index) {
  vocab_parallel_cross_entropy_backward_(&cpu_shard_grad, grad_loss, logits, target, lse, vocab_start,
                                         ignore_index);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy(
    ShardStatsKernel kernel, const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
    int64_t vocab_size, int64_t ignore_index, c10::string_view group_name) {
  check_logits_and_target(kForward, logits, target);
  const int64_t vocab_local = logits.size(-1);
  TORCH_CHECK(
      vocab_start >= 0 && vocab_start + vocab_local <= vocab_size, kForward, ": the shard [vocab_start=",
      vocab_start, ", vocab_start + ", vocab_local, ") must lie inside [0, vocab_size=", vocab_size, ")");
  const auto logits_2d = logits.reshape({-1, vocab_local}).contiguous();
  const auto target_1d = target.reshape(-1).contiguous();
  auto stats = at::empty({3, logits_2d.size(0)}, logits.options().dtype(stats_dtype(logits.scalar_type())));
  kernel(logits_2d, target_1d, vocab_start, stats);
  auto [loss, lse] = combine_over_ranks(stats, target_1d, ignore_index, group_name);
  return {loss.to(logits.scalar_type()).view(target.sizes()), lse.view(target.sizes())};
}

at::Tensor vocab_parallel_cross_entropy_backward(
    ShardGradKernel kernel, const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
    const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index) {
  check_backward_args(kBackward, grad_loss, logits, target, lse);
  const int64_t vocab_local = logits.size(-1);
  const auto logits_2d = logits.reshape({-1, vocab_local}).contiguous();
  auto grad_logits = at::empty_like(logits_2d);
  kernel(grad_loss.reshape(-1).contiguous(), logits_2d, target.reshape(-1).contiguous(),
         lse.reshape(-1).contiguous(), vocab_start, ignore_index, grad_logits);
  return grad_logits.view(logits.sizes());
}

void vocab_parallel_cross_entropy_backward_(
    ShardGradKernel kernel, const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
    const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index) {
  check_backward_args(kBackwardInplace, grad_loss, logits, target, lse);
  TORCH_CHECK(logits.is_contiguous(), kBackwardInplace, ": logits must be contiguous to take the gradient in place");
  auto logits_2d = logits.view({-1, logits.size(-1)});
  kernel(grad_loss.reshape(-1).contiguous(), logits_2d, target.reshape(-1).contiguous(),
         lse.reshape(-1).contiguous(), vocab_start, ignore_index, logits_2d);
}

TORCH_LIBRARY_IMPL(tdx, CPU, m) {
  m.impl("vocab_parallel_cross_entropy", &cpu_forward);
  m.impl("vocab_parallel_cross_entropy_backward", &cpu_backward);
  m.impl("vocab_parallel_cross_entropy_backward_", &cpu_backward_inplace);
}

}  // namespace tdx::ops
