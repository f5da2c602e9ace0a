// torchdist_ext._planner: the torch-free cost model, bound with pybind11.
// std::invalid_argument becomes ValueError. Options (planner/options.h) cross
// as their names: OPTIONS maps each option's field to its allowed names.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "planner/checks.h"
#include "planner/documents.h"
#include "planner/estimate.h"
#include "planner/memory.h"
#include "planner/pipeline.h"
#include "planner/search.h"
#include "planner/specs.h"

namespace py = pybind11;
using namespace tdx::planner;

namespace {

// A Layout field holding an option, read and written as its name.
template <typename Option>
void def_option(py::class_<Layout>& layout, const char* field, Option Layout::*member) {
  layout.def_property(
      field, [member](const Layout& l) { return std::string(option_name(l.*member)); },
      [member, field](Layout& l, const std::string& name) {
        l.*member = parse_option<Option>(name, std::string("Layout.") + field);
      });
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() = "torchdist_ext's cost model (torch-free C++); use torchdist_ext.planner";

  py::dict options;
  options[OptionTable<Recompute>::kField] = option_names<Recompute>();
  options[OptionTable<Schedule>::kField] = option_names<Schedule>();
  options[OptionTable<Precision>::kField] = option_names<Precision>();
  options[OptionTable<Fp8GradFormat>::kField] = option_names<Fp8GradFormat>();
  options[OptionTable<AttentionKernel>::kField] = option_names<AttentionKernel>();
  options[OptionTable<NormKernel>::kField] = option_names<NormKernel>();
  options[OptionTable<CpOrder>::kField] = option_names<CpOrder>();
  m.attr("OPTIONS") = options;

  py::class_<ModelSpec>(m, "ModelSpec")
      .def(py::init<>())
      .def_readwrite("name", &ModelSpec::name)
      .def_readwrite("num_layers", &ModelSpec::num_layers)
      .def_readwrite("hidden", &ModelSpec::hidden)
      .def_readwrite("num_heads", &ModelSpec::num_heads)
      .def_readwrite("num_kv_heads", &ModelSpec::num_kv_heads)
      .def_readwrite("ffn_hidden", &ModelSpec::ffn_hidden)
      .def_readwrite("vocab_size", &ModelSpec::vocab_size)
      .def_readwrite("num_experts", &ModelSpec::num_experts)
      .def_readwrite("experts_per_token", &ModelSpec::experts_per_token)
      .def_readwrite("moe_ffn_hidden", &ModelSpec::moe_ffn_hidden)
      .def_readwrite("num_dense_layers", &ModelSpec::num_dense_layers)
      .def_readwrite("num_shared_experts", &ModelSpec::num_shared_experts)
      .def_readwrite("num_params", &ModelSpec::num_params)
      .def_readwrite("fused_projections", &ModelSpec::fused_projections)
      .def("validate", &ModelSpec::validate);

  py::class_<ParamCount>(m, "ParamCount")
      .def_readonly("total", &ParamCount::total)
      .def_readonly("active", &ParamCount::active)
      .def_readonly("expert", &ParamCount::expert)
      .def_readonly("moe_active", &ParamCount::moe_active)
      .def_readonly("routed_active", &ParamCount::routed_active)
      .def_readonly("per_layer_dense", &ParamCount::per_layer_dense)
      .def_readonly("embedding", &ParamCount::embedding);
  m.def("count_params", &count_params);

  py::class_<GpuSpec>(m, "GpuSpec")
      .def(py::init<>())
      .def_readwrite("name", &GpuSpec::name)
      .def_readwrite("memory_bytes", &GpuSpec::memory_bytes)
      .def_readwrite("bf16_flops", &GpuSpec::bf16_flops)
      .def_readwrite("nvlink_bytes_per_s", &GpuSpec::nvlink_bytes_per_s)
      .def_readwrite("internode_bytes_per_s", &GpuSpec::internode_bytes_per_s)
      .def_readwrite("hbm_bytes_per_s", &GpuSpec::hbm_bytes_per_s)
      .def_readwrite("fp8_flops", &GpuSpec::fp8_flops)
      .def_readwrite("gemm_efficiency", &GpuSpec::gemm_efficiency)
      .def_readwrite("fp8_gemm_efficiency", &GpuSpec::fp8_gemm_efficiency)
      .def_readwrite("attention_efficiency", &GpuSpec::attention_efficiency);

  py::class_<ClusterSpec>(m, "ClusterSpec")
      .def(py::init<>())
      .def_readwrite("groups", &ClusterSpec::groups)
      .def_readwrite("gpus_per_domain", &ClusterSpec::gpus_per_domain)
      .def("num_gpus", &ClusterSpec::num_gpus)
      .def("validate", &ClusterSpec::validate);

  py::class_<Layout> layout(m, "Layout");
  layout.def(py::init<>())
      .def_readwrite("tp", &Layout::tp)
      .def_readwrite("pp", &Layout::pp)
      .def_readwrite("dp", &Layout::dp)
      .def_readwrite("cp", &Layout::cp)
      .def_readwrite("cp_ulysses", &Layout::cp_ulysses)
      .def_readwrite("document_median", &Layout::document_median)
      .def_readwrite("document_sigma", &Layout::document_sigma)
      .def_readwrite("dp_replicate", &Layout::dp_replicate)
      .def_readwrite("ep", &Layout::ep)
      .def_readwrite("zero_stage", &Layout::zero_stage)
      .def_readwrite("sequence_parallel", &Layout::sequence_parallel)
      .def_readwrite("recompute_experts", &Layout::recompute_experts)
      .def_readwrite("expert_imbalance", &Layout::expert_imbalance)
      .def_readwrite("micro_batch", &Layout::micro_batch)
      .def_readwrite("num_microbatches", &Layout::num_microbatches)
      .def_readwrite("virtual_stages", &Layout::virtual_stages)
      .def_readwrite("seq_len", &Layout::seq_len)
      .def_readwrite("fp8_amax_history", &Layout::fp8_amax_history)
      .def_readwrite("fp8_attention", &Layout::fp8_attention)
      .def_readwrite("compiled", &Layout::compiled)
      .def("validate", &Layout::validate);
  def_option(layout, "recompute", &Layout::recompute);
  def_option(layout, "schedule", &Layout::schedule);
  def_option(layout, "precision", &Layout::precision);
  def_option(layout, "fp8_grad_format", &Layout::fp8_grad_format);
  def_option(layout, "attention", &Layout::attention);
  def_option(layout, "norm", &Layout::norm);
  def_option(layout, "cp_order", &Layout::cp_order);

  py::class_<ModelStateBytes>(m, "ModelStateBytes")
      .def_readonly("params", &ModelStateBytes::params)
      .def_readonly("grads", &ModelStateBytes::grads)
      .def_readonly("optimizer", &ModelStateBytes::optimizer)
      .def("total", &ModelStateBytes::total);
  m.def(
      "model_state_bytes",
      [](double num_params, int zero_stage, long dp, const std::string& precision) {
        return model_state_bytes(num_params, zero_stage, dp, parse_option<Precision>(precision));
      },
      py::arg("num_params"), py::arg("zero_stage"), py::arg("dp"), py::arg("precision"));
  m.def(
      "activation_bytes_per_layer",
      [](double s, double b, double h, double a, long tp, bool sequence_parallel, const std::string& recompute,
         const std::string& attention) {
        return activation_bytes_per_layer(s, b, h, a, tp, sequence_parallel, parse_option<Recompute>(recompute),
                                          parse_option<AttentionKernel>(attention));
      },
      py::arg("seq_len"), py::arg("micro_batch"), py::arg("hidden"), py::arg("num_heads"), py::arg("tp"),
      py::arg("sequence_parallel"), py::arg("recompute"), py::arg("attention") = "flash");
  m.def("layer_activation_bytes", &layer_activation_bytes, py::arg("model"), py::arg("layout"),
        py::arg("moe_layer"));
  m.def("layer_rerun_bytes", &layer_rerun_bytes, py::arg("model"), py::arg("layout"), py::arg("moe_layer"));
  m.def("layer_backward_bytes", &layer_backward_bytes, py::arg("model"), py::arg("layout"), py::arg("moe_layer"));
  m.def("expected_ranks_per_token", &expected_ranks_per_token, py::arg("num_experts"), py::arg("top_k"),
        py::arg("ep"));
  m.def("layer_weight_grad_input_bytes", &layer_weight_grad_input_bytes, py::arg("model"), py::arg("layout"),
        py::arg("moe_layer"));
  m.def("head_activation_bytes", &head_activation_bytes, py::arg("model"), py::arg("layout"));
  m.def("head_backward_bytes", &head_backward_bytes, py::arg("model"), py::arg("layout"));
  m.def("head_weight_grad_input_bytes", &head_weight_grad_input_bytes, py::arg("model"), py::arg("layout"));
  m.def("embedding_weight_grad_input_bytes", &embedding_weight_grad_input_bytes, py::arg("model"),
        py::arg("layout"));
  m.def(
      "bubble_fraction",
      [](long pp, long m, const std::string& schedule, long v) {
        return bubble_fraction(pp, m, parse_option<Schedule>(schedule), v);
      },
      py::arg("pp"), py::arg("num_microbatches"), py::arg("schedule"), py::arg("virtual_stages"));

  py::class_<ScheduledPass>(m, "ScheduledPass")
      .def_readonly("rank", &ScheduledPass::rank)
      .def_readonly("kind", &ScheduledPass::kind)
      .def_readonly("microbatch", &ScheduledPass::microbatch)
      .def_readonly("start", &ScheduledPass::start)
      .def_readonly("end", &ScheduledPass::end)
      .def_readonly("chunk", &ScheduledPass::chunk);
  m.def(
      "simulate_schedule",
      [](long pp, long m, const std::string& schedule, long v) {
        return simulate_schedule(pp, m, parse_option<Schedule>(schedule), v);
      },
      py::arg("pp"), py::arg("num_microbatches"), py::arg("schedule"), py::arg("virtual_stages") = 1);
  m.def(
      "replay_schedule",
      [](long pp, long m, const std::string& schedule, long v, const std::vector<double>& forward,
         const std::vector<double>& backward, const std::vector<double>& weight, double message) {
        return replay_schedule(pp, m, parse_option<Schedule>(schedule), v, forward, backward, weight, message);
      },
      py::arg("pp"), py::arg("num_microbatches"), py::arg("schedule"), py::arg("virtual_stages"), py::arg("forward"),
      py::arg("backward"), py::arg("weight"), py::arg("message") = 0.0);
  m.def("idle_fraction", &idle_fraction, py::arg("timeline"), py::arg("pp"));
  m.def(
      "chunks_per_rank",
      [](const std::string& schedule, long v) { return chunks_per_rank(parse_option<Schedule>(schedule), v); },
      py::arg("schedule"), py::arg("virtual_stages"));
  m.def(
      "stage_of",
      [](long rank, long chunk, long pp, const std::string& schedule) {
        return stage_of(rank, chunk, pp, parse_option<Schedule>(schedule));
      },
      py::arg("rank"), py::arg("chunk"), py::arg("pp"), py::arg("schedule"));
  m.def("peak_held_activations", &peak_held_activations, py::arg("timeline"), py::arg("pp"),
        py::arg("weight_inputs"));

  py::class_<AxisComm>(m, "AxisComm")
      .def_readonly("bytes", &AxisComm::bytes)
      .def_readonly("seconds", &AxisComm::seconds)
      .def_readonly("exposed_seconds", &AxisComm::exposed_seconds)
      .def_readonly("intra_domain", &AxisComm::intra_domain);
  py::class_<RankMemory>(m, "RankMemory")
      .def_readonly("params", &RankMemory::params)
      .def_readonly("grads", &RankMemory::grads)
      .def_readonly("optimizer", &RankMemory::optimizer)
      .def_readonly("activations", &RankMemory::activations)
      .def_readonly("backward", &RankMemory::backward)
      .def_readonly("buffers", &RankMemory::buffers)
      .def("total", &RankMemory::total);
  py::class_<ComputeTime>(m, "ComputeTime")
      .def_readonly("seconds", &ComputeTime::seconds)
      .def_readonly("gemm_seconds", &ComputeTime::gemm_seconds)
      .def_readonly("attention_seconds", &ComputeTime::attention_seconds)
      .def_readonly("memory_seconds", &ComputeTime::memory_seconds)
      .def_readonly("optimizer_seconds", &ComputeTime::optimizer_seconds);
  m.def("compute_time", &compute_time);
  m.def(
      "gemm_seconds",
      [](double m_, double n, double k, const GpuSpec& gpu, const std::string& precision) {
        return gemm_seconds(m_, n, k, gpu, parse_option<Precision>(precision));
      },
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("gpu"), py::arg("precision"));
  m.def(
      "attention_balance",
      [](int64_t seq_len, int64_t ranks, const std::string& order, double median, double sigma) {
        if (seq_len < 1 || ranks < 1) throw std::invalid_argument("seq_len and ranks must be positive");
        const auto balance = attention_balance(seq_len, ranks, parse_option<CpOrder>(order), median, sigma);
        return std::make_pair(balance.work_share, balance.spread);
      },
      py::arg("seq_len"), py::arg("ranks"), py::arg("order"), py::arg("median"), py::arg("sigma"));
  py::class_<Estimate>(m, "Estimate")
      .def_readonly("params", &Estimate::params)
      .def_readonly("grads", &Estimate::grads)
      .def_readonly("optimizer", &Estimate::optimizer)
      .def_readonly("activations", &Estimate::activations)
      .def_readonly("backward", &Estimate::backward)
      .def_readonly("buffers", &Estimate::buffers)
      .def_readonly("gpu_memory", &Estimate::gpu_memory)
      .def_readonly("pipeline_ranks", &Estimate::pipeline_ranks)
      .def_readonly("fullest_pipeline_rank", &Estimate::fullest_pipeline_rank)
      .def_readonly("params_per_gpu", &Estimate::params_per_gpu)
      .def_readonly("tokens_per_step", &Estimate::tokens_per_step)
      .def_readonly("model_flops_per_step", &Estimate::model_flops_per_step)
      .def_readonly("compute", &Estimate::compute)
      .def_readonly("bubble", &Estimate::bubble)
      .def_readonly("attention_spread", &Estimate::attention_spread)
      .def_readonly("comm", &Estimate::comm)
      .def_readonly("step_seconds", &Estimate::step_seconds)
      .def_readonly("mfu", &Estimate::mfu)
      .def("total_memory", &Estimate::total_memory)
      .def("fits", &Estimate::fits)
      .def("tokens_per_second", &Estimate::tokens_per_second);
  m.def("estimate", &estimate);
  m.def("training_flops", &training_flops);
  m.def("gpu_hours", &gpu_hours);

  py::class_<Finding>(m, "Finding")
      .def_readonly("code", &Finding::code)
      .def_readonly("severity", &Finding::severity)
      .def_readonly("message", &Finding::message);
  m.def("check", &check);
  m.def("search", &search, py::arg("model"), py::arg("cluster"), py::arg("seq_len"), py::arg("global_batch"),
        py::arg("top"), py::arg("expert_imbalance") = 1.0, py::arg("compiled") = false);
}
