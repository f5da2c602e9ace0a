#include "comm/agreement.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/debug.h>

#include <cstring>
#include <sstream>
#include <vector>

namespace tdx::comm {
namespace {

// Fingerprint layout (int64 words): dtype, dim, kMaxDims sizes, then the op's
// name, kNameWords * 8 characters (truncated, zero-padded).
constexpr int kMaxDims = 8;
constexpr int kNameWords = 6;
constexpr int kWords = 2 + kMaxDims + kNameWords;

// Dims before `from_dim` are recorded as -1 (free to differ).
std::vector<int64_t> fingerprint(const char* op, const at::Tensor& t, int64_t from_dim) {
  std::vector<int64_t> words(kWords, 0);
  words[0] = static_cast<int64_t>(t.scalar_type());
  words[1] = t.dim();
  for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kMaxDims); ++d) words[2 + d] = d < from_dim ? -1 : t.size(d);
  std::strncpy(reinterpret_cast<char*>(words.data() + 2 + kMaxDims), op, kNameWords * sizeof(int64_t) - 1);
  return words;
}

std::string describe(const int64_t* words) {
  std::string name(reinterpret_cast<const char*>(words + 2 + kMaxDims));
  std::ostringstream out;
  out << name << " with " << c10::toString(static_cast<c10::ScalarType>(words[0])) << " [";
  for (int64_t d = 0; d < std::min<int64_t>(words[1], kMaxDims); ++d) {
    out << (d ? ", " : "");
    if (words[2 + d] < 0) {
      out << "*";
    } else {
      out << words[2 + d];
    }
  }
  out << (words[1] > kMaxDims ? ", ...]" : "]");
  return out.str();
}

}  // namespace

bool checking_agreement() { return c10d::debug_level() == c10d::DebugLevel::Detail; }

void check_ranks_agree(c10d::ProcessGroup& group, const char* op, const char* what, const at::Tensor& exchanged,
                       int64_t from_dim) {
  if (!checking_agreement()) return;
  const int n = group.getSize();
  const auto mine = fingerprint(op, exchanged, from_dim);
  auto local = at::tensor(mine, at::TensorOptions().dtype(at::kLong)).to(exchanged.device());
  auto all = at::empty({n * kWords}, local.options());
  group._allgather_base(all, local)->wait();
  const auto gathered = all.cpu();
  const int64_t* words = gathered.data_ptr<int64_t>();
  for (int r = 0; r < n; ++r) {
    if (std::memcmp(words + r * kWords, mine.data(), kWords * sizeof(int64_t)) != 0) {
      TORCH_CHECK(
          false, op, ": the ranks of the group disagree on the ", what, " they exchange: rank ", group.getRank(),
          " runs ", describe(mine.data()), ", rank ", r, " runs ", describe(words + r * kWords),
          " (checked because TORCH_DISTRIBUTED_DEBUG=DETAIL)");
    }
  }
}

}  // namespace tdx::comm
