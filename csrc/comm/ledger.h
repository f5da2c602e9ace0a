#pragma once
// The communication ledger: a c10d backend that wraps another (gloo, NCCL) and
// forwards every call to it, counting per operation the calls, the bytes this
// rank sends and receives, and the wall time until each call completes.
//
// Bytes follow the ring algorithms' traffic per rank (the convention of
// nccl-tests' bus bandwidth and of the planner), for a payload of X bytes on
// this rank and a group of n ranks:
//   send X sent, recv X received;
//   all_reduce 2 (n-1)/n X both ways;
//   all_gather (X = the input) and reduce_scatter (X = the output) (n-1) X both ways;
//   all_to_all the blocks to / from the other ranks (this rank's own block stays);
//   broadcast / scatter X / (n-1) X sent by the root, X received elsewhere;
//   reduce / gather X sent by every other rank, (n-1) X received by the root;
//   barrier nothing.
// Seconds run from the call to the first time this rank sees the work complete
// (wait returning, isCompleted true): on gloo the transfer itself, on NCCL the
// host side only (the GPU runs it later on its stream).

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace tdx::comm {

struct OpTally {
  int64_t calls = 0;
  double sent_bytes = 0;
  double received_bytes = 0;
  double seconds = 0;
};

// Tallies per operation name; thread-safe (works complete on the backend's threads).
class Ledger {
 public:
  void add_call(const std::string& op, double sent_bytes, double received_bytes);
  void add_seconds(const std::string& op, double seconds);
  std::map<std::string, OpTally> tallies() const;
  void reset();

 private:
  mutable std::mutex mutex_;
  std::map<std::string, OpTally> tallies_;
};

// While alive, the calls this thread makes are entered under `label` instead of their op's name (the
// rank-agreement check's all-gathers: comm/agreement.h). Nests: the innermost label wins.
class LedgerLabel {
 public:
  explicit LedgerLabel(const char* label);
  ~LedgerLabel();
  LedgerLabel(const LedgerLabel&) = delete;
  LedgerLabel& operator=(const LedgerLabel&) = delete;

  // The label of this thread's innermost LedgerLabel, or nullptr.
  static const char* current();

 private:
  const char* previous_;
};

}  // namespace tdx::comm
