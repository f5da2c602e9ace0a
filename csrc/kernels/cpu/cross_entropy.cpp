#include "kernels/cpu/cross_entropy.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>

namespace tdx::kernels::cpu {
namespace {

template <typename T, typename Acc>
void stats_rows(const T* logits, const int64_t* target, int64_t row_begin, int64_t row_end,
                int64_t vocab_local, int64_t vocab_start, Acc* row_max, Acc* row_sumexp,
                Acc* target_logit) {
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* x = logits + row * vocab_local;
    Acc max = -std::numeric_limits<Acc>::infinity();
    for (int64_t v = 0; v < vocab_local; ++v) {
      max = std::max(max, static_cast<Acc>(load(x[v])));
    }
    Acc sum = 0;
    for (int64_t v = 0; v < vocab_local; ++v) {
      sum += std::exp(static_cast<Acc>(load(x[v])) - max);
    }
    const int64_t local_target = target[row] - vocab_start;
    row_max[row] = max;
    row_sumexp[row] = sum;
    target_logit[row] = (local_target >= 0 && local_target < vocab_local)
                            ? static_cast<Acc>(load(x[local_target]))
                            : Acc(0);
  }
}

template <typename T, typename Acc>
void grad_rows(const T* grad_loss, const T* logits, const int64_t* target, const Acc* lse,
               int64_t row_begin, int64_t row_end, int64_t vocab_local, int64_t vocab_start,
               int64_t ignore_index, T* grad_logits) {
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* x = logits + row * vocab_local;
    T* dx = grad_logits + row * vocab_local;
    if (target[row] == ignore_index) {
      for (int64_t v = 0; v < vocab_local; ++v) store(dx[v], 0.0f);
      continue;
    }
    const Acc g = static_cast<Acc>(load(grad_loss[row]));
    const Acc row_lse = lse[row];
    const int64_t local_target = target[row] - vocab_start;
    for (int64_t v = 0; v < vocab_local; ++v) {
      const Acc is_target = v == local_target ? Acc(1) : Acc(0);
      store(dx[v], g * (std::exp(static_cast<Acc>(load(x[v])) - row_lse) - is_target));
    }
  }
}

}  // namespace

template <typename Acc>
void vocab_shard_stats(ElementType type, const void* logits, const int64_t* target, int64_t row_begin,
                       int64_t row_end, int64_t vocab_local, int64_t vocab_start, Acc* row_max,
                       Acc* row_sumexp, Acc* target_logit) {
  auto run = [&](auto* typed) {
    stats_rows(typed, target, row_begin, row_end, vocab_local, vocab_start, row_max, row_sumexp,
               target_logit);
  };
  switch (type) {
    case ElementType::kFloat32: return run(static_cast<const float*>(logits));
    case ElementType::kFloat64: return run(static_cast<const double*>(logits));
    case ElementType::kBFloat16: return run(static_cast<const BFloat16*>(logits));
    case ElementType::kFloat16: return run(static_cast<const Float16*>(logits));
  }
  throw std::invalid_argument("vocab_shard_stats: unknown element type");
}

template <typename Acc>
void vocab_shard_grad(ElementType type, const void* grad_loss, const void* logits, const int64_t* target,
                      const Acc* lse, int64_t row_begin, int64_t row_end, int64_t vocab_local,
                      int64_t vocab_start, int64_t ignore_index, void* grad_logits) {
  auto run = [&](auto* typed_grad_logits) {
    using T = std::remove_pointer_t<decltype(typed_grad_logits)>;
    grad_rows(static_cast<const T*>(grad_loss), static_cast<const T*>(logits), target, lse, row_begin,
              row_end, vocab_local, vocab_start, ignore_index, typed_grad_logits);
  };
  switch (type) {
    case ElementType::kFloat32: return run(static_cast<float*>(grad_logits));
    case ElementType::kFloat64: return run(static_cast<double*>(grad_logits));
    case ElementType::kBFloat16: return run(static_cast<BFloat16*>(grad_logits));
    case ElementType::kFloat16: return run(static_cast<Float16*>(grad_logits));
  }
  throw std::invalid_argument("vocab_shard_grad: unknown element type");
}

template void vocab_shard_stats<float>(ElementType, const void*, const int64_t*, int64_t, int64_t, int64_t,
                                       int64_t, float*, float*, float*);
template void vocab_shard_stats<double>(ElementType, const void*, const int64_t*, int64_t, int64_t,
                                        int64_t, int64_t, double*, double*, double*);
template void vocab_shard_grad<float>(ElementType, const void*, const void*, const int64_t*, const float*,
                                      int64_t, int64_t, int64_t, int64_t, int64_t, void*);
template void vocab_shard_grad<double>(ElementType, const void*, const void*, const int64_t*,
                                       const double*, int64_t, int64_t, int64_t, int64_t, int64_t, void*);

}  // namespace tdx::kernels::cpu
