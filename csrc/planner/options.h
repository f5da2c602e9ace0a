#pragma once
// The planner's named options. Each is an enum with one table of its names,
// from which everything else reads: parsing and its error message, printing,
// the Python bindings (torchdist_ext._planner.OPTIONS) and the CLI's choices.

#include <array>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tdx::planner {

enum class Recompute { kNone, kSelective, kFull };
enum class Schedule { kGPipe, k1F1B, kInterleaved, kZbH1, kZbV };
// bf16-mixed: bf16 activations and GEMMs, fp32 master weights; fp8-mixed: the same with fp8 GEMMs;
// fp32: fp32 throughout (GEMMs as TF32); fp8-fp32: fp32 training with fp8 GEMMs (as on a CPU).
enum class Precision { kBf16Mixed, kFp8Mixed, kFp32, kFp8Fp32 };
inline bool uses_fp8_gemms(Precision p) { return p == Precision::kFp8Mixed || p == Precision::kFp8Fp32; }
enum class Fp8GradFormat { kE5M2, kE4M3 };
enum class AttentionKernel { kFlash, kEager };
enum class NormKernel { kFused, kComposite };
// How the sequence is cut over the ring ranks of cp (torchdist_ext.parallel): contiguous blocks, zigzag
// chunks, or each row's balanced_sequence_plan of its documents.
enum class CpOrder { kContiguous, kZigzag, kBalanced };

template <typename Option>
struct OptionTable;

template <>
struct OptionTable<Recompute> {
  static constexpr const char* kField = "recompute";
  static constexpr std::array<std::pair<Recompute, const char*>, 3> kNames{
      {{Recompute::kNone, "none"}, {Recompute::kSelective, "selective"}, {Recompute::kFull, "full"}}};
};

template <>
struct OptionTable<Schedule> {
  static constexpr const char* kField = "schedule";
  static constexpr std::array<std::pair<Schedule, const char*>, 5> kNames{{{Schedule::k1F1B, "1f1b"},
                                                                           {Schedule::kGPipe, "gpipe"},
                                                                           {Schedule::kInterleaved, "interleaved-1f1b"},
                                                                           {Schedule::kZbH1, "zb-h1"},
                                                                           {Schedule::kZbV, "zb-v"}}};
};

template <>
struct OptionTable<Precision> {
  static constexpr const char* kField = "precision";
  static constexpr std::array<std::pair<Precision, const char*>, 4> kNames{{{Precision::kBf16Mixed, "bf16-mixed"},
                                                                            {Precision::kFp8Mixed, "fp8-mixed"},
                                                                            {Precision::kFp32, "fp32"},
                                                                            {Precision::kFp8Fp32, "fp8-fp32"}}};
};

template <>
struct OptionTable<Fp8GradFormat> {
  static constexpr const char* kField = "fp8_grad_format";
  static constexpr std::array<std::pair<Fp8GradFormat, const char*>, 2> kNames{
      {{Fp8GradFormat::kE5M2, "e5m2"}, {Fp8GradFormat::kE4M3, "e4m3"}}};
};

template <>
struct OptionTable<AttentionKernel> {
  static constexpr const char* kField = "attention";
  static constexpr std::array<std::pair<AttentionKernel, const char*>, 2> kNames{
      {{AttentionKernel::kFlash, "flash"}, {AttentionKernel::kEager, "eager"}}};
};

template <>
struct OptionTable<NormKernel> {
  static constexpr const char* kField = "norm";
  static constexpr std::array<std::pair<NormKernel, const char*>, 2> kNames{
      {{NormKernel::kFused, "fused"}, {NormKernel::kComposite, "composite"}}};
};

template <>
struct OptionTable<CpOrder> {
  static constexpr const char* kField = "cp_order";
  static constexpr std::array<std::pair<CpOrder, const char*>, 3> kNames{
      {{CpOrder::kZigzag, "zigzag"}, {CpOrder::kContiguous, "contiguous"}, {CpOrder::kBalanced, "balanced"}}};
};

template <typename Option>
const char* option_name(Option value) {
  for (const auto& [option, name] : OptionTable<Option>::kNames) {
    if (option == value) return name;
  }
  return "?";
}

template <typename Option>
std::vector<std::string> option_names() {
  std::vector<std::string> names;
  for (const auto& entry : OptionTable<Option>::kNames) names.emplace_back(entry.second);
  return names;
}

// The option called `name`; throws std::invalid_argument("<field> must be one of a, b, got 'x'").
template <typename Option>
Option parse_option(const std::string& name, const std::string& field = OptionTable<Option>::kField) {
  std::string allowed;
  for (const auto& [option, option_name] : OptionTable<Option>::kNames) {
    if (name == option_name) return option;
    allowed += (allowed.empty() ? "" : ", ") + std::string(option_name);
  }
  throw std::invalid_argument(field + " must be one of " + allowed + ", got '" + name + "'");
}

}  // namespace tdx::planner
