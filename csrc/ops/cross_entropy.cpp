// Vocab-parallel cross-entropy, host side for every device: argument checks,
// the shard kernels of kernels/cross_entropy.h, and the cross-rank combination
// of per-shard statistics.

#include <ATen/ATen.h>

#include <limits>

#include "comm/agreement.h"
#include "comm/group.h"
#include "kernels/cross_entropy.h"
#include "ops/device.h"
#include "ops/index_checks.h"

namespace tdx::ops {
namespace {

constexpr const char* kForward = "vocab_parallel_cross_entropy_fwd";
constexpr const char* kBackward = "vocab_parallel_cross_entropy_bwd";
constexpr const char* kBackwardInplace = "vocab_parallel_cross_entropy_bwd_";

using kernels::CrossEntropyKernels;

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
  const auto acc = accumulation_dtype(logits.scalar_type());
  TORCH_CHECK_TYPE(
      lse.scalar_type() == acc, op, ": lse must be ", acc, " for ", logits.scalar_type(), " logits, got ",
      lse.scalar_type());
}

// Targets outside [0, vocab_size) that are not ignore_index (flattened to [rows]).
at::Tensor out_of_range(const at::Tensor& target, int64_t vocab_size, int64_t ignore_index) {
  return ((target < 0) | (target >= vocab_size)) & (target != ignore_index);
}

void raise_on_out_of_range(const at::Tensor& bad, const at::Tensor& target, int64_t vocab_size,
                           int64_t ignore_index) {
  if (!bad.any().item<bool>()) return;
  const int64_t position = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(
      false, kForward, ": every target must lie in [0, vocab_size=", vocab_size, ") or equal ignore_index=",
      ignore_index, "; target (flattened) [", position, "] = ", target[position].item<int64_t>(),
      " (torchdist_ext.set_index_checks(False) skips this check: such rows then get a NaN loss)");
}

// Per-row loss and log-sum-exp from every rank's statistics:
// lse = M + log(sum_r s_r * exp(m_r - M)) with M = max_r m_r; the target's
// logit comes from the one rank whose shard holds it (the others give 0).
std::tuple<at::Tensor, at::Tensor> combine_over_ranks(const at::Tensor& stats, c10d::ProcessGroup& group) {
  const int64_t n = group.getSize();
  auto gathered = at::empty({n * stats.size(0), stats.size(1)}, stats.options());
  auto local = stats;
  group._allgather_base(gathered, local)->wait();
  const auto all = gathered.view({n, stats.size(0), stats.size(1)});  // [ranks, 3, rows]
  const auto maxes = all.select(1, 0);
  const auto global_max = std::get<0>(maxes.max(0));
  const auto lse = global_max + at::log((all.select(1, 1) * at::exp(maxes - global_max)).sum(0));
  return {lse - all.select(1, 2).sum(0), lse};
}

std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy_fwd(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start, int64_t vocab_size,
    int64_t ignore_index, c10::string_view group_name, bool /*inplace_backward: autograd's concern*/) {
  auto group = comm::group_by_name(group_name);
  at::Tensor logits_2d, target_1d, bad;
  comm::Agreement call(kForward);
  call.tensor("target", target).text("logits dtype", c10::toString(logits.scalar_type()));
  call.value("vocab_size", vocab_size).value("ignore_index", ignore_index);
  call.check(*group, logits.device(), [&] {
    check_logits_and_target(kForward, logits, target);
    const int64_t vocab_local = logits.size(-1);
    TORCH_CHECK(
        vocab_start >= 0 && vocab_start + vocab_local <= vocab_size, kForward, ": the shard [vocab_start=",
        vocab_start, ", vocab_start + ", vocab_local, ") must lie inside [0, vocab_size=", vocab_size, ")");
    logits_2d = logits.reshape({-1, vocab_local}).contiguous();
    target_1d = target.reshape(-1).contiguous();
    bad = out_of_range(target_1d, vocab_size, ignore_index);
    if (index_checks_enabled()) raise_on_out_of_range(bad, target_1d, vocab_size, ignore_index);
  });
  const int64_t vocab_local = logits.size(-1);

  const int64_t rows = logits_2d.size(0);
  auto stats = at::empty({3, rows}, logits.options().dtype(accumulation_dtype(logits.scalar_type())));
  const kernels::ShardStatsArgs args{{element_type(kForward, logits.scalar_type()), rows, vocab_local, vocab_start},
                                     logits_2d.data_ptr(), target_1d.data_ptr<int64_t>(), stats.data_ptr()};
  launch(kernels_for<CrossEntropyKernels>(kForward, logits.device()).shard_stats, args, logits.device(), rows,
         32768 / std::max<int64_t>(1, vocab_local));

  auto [loss, lse] = combine_over_ranks(stats, *group);
  loss.masked_fill_(target_1d == ignore_index, 0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  loss.masked_fill_(bad, nan);
  lse.masked_fill_(bad, nan);  // and so the row's gradient
  return {loss.to(logits.scalar_type()).view(target.sizes()), lse.view(target.sizes())};
}

// grad_logits [rows, vocab_local] (may be logits_2d itself) from the checked arguments.
void write_grad(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits_2d, const at::Tensor& target,
                const at::Tensor& lse, int64_t vocab_start, int64_t ignore_index, const at::Tensor& grad_logits) {
  const int64_t rows = logits_2d.size(0);
  const int64_t vocab_local = logits_2d.size(1);
  const auto grad_loss_1d = grad_loss.reshape(-1).contiguous();
  const auto target_1d = target.reshape(-1).contiguous();
  const auto lse_1d = lse.reshape(-1).contiguous();
  const kernels::ShardGradArgs args{{element_type(op, logits_2d.scalar_type()), rows, vocab_local, vocab_start},
                                    grad_loss_1d.data_ptr(),
                                    logits_2d.data_ptr(),
                                    target_1d.data_ptr<int64_t>(),
                                    lse_1d.data_ptr(),
                                    ignore_index,
                                    grad_logits.data_ptr()};
  launch(kernels_for<CrossEntropyKernels>(op, logits_2d.device()).shard_grad, args, logits_2d.device(), rows,
         32768 / std::max<int64_t>(1, vocab_local));
}

at::Tensor vocab_parallel_cross_entropy_bwd(const at::Tensor& grad_loss, const at::Tensor& logits,
                                            const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start,
                                            int64_t ignore_index) {
  check_backward_args(kBackward, grad_loss, logits, target, lse);
  const auto logits_2d = logits.reshape({-1, logits.size(-1)}).contiguous();
  auto grad_logits = at::empty_like(logits_2d);
  write_grad(kBackward, grad_loss, logits_2d, target, lse, vocab_start, ignore_index, grad_logits);
  return grad_logits.view(logits.sizes());
}

void vocab_parallel_cross_entropy_bwd_(const at::Tensor& grad_loss, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start,
                                       int64_t ignore_index) {
  check_backward_args(kBackwardInplace, grad_loss, logits, target, lse);
  TORCH_CHECK(logits.is_contiguous(), kBackwardInplace, ": logits must be contiguous to take the gradient in place");
  const auto logits_2d = logits.view({-1, logits.size(-1)});
  write_grad(kBackwardInplace, grad_loss, logits_2d, target, lse, vocab_start, ignore_index, logits_2d);
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_cross_entropy) {
  m.impl("vocab_parallel_cross_entropy_fwd", &vocab_parallel_cross_entropy_fwd);
  m.impl("vocab_parallel_cross_entropy_bwd", &vocab_parallel_cross_entropy_bwd);
  m.impl("vocab_parallel_cross_entropy_bwd_", &vocab_parallel_cross_entropy_bwd_);
}

}  // namespace tdx::ops
