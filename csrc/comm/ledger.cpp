#include "comm/ledger.h"

namespace tdx::comm {

void Ledger::add_call(const std::string& op, double sent_bytes, double received_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  OpTally& tally = tallies_[op];
  tally.calls += 1;
  tally.sent_bytes += sent_bytes;
  tally.received_bytes += received_bytes;
}

void Ledger::add_seconds(const std::string& op, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  tallies_[op].seconds += seconds;
}

std::map<std::string, OpTally> Ledger::tallies() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tallies_;
}

void Ledger::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  tallies_.clear();
}

namespace {
thread_local const char* current_label = nullptr;
}  // namespace

LedgerLabel::LedgerLabel(const char* label) : previous_(current_label) { current_label = label; }

LedgerLabel::~LedgerLabel() { current_label = previous_; }

const char* LedgerLabel::current() { return current_label; }

}  // namespace tdx::comm
