#pragma once
// The Python face of the ledger backend (comm/ledger_backend.cpp), added to
// torchdist_ext._C when it loads:
//   ledger_backend(inner: Backend, name: str) -> Backend   wraps `inner` in a ledger
//   is_ledger_backend(backend) -> bool
//   ledger_tallies(backend) -> {op: (calls, sent_bytes, received_bytes, seconds)}
//   ledger_reset(backend)
//   ledger_id(backend) -> int                              its identity (one backend may serve two devices)
// torchdist_ext/ledger.py registers the backends with torch.distributed.

#include <Python.h>

namespace tdx::comm {

// Adds the functions above to `module`; 0 on success, -1 with a Python error set.
int add_ledger_functions(PyObject* module);

}  // namespace tdx::comm
