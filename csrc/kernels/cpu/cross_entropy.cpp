#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "kernels/cpu/multiversion.h"
#include "kernels/cpu/vector_exp.h"

namespace tdx::kernels::cpu {
namespace {

// Reductions keep kLanes independent partial results so that the compiler
// vectorizes them without reassociating floating-point sums on its own
// (the build passes -fno-trapping-math so that selects become blends).
constexpr int kLanes = 16;

template <typename Acc>
TDX_INLINE Acc exp_acc(Acc x) {
  if constexpr (std::is_same_v<Acc, float>) {
    return exp_approx(x);
  } else {
    return std::exp(x);
  }
}

template <typename Acc>
TDX_INLINE Acc larger(Acc a, Acc b) {
  return a > b ? a : b;
}

template <typename T, typename Acc>
TDX_INLINE Acc row_max(const T* x, int64_t n) {
  Acc lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<Acc>::infinity();
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lanes[l] = larger(lanes[l], static_cast<Acc>(load(x[v + l])));
    }
  }
  Acc max = -std::numeric_limits<Acc>::infinity();
  for (; v < n; ++v) max = larger(max, static_cast<Acc>(load(x[v])));
  for (int l = 0; l < kLanes; ++l) max = larger(max, lanes[l]);
  return max;
}

template <typename T, typename Acc>
TDX_INLINE Acc row_sumexp(const T* x, int64_t n, Acc max) {
  Acc lanes[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lanes[l] += exp_acc<Acc>(static_cast<Acc>(load(x[v + l])) - max);
    }
  }
  for (; v < n; ++v) {
    lanes[0] += exp_acc<Acc>(static_cast<Acc>(load(x[v])) - max);
  }
  Acc sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename T, typename Acc>
TDX_MULTIVERSION void stats_rows(const T* logits, const int64_t* target, int64_t row_begin, int64_t row_end,
                int64_t vocab_local, int64_t vocab_start, Acc* max_out, Acc* sumexp_out,
                Acc* target_logit) {
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* x = logits + row * vocab_local;
    const Acc max = row_max<T, Acc>(x, vocab_local);
    max_out[row] = max;
    sumexp_out[row] = row_sumexp<T, Acc>(x, vocab_local, max);
    const int64_t local_target = target[row] - vocab_start;
    target_logit[row] = (local_target >= 0 && local_target < vocab_local)
                            ? static_cast<Acc>(load(x[local_target]))
                            : Acc(0);
  }
}

template <typename T, typename Acc>
TDX_MULTIVERSION void grad_rows(const T* grad_loss, const T* logits, const int64_t* target, const Acc* lse,
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
    for (int64_t v = 0; v < vocab_local; ++v) {
      store(dx[v], g * exp_acc<Acc>(static_cast<Acc>(load(x[v])) - row_lse));
    }
    const int64_t local_target = target[row] - vocab_start;
    if (local_target >= 0 && local_target < vocab_local) {
      const Acc p = exp_acc<Acc>(static_cast<Acc>(load(x[local_target])) - row_lse);
      store(dx[local_target], g * (p - Acc(1)));
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
