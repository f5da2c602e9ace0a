#pragma once
// The rank-agreement check's switch, and its entry for Python layers, in plain
// C++ types (for the Python module, which includes no torch headers). The check
// itself: comm/agreement.h.

#include <cstdint>
#include <string>

namespace tdx::comm {

// Calls of each op checked on a non-CPU device under "auto".
inline constexpr int64_t kAutoCheckedCalls = 64;

// "auto", "on" or "off".
std::string agreement_checks();
// Sets the mode; returns the previous one. Throws std::invalid_argument for another name.
std::string set_agreement_checks(const std::string& mode);

// check_agreement (comm/agreement.h) on the process group registered as `group_name`, its collectives on
// `device` ("cpu", "cuda:0", ...). Raises c10::Error, c10::ValueError or c10::TypeError.
void check_agreement_of_group(const std::string& group_name, const std::string& device, const std::string& op,
                              const std::string& fields, int error_kind, const std::string& error);

}  // namespace tdx::comm
