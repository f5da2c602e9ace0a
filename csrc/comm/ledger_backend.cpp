// LedgerBackend: a c10d::Backend forwarding every call to the backend it wraps
// and entering it in a Ledger (comm/ledger.h), and its Python functions. The
// one translation unit that includes c10d's Backend and pybind11.
//
// Only the names that torch 2.13 and 2.14 both declare are overridden: 2.14's
// canonical `*_single` methods forward to the older names (`_allgather_base`,
// `alltoall_base`, ...), so a call by either name is counted once.

#include "comm/ledger_backend.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <numeric>

#include "comm/ledger.h"

namespace tdx::comm {
namespace {

namespace py = pybind11;
using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;
using Clock = std::chrono::steady_clock;

double bytes_of(const at::Tensor& tensor) {
  return tensor.layout() == at::kStrided ? static_cast<double>(tensor.numel() * tensor.element_size()) : 0.0;
}

double bytes_of(const std::vector<at::Tensor>& tensors) {
  double total = 0;
  for (const auto& tensor : tensors) total += bytes_of(tensor);
  return total;
}

// The work of one call: forwards to the wrapped backend's work and enters the
// call's wall time in the ledger the first time it is seen complete.
class LedgerWork final : public Work {
 public:
  LedgerWork(WorkPtr inner, std::shared_ptr<Ledger> ledger, std::string op, Clock::time_point start)
      : Work(-1, inner->retrieveOpType()),
        inner_(std::move(inner)),
        ledger_(std::move(ledger)),
        op_(std::move(op)),
        start_(start) {}

  bool isCompleted() override {
    const bool done = inner_->isCompleted();
    if (done) record_seconds();
    return done;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool done = inner_->wait(timeout);
    record_seconds();
    return done;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  void record_seconds() {
    if (recorded_.exchange(true)) return;
    ledger_->add_seconds(op_, std::chrono::duration<double>(Clock::now() - start_).count());
  }

  WorkPtr inner_;
  std::shared_ptr<Ledger> ledger_;
  std::string op_;
  Clock::time_point start_;
  std::atomic<bool> recorded_{false};
};

class LedgerBackend final : public c10d::Backend {
 public:
  LedgerBackend(c10::intrusive_ptr<c10d::Backend> inner, std::string name)
      : Backend(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        name_(std::move(name)),
        ledger_(std::make_shared<Ledger>()) {}

  Ledger& ledger() { return *ledger_; }

  // Collectives.
  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    return enter_rooted("broadcast", bytes_of(tensors), opts.rootRank, /*root_sends=*/true,
                        [&] { return inner_->broadcast(tensors, opts); });
  }
  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    const double x = all_reduce_bytes(bytes_of(tensors));
    return enter("all_reduce", x, x, [&] { return inner_->allreduce(tensors, opts); });
  }
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    return enter("all_reduce_sparse", 0, 0, [&] { return inner_->allreduce_sparse(tensors, opts); });
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    const double x = all_reduce_bytes(bytes_of(tensors));
    return enter("all_reduce_coalesced", x, x, [&] { return inner_->allreduce_coalesced(tensors, opts); });
  }
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return enter_rooted("reduce", bytes_of(tensors), opts.rootRank, /*root_sends=*/false,
                        [&] { return inner_->reduce(tensors, opts); });
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts) override {
    const double x = others() * bytes_of(inputs);
    return enter("all_gather", x, x, [&] { return inner_->allgather(outputs, inputs, opts); });
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    const double x = others() * bytes_of(input);
    return enter("all_gather_into_tensor", x, x, [&] { return inner_->_allgather_base(output, input, opts); });
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) override {
    const double x = others() * bytes_of(inputs);
    return enter("all_gather_coalesced", x, x, [&] { return inner_->allgather_coalesced(outputs, inputs, opts); });
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    const double x = others() * bytes_of(inputs);
    return enter("all_gather_into_tensor_coalesced", x, x,
                 [&] { return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts); });
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    return enter_rooted("gather", bytes_of(inputs), opts.rootRank, /*root_sends=*/false,
                        [&] { return inner_->gather(outputs, inputs, opts); });
  }
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    return enter_rooted("scatter", bytes_of(outputs), opts.rootRank, /*root_sends=*/true,
                        [&] { return inner_->scatter(outputs, inputs, opts); });
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override {
    const double x = others() * bytes_of(outputs);
    return enter("reduce_scatter", x, x, [&] { return inner_->reduce_scatter(outputs, inputs, opts); });
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    const double x = others() * bytes_of(output);
    return enter("reduce_scatter_tensor", x, x, [&] { return inner_->_reduce_scatter_base(output, input, opts); });
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    const double x = others() * bytes_of(outputs);
    return enter("reduce_scatter_tensor_coalesced", x, x,
                 [&] { return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts); });
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    const double sent = bytes_of(input) - own_block_bytes(input, input_splits);
    const double received = bytes_of(output) - own_block_bytes(output, output_splits);
    return enter("all_to_all_single", sent, received,
                 [&] { return inner_->alltoall_base(output, input, output_splits, input_splits, opts); });
  }
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override {
    const double sent = bytes_of(inputs) - (getRank() < static_cast<int>(inputs.size()) ? bytes_of(inputs[getRank()]) : 0);
    const double received =
        bytes_of(outputs) - (getRank() < static_cast<int>(outputs.size()) ? bytes_of(outputs[getRank()]) : 0);
    return enter("all_to_all", sent, received, [&] { return inner_->alltoall(outputs, inputs, opts); });
  }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    return enter("barrier", 0, 0, [&] { return inner_->barrier(opts); });
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    const auto start = Clock::now();
    ledger_->add_call("monitored_barrier", 0, 0);
    inner_->monitoredBarrier(opts, wait_all_ranks);
    ledger_->add_seconds("monitored_barrier", std::chrono::duration<double>(Clock::now() - start).count());
  }

  // Point to point.
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return enter("send", bytes_of(tensors), 0, [&] { return inner_->send(tensors, dst, tag); });
  }
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return enter("recv", 0, bytes_of(tensors), [&] { return inner_->recv(tensors, src, tag); });
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return enter("recv", 0, bytes_of(tensors), [&] { return inner_->recvAnysource(tensors, tag); });
  }

  // Coalescing: the calls inside are entered one by one; the group's work carries their time.
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  void startCoalescing() override { inner_->startCoalescing(); }
  WorkPtr endCoalescing() override {
    return enter("coalesced", 0, 0, [&] { return inner_->endCoalescing(); }, /*count_call=*/false);
  }

  // Splitting (split_group, DeviceMesh on bound devices): the wrapped backend's child, in a ledger of its own.
  bool supportsSplitting() const override { return inner_->supportsSplitting(); }
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    auto child = inner_->split(store, ranks, opts);
    if (!child) return child;  // this rank is in none of the new groups
    return c10::make_intrusive<LedgerBackend>(std::move(child), name_);
  }

  // Everything else is the wrapped backend's.
  const std::string getBackendName() const override { return name_; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void setGroupUid(const std::string& uid) override {
    Backend::setGroupUid(uid);
    inner_->setGroupUid(uid);
  }
  void eagerConnectSingleDevice(at::Device device) override { inner_->eagerConnectSingleDevice(device); }
  void registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override {
    inner_->registerOnCompletionHook(std::move(hook));
  }
  void waitForPendingWorks() override { inner_->waitForPendingWorks(); }
  void enableCollectivesTiming() override { inner_->enableCollectivesTiming(); }
  c10d::ErrorType getError() override { return inner_->getError(); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

 private:
  double others() const { return static_cast<double>(getSize() - 1); }
  double all_reduce_bytes(double x) const { return 2.0 * others() / static_cast<double>(getSize()) * x; }

  // The bytes of this rank's own block of an all-to-all buffer: its rows under
  // uneven splits, 1/n of the buffer under even ones.
  double own_block_bytes(const at::Tensor& buffer, const std::vector<int64_t>& splits) const {
    if (splits.empty()) return bytes_of(buffer) / static_cast<double>(getSize());
    const int64_t rows = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    if (rows == 0 || getRank() >= static_cast<int>(splits.size())) return 0;
    return bytes_of(buffer) * static_cast<double>(splits[getRank()]) / static_cast<double>(rows);
  }

  // A rooted exchange of x bytes with each other rank: the root sends (n-1) x and every other rank
  // receives x (broadcast, scatter), or the other way round (reduce, gather).
  template <typename Call>
  WorkPtr enter_rooted(const char* op, double x, int64_t root, bool root_sends, Call&& call) {
    const bool is_root = getRank() == root;
    const double root_side = is_root ? others() * x : 0, other_side = is_root ? 0 : x;
    return root_sends ? enter(op, root_side, other_side, std::forward<Call>(call))
                      : enter(op, other_side, root_side, std::forward<Call>(call));
  }

  template <typename Call>
  WorkPtr enter(const char* op, double sent, double received, Call&& call, bool count_call = true) {
    if (const char* label = LedgerLabel::current()) op = label;
    const auto start = Clock::now();
    WorkPtr work = call();  // a call that throws is not entered
    if (count_call) ledger_->add_call(op, sent, received);
    if (!work) {  // inside coalescing: the group's work is timed
      return work;
    }
    return c10::make_intrusive<LedgerWork>(std::move(work), ledger_, op, start);
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::string name_;
  std::shared_ptr<Ledger> ledger_;
};

LedgerBackend& as_ledger(const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto* ledger = dynamic_cast<LedgerBackend*>(backend.get());
  if (ledger == nullptr) {
    throw py::value_error("backend '" + backend->getBackendName() +
                          "' is not a communication ledger (create the group with torchdist_ext.ledger.backend(...))");
  }
  return *ledger;
}

py::dict tallies_of(const c10::intrusive_ptr<c10d::Backend>& backend) {
  py::dict result;
  for (const auto& [op, tally] : as_ledger(backend).ledger().tallies()) {
    result[py::str(op)] = py::make_tuple(tally.calls, tally.sent_bytes, tally.received_bytes, tally.seconds);
  }
  return result;
}

}  // namespace

int add_ledger_functions(PyObject* module) {
  try {
    auto m = py::reinterpret_borrow<py::module_>(module);
    m.def(
        "ledger_backend",
        [](c10::intrusive_ptr<c10d::Backend> inner, std::string name) -> c10::intrusive_ptr<c10d::Backend> {
          return c10::make_intrusive<LedgerBackend>(std::move(inner), std::move(name));
        },
        py::arg("inner"), py::arg("name"), "A ledger backend named `name` forwarding every call to `inner`.");
    m.def(
        "is_ledger_backend",
        [](const c10::intrusive_ptr<c10d::Backend>& backend) {
          return dynamic_cast<LedgerBackend*>(backend.get()) != nullptr;
        },
        py::arg("backend"));
    m.def("ledger_tallies", &tallies_of, py::arg("backend"),
          "{op: (calls, sent_bytes, received_bytes, seconds)} of a ledger backend.");
    m.def(
        "ledger_reset", [](const c10::intrusive_ptr<c10d::Backend>& backend) { as_ledger(backend).ledger().reset(); },
        py::arg("backend"));
    m.def(
        "ledger_id", [](const c10::intrusive_ptr<c10d::Backend>& backend) { return as_ledger(backend).getID(); },
        py::arg("backend"), "The identity of a ledger backend (one serving two devices is one ledger).");
    return 0;
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return -1;
  }
}

}  // namespace tdx::comm
