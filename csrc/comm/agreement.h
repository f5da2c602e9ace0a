#pragma once
// A debug check that every rank of a group is about to make the same exchange.
//
// Point-to-point rings and all-to-alls move raw bytes: if ranks disagree on a
// tensor's shape, or on a dtype of the same size, the receiver reinterprets the
// sender's bytes silently. With TORCH_DISTRIBUTED_DEBUG=DETAIL (the setting
// under which c10d checks its own collectives' shapes) the comm layer first
// all-gathers a fingerprint of the exchange (the op's name, the tensor's dtype
// and shape) and raises on every rank, naming this rank's values and those of
// the first rank that differs. At any other debug level the check costs nothing.
//
// It lives here, in the ops' comm layer, and not in the communication ledger's
// c10d backend (comm/ledger_backend.h), which also sees every exchange: the
// check must hold whether or not a run counts its traffic, it compares what
// the ranks are about to exchange as a whole (one all-gather before a ring of
// many sends), and a backend would have to check each receive against its
// sender's fingerprint by waiting inside an asynchronous irecv, which under
// NCCL's grouped point-to-point calls would deadlock.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace tdx::comm {

// True when the agreement check runs (TORCH_DISTRIBUTED_DEBUG=DETAIL).
bool checking_agreement();

// Under checking_agreement(): raises unless every rank of `group` passes the
// same `op` and a tensor of `exchanged`'s dtype and shape, from dim `from_dim`
// on (1: the number of rows may differ, as in an all-to-all-v). `what` names
// the tensor in the message (e.g. "k/v block").
void check_ranks_agree(c10d::ProcessGroup& group, const char* op, const char* what, const at::Tensor& exchanged,
                       int64_t from_dim = 0);

}  // namespace tdx::comm
