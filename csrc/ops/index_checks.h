#pragma once
// Whether ops check the values of index tensors (cross-entropy targets,
// embedding ids) and raise on one out of range. The rule is the same on every
// device: with checks on (the default), an out-of-range index raises a
// ValueError naming its position and value (on a GPU this costs one
// device-to-host sync per call); with checks off, the rows it touches come out
// NaN (loss, lse and gradient), never a plausible wrong value. The environment
// variable TDX_INDEX_CHECKS=0 turns them off at start-up;
// torchdist_ext.set_index_checks() switches them at run time.

namespace tdx::ops {

bool index_checks_enabled();
void set_index_checks(bool enabled);

}  // namespace tdx::ops
