// CPU kernels of the vocab-parallel cross-entropy (contracts: kernels/cross_entropy.h).

#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels/cpu/element.h"
#include "kernels/cpu/isa_clones.h"
#include "kernels/cpu/vector_exp.h"

namespace tdx::kernels {
namespace cpu {
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
inline Acc exp_acc(Acc x) {
  if constexpr (std::is_same_v<Acc, float>) {
    return exp_approx(x);
  } else {
    return std::exp(x);
  }
}

template <typename Acc>
inline Acc larger(Acc a, Acc b) {
  return a > b ? a : b;
}

// The block x[0, n) as Acc values: x itself when it already is, else widened into buffer.
template <typename T, typename Acc>
inline const Acc* widen(const T* x, int64_t n, Acc* buffer) {
  if constexpr (std::is_same_v<T, Acc>) {
    return x;
  } else {
    for (int64_t v = 0; v < n; ++v) buffer[v] = static_cast<Acc>(load(x[v]));
    return buffer;
  }
}

// Writes values[0, n) into out, rounding to T.
template <typename T, typename Acc>
inline void narrow(const Acc* values, int64_t n, T* out) {
  for (int64_t v = 0; v < n; ++v) store(out[v], values[v]);
}

template <typename Acc>
inline Acc block_max(const Acc* x, int64_t n) {
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
inline Acc block_sumexp(const Acc* x, int64_t n, Acc max) {
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
void stats_rows(const T* logits, const int64_t* target, int64_t row_begin, int64_t row_end,
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
void grad_rows(const T* grad_loss, const T* logits, const int64_t* target, const Acc* lse,
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

void shard_stats(const ShardStatsArgs& args, const Launch& launch) {
  visit_element_type(args.shard.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = accumulator_t<T>;
    auto* stats = static_cast<Acc*>(args.stats);
    const int64_t rows = args.shard.rows;
    stats_rows(static_cast<const T*>(args.logits), args.target, launch.begin, launch.end, args.shard.vocab_local,
               args.shard.vocab_start, stats, stats + rows, stats + 2 * rows);
  });
}

void shard_grad(const ShardGradArgs& args, const Launch& launch) {
  visit_element_type(args.shard.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    grad_rows(static_cast<const T*>(args.grad_loss), static_cast<const T*>(args.logits), args.target,
              static_cast<const accumulator_t<T>*>(args.lse), launch.begin, launch.end, args.shard.vocab_local,
              args.shard.vocab_start, args.ignore_index, static_cast<T*>(args.grad_logits));
  });
}

}  // namespace
}  // namespace cpu

const CrossEntropyKernels& CrossEntropyKernels::cpu(CpuIsa isa) {
  return cpu_kernel_table<CrossEntropyKernels, &cpu::shard_stats, &cpu::shard_grad>(isa);
}

}  // namespace tdx::kernels
