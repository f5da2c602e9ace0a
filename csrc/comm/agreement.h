#pragma once
// The rank-agreement check: before any payload travels, every rank of a group
// shows the others what it is about to do (the op and every argument that must
// agree: shapes, dtypes, flags, scales, orders, counts) and whether its own
// input checks passed. A rank that disagrees, or that refused its input, makes
// every rank raise the same error, naming the argument and two ranks' values,
// or the refusing rank and its message: no rank reinterprets another's bytes,
// and no rank waits out a timeout for a peer that has already raised.
//
// Cost: one all-gather of 4 int64 per checked call (a second, of the fields'
// text, only when something is wrong); on a GPU also a host-to-device and a
// device-to-host copy, and one read of each scalar() field.
// Which calls are checked (TDX_AGREEMENT_CHECKS at start-up, or
// torchdist_ext.set_agreement_checks()):
//   "auto" (default)  every call on the CPU; on other devices the first
//                     kAutoCheckedCalls calls of each op (the first steps)
//   "on"              every call
//   "off"             none: the inputs are still checked on each rank alone
// TORCH_DISTRIBUTED_DEBUG=DETAIL checks every call whatever the mode. Where a
// call is not checked, a rank that refuses its input (an index out of range,
// NaN router weights) raises alone and its peers meet the collective's timeout.
// The check's all-gathers are entered in the communication ledger under
// "agreement_check", apart from the op's traffic.

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/agreement_mode.h"

namespace tdx::comm {

// What one rank is about to run: the op's name and its named fields, in order.
class Agreement {
 public:
  explicit Agreement(const char* op);

  // dtype and shape; dims before `from_dim` are free to differ (shown as *).
  Agreement& tensor(const char* name, const at::Tensor& t, int64_t from_dim = 0);
  // As tensor(), or "none" when absent.
  Agreement& tensor(const char* name, const std::optional<at::Tensor>& t);
  Agreement& value(const char* name, int64_t v);
  Agreement& value(const char* name, double v);
  Agreement& flag(const char* name, bool v);
  Agreement& text(const char* name, c10::string_view v);
  // The value of a one-element tensor, read (on a GPU: copied to the host) only when the call is checked.
  Agreement& scalar(const char* name, const at::Tensor& t);

  // Runs `validate` (this rank's checks of its own inputs). When this call is
  // checked, then makes sure that every rank of `group` passed its checks and
  // describes the same call; else raises on every rank: this rank's own error
  // as it was, another rank's error with the same type and that rank's message,
  // or a ValueError naming the first field two ranks disagree on. `device`:
  // where the group's collectives run (the op's tensors' device).
  void check(c10d::ProcessGroup& group, const at::Device& device,
             const std::function<void()>& validate = nullptr) const;

  // "name=value\n" per field.
  std::string fields() const;

 private:
  const char* op_;
  std::string fields_;
  std::vector<std::pair<const char*, at::Tensor>> scalars_;
};

// The check for callers outside ops (Python layers): `fields` as Agreement's text; `error_kind` (0 none,
// 1 RuntimeError, 2 ValueError, 3 TypeError) and `error` are this rank's own refusal, if any.
void check_agreement(c10d::ProcessGroup& group, const at::Device& device, const std::string& op,
                     const std::string& fields, int error_kind, const std::string& error);

}  // namespace tdx::comm
