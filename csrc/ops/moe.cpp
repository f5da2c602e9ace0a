// Mixture-of-experts token exchange and permutation, host side for every device.
//
// moe_dispatch sends each token to the ranks of the expert-parallel group that
// hold one of its chosen experts, once per rank however many of its experts live
// there (DeepEP's rule), with the token's slots re-addressed to that rank's local
// experts (and the slots of other ranks' experts blanked: expert -1, weight 0).
// moe_combine sends rows back and sums each token's rows from the ranks in rank
// order, in the accumulator type. They are each other's adjoints.
//
// Dropless (rows_per_rank = -1): one small all-to-all of counts (rows and slots
// per local expert, per rank pair) precedes the rows; the counts come back to the
// host in one copy and size everything after it. Capacity mode (rows_per_rank
// >= 0): every rank pair exchanges exactly rows_per_rank rows, padded with zero
// rows whose slots are blank: static shapes, no copy to the host. The caller
// keeps the rows a rank sends to each rank within rows_per_rank (MoE caps the
// tokens per (rank, expert) pair, so at most capacity x experts per rank).
//
// The tokens sent to rank r are this rank's tokens with an expert on r, in
// increasing token order; both ops derive that order from expert_ids.

#include <ATen/ATen.h>

#include <limits>

#include "comm/agreement.h"
#include "comm/all_to_all.h"
#include "comm/group.h"
#include "kernels/moe.h"
#include "ops/device.h"
#include "ops/index_checks.h"

namespace tdx::ops {
namespace {

constexpr const char* kDispatch = "moe_dispatch";
constexpr const char* kCombine = "moe_combine";
constexpr const char* kPermute = "moe_permute";
constexpr const char* kUnpermute = "moe_unpermute";
constexpr const char* kUnpermuteBwd = "moe_unpermute_bwd";
constexpr const char* kGroupedMm = "moe_grouped_mm";
constexpr const char* kGroupedMmWgrad = "moe_grouped_mm_wgrad";

using kernels::MoeKernels;

void check_expert_ids_layout(const char* op, const at::Tensor& expert_ids, int64_t tokens) {
  TORCH_CHECK(
      expert_ids.dim() == 2 && expert_ids.size(0) == tokens, op, ": expert_ids must be [tokens=", tokens,
      ", top_k], got ", expert_ids.sizes());
  TORCH_CHECK_TYPE(expert_ids.scalar_type() == at::kLong, op, ": expert_ids must be int64, got ",
                   expert_ids.scalar_type());
}

// Raises the ValueError that names the first expert id out of [-1, num_experts).
void raise_bad_expert_id(const char* op, const at::Tensor& expert_ids, int64_t num_experts) {
  const auto bad = (expert_ids < -1) | (expert_ids >= num_experts);
  const int64_t at = bad.reshape(-1).nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(
      false, op, ": every expert id must lie in [0, num_experts=", num_experts, ") or be -1 (dropped); ",
      "expert_ids (flattened) [", at, "] = ", expert_ids.reshape(-1)[at].item<int64_t>());
}

void check_expert_ids(const char* op, const at::Tensor& expert_ids, int64_t tokens, int64_t num_experts) {
  check_expert_ids_layout(op, expert_ids, tokens);
  if (index_checks_enabled() && expert_ids.numel() > 0 &&
      ((expert_ids < -1) | (expert_ids >= num_experts)).any().item<bool>()) {
    raise_bad_expert_id(op, expert_ids, num_experts);
  }
}

int64_t group_checked(const char* op, const c10d::ProcessGroup& group, int64_t num_experts, int64_t rows_per_rank) {
  const int64_t n = group.getSize();
  TORCH_CHECK_VALUE(
      num_experts > 0 && num_experts % n == 0, op, ": num_experts=", num_experts,
      " must be a positive multiple of the group size ", n);
  TORCH_CHECK_VALUE(rows_per_rank >= -1, op, ": rows_per_rank must be -1 (dropless) or >= 0, got ", rows_per_rank);
  return n;
}

// [tokens, n]: the row of the send buffer carrying each token to each rank, or -1. Rank r's block holds
// rows [sum of rows[:r], sum of rows[:r + 1]).
at::Tensor route(const char* op, const at::Tensor& expert_ids, int64_t experts_per_rank,
                 const std::vector<int64_t>& rows) {
  const int64_t ranks = static_cast<int64_t>(rows.size());
  std::vector<int64_t> bounds(2 * ranks);  // starts, then ends
  for (int64_t r = 0, first = 0; r < ranks; ++r) {
    bounds[r] = first;
    first += rows[r];
    bounds[ranks + r] = first;
  }
  const auto device_bounds = at::tensor(bounds, expert_ids.options().device(at::kCPU)).to(expert_ids.device());
  auto send_rows = at::empty({expert_ids.size(0), ranks}, expert_ids.options());
  const kernels::RouteTokensArgs args{expert_ids.data_ptr<int64_t>(), expert_ids.size(0), expert_ids.size(1), ranks,
                                      experts_per_rank, device_bounds.data_ptr<int64_t>(),
                                      device_bounds.data_ptr<int64_t>() + ranks, send_rows.data_ptr<int64_t>()};
  launch(kernels_for<MoeKernels>(op, expert_ids.device()).route_tokens, args, expert_ids.device(), ranks, 1);
  return send_rows;
}

int64_t row_grain(int64_t dim) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, dim)); }

// [n, 1 + experts_per_rank]: per rank, the rows this rank sends it and the slots per expert of it. An id out
// of range (index checks off) goes nowhere: moe_combine makes its token NaN.
at::Tensor send_counts(const at::Tensor& expert_ids, int64_t ranks, int64_t num_experts) {
  const auto valid = (expert_ids >= 0) & (expert_ids < num_experts);
  const auto destinations = at::where(valid, at::div(expert_ids, num_experts / ranks, "floor"), -1);
  const auto present = (destinations.unsqueeze(-1) == at::arange(ranks, expert_ids.options())).any(1);
  auto slots = at::zeros({num_experts + 1}, expert_ids.options());
  slots.scatter_add_(0, at::where(valid, expert_ids, num_experts).reshape(-1), at::ones_like(expert_ids).reshape(-1));
  return at::cat({present.sum(0).unsqueeze(1), slots.narrow(0, 0, num_experts).view({ranks, -1})}, 1);
}

std::vector<int64_t> column(const at::Tensor& counts, int64_t side) {
  const auto rows = counts.select(0, side).select(1, 0).contiguous();
  return {rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + rows.numel()};
}

// Capacity mode: raises unless the rows this rank sends each rank fit in rows_per_rank.
void check_rows_fit(const at::Tensor& expert_ids, int64_t ranks, int64_t num_experts, int64_t rows_per_rank) {
  const auto rows = send_counts(expert_ids, ranks, num_experts).select(1, 0).cpu();
  for (int64_t r = 0; r < ranks; ++r) {
    TORCH_CHECK_VALUE(
        rows[r].item<int64_t>() <= rows_per_rank, kDispatch, ": this rank sends ", rows[r].item<int64_t>(),
        " rows to rank ", r, ", more than rows_per_rank=", rows_per_rank, " (capacity mode drops nothing: the ",
        "caller keeps each (rank, expert) pair within its capacity; torchdist_ext.set_index_checks(False) skips ",
        "this check: such tokens then come out NaN)");
  }
}

void check_weights_finite(const at::Tensor& weights) {
  if (weights.numel() == 0 || !weights.isnan().any().item<bool>()) return;
  const int64_t at = weights.isnan().reshape(-1).nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(
      false, kDispatch, ": the router weights hold NaN, at (flattened) [", at, "]: the router's input or gate ",
      "weight holds NaN or inf (torchdist_ext.set_index_checks(False) skips this check)");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_dispatch(
    const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights, int64_t num_experts,
    int64_t rows_per_rank, c10::string_view group_name, const std::optional<at::Tensor>& given_counts) {
  auto group = comm::group_by_name(group_name);
  const int64_t n = group->getSize();
  comm::Agreement call(kDispatch);
  call.tensor("x", x, /*from_dim=*/1).tensor("expert_ids", expert_ids, 1).value("num_experts", num_experts);
  call.value("rows_per_rank", rows_per_rank).flag("counts given", given_counts.has_value());
  call.check(*group, x.device(), [&] {
    TORCH_CHECK(x.dim() == 2, kDispatch, ": x must be [tokens, dim], got ", x.sizes());
    element_type(kDispatch, x.scalar_type());
    group_checked(kDispatch, *group, num_experts, rows_per_rank);
    check_expert_ids(kDispatch, expert_ids, x.size(0), num_experts);
    TORCH_CHECK(weights.sizes() == expert_ids.sizes(), kDispatch, ": weights ", weights.sizes(),
                " must have expert_ids' shape ", expert_ids.sizes());
    TORCH_CHECK_TYPE(
        weights.scalar_type() == accumulation_dtype(x.scalar_type()), kDispatch, ": weights must be ",
        accumulation_dtype(x.scalar_type()), " for ", x.scalar_type(), " tokens, got ", weights.scalar_type());
    TORCH_CHECK(x.device() == expert_ids.device() && x.device() == weights.device(), kDispatch,
                ": x, expert_ids and weights must be on one device");
    if (index_checks_enabled() && !given_counts.has_value()) {  // given counts: moe_combine's backward
      check_weights_finite(weights);
      if (rows_per_rank >= 0) check_rows_fit(expert_ids, n, num_experts, rows_per_rank);
    }
  });
  const int64_t experts_per_rank = num_experts / n;

  at::Tensor counts;  // [2 (sent, received), n, 1 + experts_per_rank], on the host
  if (given_counts.has_value()) {
    counts = given_counts->clone();
  } else if (rows_per_rank >= 0) {
    counts = at::full({2, n, 1 + experts_per_rank}, -1, at::TensorOptions().dtype(at::kLong));
    counts.select(2, 0).fill_(rows_per_rank);
  } else {
    const auto sent = send_counts(expert_ids, n, num_experts);
    const auto received = comm::all_to_all_equal_blocks(*group, kDispatch, "token counts", sent);
    counts = at::stack({sent, received}).cpu();  // the one copy to the host
  }
  TORCH_CHECK(counts.sizes() == at::IntArrayRef({2, n, 1 + experts_per_rank}), kDispatch, ": counts must be [2, ", n,
              ", ", 1 + experts_per_rank, "], got ", counts.sizes());

  const auto sent_rows = column(counts, 0);
  int64_t total = 0;
  for (const int64_t rows : sent_rows) total += rows;
  const auto ids = expert_ids.contiguous();
  const auto send_rows = route(kDispatch, ids, experts_per_rank, sent_rows);
  // Capacity mode pads each rank's block: zero rows with blank slots. Dropless fills every row of counts
  // it made itself; given counts are zero-filled first, so no row goes out unwritten.
  const bool padded = rows_per_rank >= 0 || given_counts.has_value();
  const int64_t k = ids.size(1);
  auto rows = padded ? at::zeros({total, x.size(1)}, x.options()) : at::empty({total, x.size(1)}, x.options());
  auto local_experts = padded ? at::full({total, k}, -1, ids.options()) : at::empty({total, k}, ids.options());
  auto row_weights = padded ? at::zeros({total, k}, weights.options()) : at::empty({total, k}, weights.options());
  const auto tokens = x.contiguous();
  const auto token_weights = weights.contiguous();
  const kernels::PackRowsArgs pack{
      {element_type(kDispatch, x.scalar_type()), x.size(0), k, x.size(1), n, experts_per_rank,
       ids.data_ptr<int64_t>(), send_rows.data_ptr<int64_t>()},
      tokens.data_ptr(), token_weights.data_ptr(), rows.data_ptr(), local_experts.data_ptr<int64_t>(),
      row_weights.data_ptr()};
  launch(kernels_for<MoeKernels>(kDispatch, x.device()).pack_rows, pack, x.device(), x.size(0), row_grain(x.size(1)));
  auto received = comm::all_to_all_rows(*group, kDispatch, "tokens", {rows, local_experts, row_weights}, sent_rows,
                                        column(counts, 1));
  return {received[0], received[1], received[2], counts};
}

std::tuple<at::Tensor, at::Tensor> moe_combine(const at::Tensor& y, const std::optional<at::Tensor>& weights,
                                               const at::Tensor& expert_ids, const at::Tensor& counts,
                                               int64_t num_experts, int64_t rows_per_rank,
                                               c10::string_view group_name) {
  auto group = comm::group_by_name(group_name);
  const int64_t n = group->getSize();
  comm::Agreement call(kCombine);
  call.tensor("y", y, /*from_dim=*/1).tensor("expert_ids", expert_ids, expert_ids.dim() - 1);
  call.flag("weights given", weights.has_value()).value("num_experts", num_experts);
  call.value("rows_per_rank", rows_per_rank).check(*group, y.device(), [&] {
    TORCH_CHECK(y.dim() == 2, kCombine, ": y must be [rows, dim], got ", y.sizes());
    element_type(kCombine, y.scalar_type());
    TORCH_CHECK(expert_ids.dim() >= 2, kCombine, ": expert_ids must be [..., top_k], got ", expert_ids.sizes());
    if (weights.has_value()) {
      TORCH_CHECK(
          weights->dim() == 2 && weights->size(0) == y.size(0) && weights->size(1) == expert_ids.size(-1),
          kCombine, ": weights ", weights->sizes(), " must be [rows of y = ", y.size(0), ", top_k = ",
          expert_ids.size(-1), "]");
      TORCH_CHECK_TYPE(
          weights->scalar_type() == accumulation_dtype(y.scalar_type()), kCombine, ": weights must be ",
          accumulation_dtype(y.scalar_type()), " for ", y.scalar_type(), " rows, got ", weights->scalar_type());
    }
    TORCH_CHECK(y.device() == expert_ids.device() && (!weights.has_value() || weights->device() == y.device()),
                kCombine, ": y, weights and expert_ids must be on one device");
    group_checked(kCombine, *group, num_experts, rows_per_rank);
    TORCH_CHECK(counts.dim() == 3 && counts.size(0) == 2 && counts.size(1) == n && counts.device().is_cpu(),
                kCombine, ": counts must be moe_dispatch's [2, ", n, ", 1 + experts per rank] host tensor, got ",
                counts.sizes());
    int64_t delivered = 0;
    for (const int64_t rows : column(counts, 1)) delivered += rows;
    TORCH_CHECK(y.size(0) == delivered, kCombine, ": y has ", y.size(0), " rows; moe_dispatch delivered ",
                delivered);
  });
  auto token_shape = expert_ids.sizes().vec();
  token_shape.back() = y.size(1);  // out: the tokens' leading dims, then the rows' width
  const auto ids = expert_ids.reshape({-1, expert_ids.size(-1)});
  const auto received_rows = column(counts, 1);

  const auto slots = ids.contiguous();
  const auto send_rows = route(kCombine, slots, num_experts / n, column(counts, 0));
  std::vector<at::Tensor> sends{y.contiguous()};
  if (weights.has_value()) sends.push_back(weights->contiguous());
  const auto back = comm::all_to_all_rows(*group, kCombine, "expert outputs", sends, received_rows, column(counts, 0));
  // Each token's rows are added in rank order, so the sums are the same run to run on every device.
  // The outputs are allocated in their final shapes (fresh tensors, not views).
  auto out = at::empty(token_shape, y.options());
  auto out_weights = at::empty(weights.has_value() ? expert_ids.sizes() : at::IntArrayRef({0, ids.size(1)}),
                               y.options().dtype(accumulation_dtype(y.scalar_type())));
  const kernels::SumRowsArgs sum{
      {element_type(kCombine, y.scalar_type()), slots.size(0), slots.size(1), y.size(1), n, num_experts / n,
       slots.data_ptr<int64_t>(), send_rows.data_ptr<int64_t>()},
      back[0].data_ptr(), weights.has_value() ? back[1].data_ptr() : nullptr, out.data_ptr(), out_weights.data_ptr()};
  launch(kernels_for<MoeKernels>(kCombine, y.device()).sum_rows, sum, y.device(), slots.size(0), row_grain(y.size(1)));
  return {out, out_weights};
}

void check_slots(const char* op, const at::Tensor& positions, const std::optional<at::Tensor>& weights,
                 const at::Tensor& rows) {
  const c10::ScalarType type = rows.scalar_type();
  TORCH_CHECK(positions.dim() == 2, op, ": positions must be [rows, top_k], got ", positions.sizes());
  TORCH_CHECK(positions.device() == rows.device() && (!weights.has_value() || weights->device() == rows.device()),
              op, ": positions and weights must be on the rows' device ", rows.device());
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong, op, ": positions must be int64, got ",
                   positions.scalar_type());
  if (weights.has_value()) {
    TORCH_CHECK(weights->sizes() == positions.sizes(), op, ": weights ", weights->sizes(),
                " must have the shape of positions ", positions.sizes());
    TORCH_CHECK_TYPE(weights->scalar_type() == accumulation_dtype(type), op, ": weights must be ",
                     accumulation_dtype(type), " for ", type, " rows, got ", weights->scalar_type());
  }
}

// Every position names a row of `rows` rows, none (-1), or moe_permute's kInvalidSlot (a slot whose expert
// id was out of range with index checks off: its row comes out NaN). Under index checks another one raises;
// without them it becomes kInvalidSlot as well, never a read out of bounds.
at::Tensor checked_positions(const char* op, const at::Tensor& positions, int64_t rows) {
  if (positions.numel() == 0) return positions;
  const auto bad = ((positions < -1) & (positions != kernels::kInvalidSlot)) | (positions >= rows);
  if (!index_checks_enabled()) return at::where(bad, kernels::kInvalidSlot, positions);
  if (!bad.any().item<bool>()) return positions;
  const int64_t at = bad.reshape(-1).nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(
      false, op, ": every position must name a row of sorted (0 <= position < ", rows, ") or be -1 (none) or ",
      kernels::kInvalidSlot, " (moe_permute's invalid slot); ",
      "positions (flattened) [", at, "] = ", positions.reshape(-1)[at].item<int64_t>(),
      " (torchdist_ext.set_index_checks(False) skips this check: such rows then come out NaN)");
}

kernels::SlotRows slot_rows(const char* op, const at::Tensor& rows_like, const at::Tensor& positions,
                            const at::Tensor& weights) {
  return {element_type(op, rows_like.scalar_type()), positions.size(0), positions.size(1), rows_like.size(1),
          positions.data_ptr<int64_t>(), weights.defined() ? weights.data_ptr() : nullptr};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_permute(const at::Tensor& x, const at::Tensor& expert_ids,
                                                           const at::Tensor& tokens_per_expert, int64_t num_experts,
                                                           int64_t capacity) {
  TORCH_CHECK(x.dim() == 2, kPermute, ": x must be [rows, dim], got ", x.sizes());
  element_type(kPermute, x.scalar_type());
  check_expert_ids_layout(kPermute, expert_ids, x.size(0));  // their values: once the kernels are enqueued
  TORCH_CHECK(expert_ids.device() == x.device(), kPermute, ": expert_ids must be on x's device ", x.device(),
              ", got ", expert_ids.device());
  TORCH_CHECK_VALUE(num_experts > 0, kPermute, ": num_experts must be positive, got ", num_experts);
  TORCH_CHECK_VALUE(capacity >= -1, kPermute, ": capacity must be -1 (dropless) or >= 0, got ", capacity);
  const auto device_longs = expert_ids.options();
  int64_t sorted_rows;
  at::Tensor segments;  // dropless: [2, E] each expert's first row and one past its last, on x's device
  if (capacity >= 0) {
    sorted_rows = num_experts * capacity;
  } else {
    TORCH_CHECK(
        tokens_per_expert.dim() == 1 && tokens_per_expert.size(0) == num_experts && tokens_per_expert.is_cpu() &&
            tokens_per_expert.scalar_type() == at::kLong,
        kPermute, ": dropless, tokens_per_expert must be a host int64 [num_experts=", num_experts, "], got ",
        tokens_per_expert.sizes(), " ", tokens_per_expert.scalar_type(), " on ", tokens_per_expert.device());
    // Pinned for a GPU: the one host-to-device copy does not wait for the device's queue.
    auto host_segments = at::empty({2, num_experts}, at::TensorOptions(at::kLong).pinned_memory(!x.is_cpu()));
    const auto counts = tokens_per_expert.contiguous();
    const int64_t* count = counts.data_ptr<int64_t>();
    int64_t* first = host_segments.data_ptr<int64_t>();
    sorted_rows = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      TORCH_CHECK_VALUE(count[e] >= 0, kPermute, ": tokens_per_expert must be >= 0, got ", tokens_per_expert);
      first[e] = sorted_rows;
      sorted_rows += count[e];
      first[num_experts + e] = sorted_rows;
    }
    segments = x.is_cpu() ? host_segments : host_segments.to(x.device(), /*non_blocking=*/true);
  }
  TORCH_CHECK_VALUE(sorted_rows <= std::numeric_limits<int32_t>::max(), kPermute, ": ", sorted_rows,
                    " sorted rows do not fit the int32 offsets of the grouped GEMM");
  const auto ids = expert_ids.contiguous();
  auto positions = at::empty(ids.sizes(), device_longs);
  const auto& table = kernels_for<MoeKernels>(kPermute, x.device());
  // A slot past its expert's segment (tokens_per_expert short of the ids' counts) is dropped, never written
  // out of bounds; sort_slots zeroes the rows no slot fills (capacity padding, or counts too large).
  const auto rows = x.contiguous();
  auto sorted = at::empty({sorted_rows, x.size(1)}, x.options());
  const int64_t* first_rows = segments.defined() ? segments.data_ptr<int64_t>() : nullptr;
  auto scratch = at::empty({x.is_cpu() ? 0 : kernels::sort_scratch_size(ids.numel(), num_experts)}, device_longs);
  auto offsets = at::empty({num_experts}, device_longs.dtype(at::kInt));
  const kernels::SortSlotsArgs sort{ids.data_ptr<int64_t>(),
                                    ids.size(0),
                                    ids.size(1),
                                    num_experts,
                                    capacity,
                                    first_rows,
                                    first_rows == nullptr ? nullptr : first_rows + num_experts,
                                    positions.data_ptr<int64_t>(),
                                    sorted.data_ptr(),
                                    x.size(1) * static_cast<int64_t>(x.element_size()),
                                    scratch.data_ptr<int64_t>(),
                                    offsets.data_ptr<int32_t>()};
  launch(table.sort_slots, sort, x.device(), num_experts, 1);
  const kernels::ScatterRowsArgs scatter{slot_rows(kPermute, rows, positions, at::Tensor()), rows.data_ptr(),
                                         sorted.data_ptr()};
  launch(table.scatter_rows, scatter, x.device(), x.size(0), row_grain(x.size(1)));
  // sort_slots marks an id out of range kInvalidSlot, the least position: one reduction and one wait for the
  // device, after the work is enqueued.
  if (index_checks_enabled() && positions.numel() > 0 && positions.min().item<int64_t>() == kernels::kInvalidSlot) {
    raise_bad_expert_id(kPermute, expert_ids, num_experts);
  }
  return {sorted, positions, offsets};
}

at::Tensor moe_unpermute(const at::Tensor& sorted, const at::Tensor& positions,
                         const std::optional<at::Tensor>& weights) {
  TORCH_CHECK(sorted.dim() >= 2, kUnpermute, ": sorted must be [sorted rows, dim] (or [experts, capacity, dim]), got ",
              sorted.sizes());
  element_type(kUnpermute, sorted.scalar_type());
  check_slots(kUnpermute, positions, weights, sorted);
  const auto rows = sorted.reshape({-1, sorted.size(-1)}).contiguous();
  const auto w = weights.has_value() ? weights->contiguous() : at::Tensor();
  const auto slots = checked_positions(kUnpermute, positions, rows.size(0)).contiguous();
  auto y = at::empty({positions.size(0), rows.size(1)}, sorted.options());
  const kernels::GatherSumRowsArgs args{slot_rows(kUnpermute, rows, slots, w), rows.data_ptr(), y.data_ptr()};
  launch(kernels_for<MoeKernels>(kUnpermute, sorted.device()).gather_sum_rows, args, sorted.device(),
         positions.size(0), row_grain(rows.size(1)));
  return y;
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_bwd(const at::Tensor& grad, const at::Tensor& sorted,
                                                     const at::Tensor& positions,
                                                     const std::optional<at::Tensor>& weights) {
  TORCH_CHECK(
      grad.dim() == 2 && sorted.dim() >= 2 && grad.size(0) == positions.size(0) && grad.size(1) == sorted.size(-1),
      kUnpermuteBwd, ": grad ", grad.sizes(), " must be [rows of positions, dim of sorted ", sorted.sizes(), "]");
  TORCH_CHECK_TYPE(grad.scalar_type() == sorted.scalar_type(), kUnpermuteBwd, ": grad and sorted must have one dtype");
  element_type(kUnpermuteBwd, grad.scalar_type());
  check_slots(kUnpermuteBwd, positions, weights, grad);
  const auto g = grad.contiguous();
  const auto rows = sorted.contiguous();  // its leading dims are rows (sorted may be [experts, capacity, dim])
  const int64_t sorted_rows = c10::multiply_integers(rows.sizes().slice(0, rows.dim() - 1));
  const auto slots = checked_positions(kUnpermuteBwd, positions, sorted_rows).contiguous();
  const auto w = weights.has_value() ? weights->contiguous() : at::Tensor();
  const auto& table = kernels_for<MoeKernels>(kUnpermuteBwd, grad.device());
  const int64_t grain = row_grain(grad.size(1));
  auto grad_sorted = at::zeros_like(rows);
  const kernels::ScatterRowsArgs scatter{slot_rows(kUnpermuteBwd, g, slots, w), g.data_ptr(), grad_sorted.data_ptr()};
  launch(table.scatter_rows, scatter, grad.device(), positions.size(0), grain);
  at::Tensor grad_weights;
  if (w.defined()) {
    grad_weights = at::empty(slots.sizes(), w.options());
    const kernels::SlotDotsArgs dots{slot_rows(kUnpermuteBwd, g, slots, w), g.data_ptr(), rows.data_ptr(),
                                     grad_weights.data_ptr()};
    launch(table.slot_dots, dots, grad.device(), positions.size(0), grain);
  } else {
    grad_weights = at::empty({0}, grad.options().dtype(accumulation_dtype(grad.scalar_type())));
  }
  return {grad_sorted, grad_weights};
}

// The experts' segments of `rows` rows: host int64 [E] summing to rows.
std::vector<int64_t> segments(const char* op, const at::Tensor& tokens_per_expert, int64_t experts, int64_t rows) {
  TORCH_CHECK(
      tokens_per_expert.dim() == 1 && tokens_per_expert.size(0) == experts && tokens_per_expert.is_cpu() &&
          tokens_per_expert.scalar_type() == at::kLong,
      op, ": tokens_per_expert must be a host int64 [experts=", experts, "], got ", tokens_per_expert.sizes(), " ",
      tokens_per_expert.scalar_type(), " on ", tokens_per_expert.device());
  const auto counts = tokens_per_expert.contiguous();
  std::vector<int64_t> sizes(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + experts);
  int64_t total = 0;
  for (const int64_t size : sizes) {
    TORCH_CHECK_VALUE(size >= 0, op, ": tokens_per_expert must be >= 0, got ", size);
    total += size;
  }
  TORCH_CHECK(total == rows, op, ": tokens_per_expert sums to ", total, ", but there are ", rows, " rows");
  return sizes;
}

// out [A, N]: rows of expert e times weight[e].T (weight [E, N, K], x [A, K] expert-major).
at::Tensor moe_grouped_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert) {
  TORCH_CHECK(
      x.dim() == 2 && weight.dim() == 3 && weight.size(2) == x.size(1), kGroupedMm, ": x ", x.sizes(),
      " must be [rows, K] and weight ", weight.sizes(), " [experts, N, K]");
  TORCH_CHECK_TYPE(x.scalar_type() == weight.scalar_type(), kGroupedMm, ": x and weight must have one dtype, got ",
                   x.scalar_type(), " and ", weight.scalar_type());
  const auto sizes = segments(kGroupedMm, tokens_per_expert, weight.size(0), x.size(0));
  auto out = at::empty({x.size(0), weight.size(1)}, x.options());
  int64_t first = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    auto rows = out.narrow(0, first, sizes[e]);
    at::mm_out(rows, x.narrow(0, first, sizes[e]), weight[e].t());
    first += sizes[e];
  }
  return out;
}

// [E, N, K]: per expert, grad_e.T @ x_e (zero for an expert without rows).
at::Tensor moe_grouped_mm_wgrad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& tokens_per_expert) {
  TORCH_CHECK(
      grad.dim() == 2 && x.dim() == 2 && grad.size(0) == x.size(0), kGroupedMmWgrad, ": grad ", grad.sizes(),
      " and x ", x.sizes(), " must be [rows, N] and [rows, K]");
  TORCH_CHECK_TYPE(grad.scalar_type() == x.scalar_type(), kGroupedMmWgrad, ": grad and x must have one dtype");
  const int64_t experts = tokens_per_expert.dim() == 1 ? tokens_per_expert.size(0) : 0;
  const auto sizes = segments(kGroupedMmWgrad, tokens_per_expert, experts, x.size(0));
  auto out = at::empty({experts, grad.size(1), x.size(1)}, x.options());
  int64_t first = 0;
  for (int64_t e = 0; e < experts; ++e) {
    auto slice = out[e];
    at::mm_out(slice, grad.narrow(0, first, sizes[e]).t(), x.narrow(0, first, sizes[e]));
    first += sizes[e];
  }
  return out;
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_moe) {
  m.impl("moe_grouped_mm", &moe_grouped_mm);
  m.impl("moe_grouped_mm_wgrad", &moe_grouped_mm_wgrad);
  m.impl("moe_dispatch", &moe_dispatch);
  m.impl("moe_combine", &moe_combine);
  m.impl("moe_permute", &moe_permute);
  m.impl("moe_unpermute", &moe_unpermute);
  m.impl("moe_unpermute_bwd", &moe_unpermute_bwd);
}

}  // namespace tdx::ops
