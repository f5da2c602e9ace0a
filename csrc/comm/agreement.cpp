#include "comm/agreement.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/debug.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "comm/group.h"
#include "comm/ledger.h"

namespace tdx::comm {
namespace {

enum class Mode { kAuto, kOn, kOff };

const char* mode_name(Mode mode) { return mode == Mode::kAuto ? "auto" : mode == Mode::kOn ? "on" : "off"; }

Mode parse_mode(const std::string& name) {
  if (name == "auto") return Mode::kAuto;
  if (name == "on") return Mode::kOn;
  if (name == "off") return Mode::kOff;
  throw std::invalid_argument("agreement checks must be 'auto', 'on' or 'off', got '" + name + "'");
}

std::atomic<Mode>& mode_flag() {
  static std::atomic<Mode> flag{[] {
    const char* value = std::getenv("TDX_AGREEMENT_CHECKS");
    try {
      return value == nullptr ? Mode::kAuto : parse_mode(value);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("TDX_AGREEMENT_CHECKS: ") + e.what());
    }
  }()};
  return flag;
}

// Whether this call of `op` on `group` is checked. The ranks of a group make the same sequence of calls on
// it (as c10d requires), so they decide the same: "auto" counts calls per (group, op).
bool checked(c10d::ProcessGroup& group, const std::string& op, const at::Device& device) {
  if (group.getSize() < 2) return false;
  const Mode mode = mode_flag().load(std::memory_order_relaxed);
  if (mode == Mode::kOn || c10d::debug_level() == c10d::DebugLevel::Detail) return true;
  if (mode == Mode::kOff) return false;
  if (device.is_cpu()) return true;
  static std::mutex mutex;
  static std::map<std::pair<std::string, std::string>, int64_t> calls;
  std::lock_guard<std::mutex> lock(mutex);
  return calls[{group.getGroupName(), op}]++ < kAutoCheckedCalls;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 1469598103934665603ull;
  for (const unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

// The kind of a caught error: 1 RuntimeError, 2 ValueError, 3 TypeError.
int kind_of(const std::exception& e) {
  if (dynamic_cast<const c10::ValueError*>(&e) != nullptr) return 2;
  if (dynamic_cast<const c10::TypeError*>(&e) != nullptr) return 3;
  return 1;
}

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

[[noreturn]] void raise(int kind, const std::string& message) {
  if (kind == 2) TORCH_CHECK_VALUE(false, message);
  if (kind == 3) TORCH_CHECK_TYPE(false, message);
  TORCH_CHECK(false, message);
  std::abort();  // unreachable
}

std::vector<std::pair<std::string, std::string>> parse_fields(const std::string& fields) {
  std::vector<std::pair<std::string, std::string>> parsed;
  std::istringstream lines(fields);
  std::string line;
  while (std::getline(lines, line)) {
    const auto eq = line.find('=');
    parsed.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
  }
  return parsed;
}

// "the ranks disagree on <field>: rank a has X, rank b has Y".
std::string disagreement(const std::string& op, int mine, const std::string& my_fields, int other,
                         const std::string& other_fields) {
  const auto a = parse_fields(my_fields), b = parse_fields(other_fields);
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  std::ostringstream out;
  out << op << ": the ranks of the group must agree on ";
  if (i < a.size() && i < b.size() && a[i].first == b[i].first) {
    out << a[i].first << ": rank " << mine << " has " << a[i].second << ", rank " << other << " has " << b[i].second;
  } else {
    const auto show = [](const auto& f, size_t j) { return j < f.size() ? f[j].first + "=" + f[j].second : "nothing"; };
    out << "the call: rank " << mine << " has " << show(a, i) << ", rank " << other << " has " << show(b, i);
  }
  out << " (the rank-agreement check: torchdist_ext.set_agreement_checks)";
  return out.str();
}

// The check itself (the call is checked): raises on every rank unless every rank has `fields` and no error.
void exchange(c10d::ProcessGroup& group, const at::Device& device, const std::string& op, const std::string& fields,
              int error_kind, const std::string& error) {
  const LedgerLabel label("agreement_check");
  const int n = group.getSize(), rank = group.getRank();
  const auto longs = at::TensorOptions().dtype(at::kLong);
  const int64_t summary[4] = {static_cast<int64_t>(fnv1a(fields)), static_cast<int64_t>(fields.size()), error_kind,
                              static_cast<int64_t>(error.size())};
  auto local = at::from_blob(const_cast<int64_t*>(summary), {4}, longs).to(device, /*non_blocking=*/false, true);
  auto all = at::empty({n * 4}, local.options());
  group._allgather_base(all, local)->wait();
  const auto gathered = all.cpu();
  const int64_t* words = gathered.const_data_ptr<int64_t>();
  bool same = true;
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    same &= words[4 * r] == summary[0] && words[4 * r + 1] == summary[1] && words[4 * r + 2] == 0;
    longest = std::max(longest, words[4 * r + 1] + 1 + words[4 * r + 3]);
  }
  if (same) return;

  // Something differs: every rank saw the same summaries, so every rank gathers the texts.
  std::string mine = fields + '\0' + error;
  mine.resize(longest, '\0');
  auto text = at::from_blob(mine.data(), {longest}, at::TensorOptions().dtype(at::kByte)).to(device, false, true);
  auto texts = at::empty({n * longest}, text.options());
  group._allgather_base(texts, text)->wait();
  const auto bytes = texts.cpu();
  const char* base = reinterpret_cast<const char*>(bytes.const_data_ptr<uint8_t>());
  const auto fields_of = [&](int r) { return std::string(base + r * longest, words[4 * r + 1]); };
  const auto error_of = [&](int r) { return std::string(base + r * longest + words[4 * r + 1] + 1, words[4 * r + 3]); };
  if (error_kind != 0) raise(error_kind, error);
  for (int r = 0; r < n; ++r) {
    if (words[4 * r + 2] != 0) {
      raise(static_cast<int>(words[4 * r + 2]), op + ": rank " + std::to_string(r) + " of the group refused its " +
                                                     "input, so every rank stops: " + error_of(r));
    }
  }
  for (int r = 0; r < n; ++r) {
    if (fields_of(r) != fields) raise(2, disagreement(op, rank, fields, r, fields_of(r)));
  }
}

}  // namespace

std::string agreement_checks() { return mode_name(mode_flag().load()); }

std::string set_agreement_checks(const std::string& mode) {
  return mode_name(mode_flag().exchange(parse_mode(mode)));
}

Agreement::Agreement(const char* op) : op_(op) { text("op", op); }

Agreement& Agreement::tensor(const char* name, const at::Tensor& t, int64_t from_dim) {
  std::ostringstream out;
  out << c10::toString(t.scalar_type()) << " [";
  for (int64_t d = 0; d < t.dim(); ++d) {
    out << (d ? ", " : "");
    if (d < from_dim) {
      out << "*";
    } else {
      out << t.size(d);
    }
  }
  out << "]";
  return text(name, out.str());
}

Agreement& Agreement::tensor(const char* name, const std::optional<at::Tensor>& t) {
  return t.has_value() ? tensor(name, *t) : text(name, "none");
}

Agreement& Agreement::value(const char* name, int64_t v) { return text(name, std::to_string(v)); }

Agreement& Agreement::value(const char* name, double v) {
  std::ostringstream out;
  out.precision(17);
  out << v;
  return text(name, out.str());
}

Agreement& Agreement::flag(const char* name, bool v) { return text(name, v ? "true" : "false"); }

Agreement& Agreement::text(const char* name, c10::string_view v) {
  fields_.append(name).append("=").append(v.data(), v.size()).append("\n");
  return *this;
}

Agreement& Agreement::scalar(const char* name, const at::Tensor& t) {
  scalars_.emplace_back(name, t);
  return *this;
}

std::string Agreement::fields() const {
  std::string all = fields_;
  for (const auto& [name, t] : scalars_) {
    std::ostringstream out;
    out.precision(17);
    if (t.numel() == 1) {
      out << t.to(at::kCPU).to(at::kDouble).item<double>();
    } else {
      out << "a tensor of " << t.numel() << " elements";
    }
    all.append(name).append("=").append(out.str()).append("\n");
  }
  return all;
}

void Agreement::check(c10d::ProcessGroup& group, const at::Device& device,
                      const std::function<void()>& validate) const {
  if (!checked(group, op_, device)) {
    if (validate) validate();
    return;
  }
  std::exception_ptr own;
  int kind = 0;
  std::string message, described;
  try {  // a failure here (the checks, reading a scalar field) is this rank's refusal: it still joins the check
    if (validate) validate();
    described = fields();
  } catch (const std::exception& e) {
    own = std::current_exception();
    kind = kind_of(e);
    message = message_of(e);
  }
  try {
    exchange(group, device, op_, described, kind, message);
  } catch (...) {
    if (own) std::rethrow_exception(own);  // this rank's own error, as it was raised
    throw;
  }
}

void check_agreement(c10d::ProcessGroup& group, const at::Device& device, const std::string& op,
                     const std::string& fields, int error_kind, const std::string& error) {
  if (checked(group, op, device)) {
    exchange(group, device, op, fields, error_kind, error);
  } else if (error_kind != 0) {
    raise(error_kind, error);
  }
}

void check_agreement_of_group(const std::string& group_name, const std::string& device, const std::string& op,
                              const std::string& fields, int error_kind, const std::string& error) {
  check_agreement(*group_by_name(group_name), at::Device(device), op, fields, error_kind, error);
}

}  // namespace tdx::comm
