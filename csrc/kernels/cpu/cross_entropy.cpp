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

// Rows are processed in blocks of kBlock elements: 16-bit inputs are widened
// into an L1-resident Acc buffer once per block (a plain conversion loop), and
// the row's statistics are updated online from each block's maximum, so the
// logits are read from memory once.
constexpr int64_t kBlock = 2048;

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

// The block x[0, n) as Acc values: x itself when it already is, else widened into buffer.
template <typename T, typename Acc>
TDX_INLINE const Acc* widen(const T* x, int64_t n, Acc* buffer) {
  if constexpr (std::is_same_v<T, Acc>) {
    return x;
  } else {
    for (int64_t v = 0; v < n; ++v) buffer[v] = static_cast<Acc>(load(x[v]));
    return buffer;
  }
}

// Writes values[0, n) into out, rounding to T.
template <typename T, typename Acc>
TDX_INLINE void narrow(const Acc* values, int64_t n, T* out) {
  for (int64_t v = 0; v < n; ++v) store(out[v], values[v]);
}

template <typename Acc>
TDX_INLINE Acc block_max(const Acc* x, int64_t n) {
  Acc lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<Acc>::infinity();
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = larger(lanes[l], x[v + l]);
  }
  Acc max = -std::numeric_limits<Acc>::infinity();
  for (; v < n; ++v) max = larger(max, x[v]);
  for (int l = 0; l < kLanes; ++l) max = larger(max, lanes[l]);
  return max;
}

template <typename Acc>
TDX_INLINE Acc block_sumexp(const Acc* x, int64_t n, Acc max) {
  Acc lanes[kLanes] = {};
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += exp_acc<Acc>(x[v + l] - max);
  }
  for (; v < n; ++v) lanes[0] += exp_acc<Acc>(x[v] - max);
  Acc sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename T, typename Acc>
TDX_MULTIVERSION void stats_rows(const T* logits, const int64_t* target, int64_t row_begin, int64_t row_end,
                                 int64_t vocab_local, int64_t vocab_start, Acc* max_out, Acc* sumexp_out,
                                 Acc* target_logit) {
  alignas(64) Acc buffer[kBlock];
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* x = logits + row * vocab_local;
    // Online: when a block raises the maximum, the sum so far is rescaled to it.
    Acc max = -std::numeric_limits<Acc>::infinity();
    Acc sumexp = 0;
    for (int64_t begin = 0; begin < vocab_local; begin += kBlock) {
      const int64_t n = std::min(kBlock, vocab_local - begin);
      const Acc* block = widen(x + begin, n, buffer);
      const Acc new_max = larger(max, block_max(block, n));
      // While every logit so far is -inf (masked), shift by 0: -inf - -inf is NaN.
      const Acc shift = new_max == -std::numeric_limits<Acc>::infinity() ? Acc(0) : new_max;
      sumexp = sumexp * exp_acc<Acc>(max - shift) + block_sumexp(block, n, shift);
      max = new_max;
    }
    max_out[row] = max;
    sumexp_out[row] = sumexp;
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
  alignas(64) Acc input[kBlock];
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* x = logits + row * vocab_local;
    T* dx = grad_logits + row * vocab_local;
    if (target[row] == ignore_index) {
      for (int64_t v = 0; v < vocab_local; ++v) store(dx[v], Acc(0));
      continue;
    }
    const Acc g = static_cast<Acc>(load(grad_loss[row]));
    const Acc row_lse = lse[row];
    // Read before the row is written: grad_logits may be logits itself.
    const int64_t local_target = target[row] - vocab_start;
    const bool target_here = local_target >= 0 && local_target < vocab_local;
    const Acc target_logit = target_here ? static_cast<Acc>(load(x[local_target])) : Acc(0);
    for (int64_t begin = 0; begin < vocab_local; begin += kBlock) {
      const int64_t n = std::min(kBlock, vocab_local - begin);
      const Acc* block = widen(x + begin, n, input);
      if constexpr (std::is_same_v<T, Acc>) {
        for (int64_t v = 0; v < n; ++v) dx[begin + v] = g * exp_acc<Acc>(block[v] - row_lse);
      } else {
        alignas(64) Acc output[kBlock];
        for (int64_t v = 0; v < n; ++v) output[v] = g * exp_acc<Acc>(block[v] - row_lse);
        narrow(output, n, dx + begin);
      }
    }
    if (target_here) {
      store(dx[local_target], g * (exp_acc<Acc>(target_logit - row_lse) - Acc(1)));
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
