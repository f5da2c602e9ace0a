// CUDA kernel of the counter-based initialisation (contract: kernels/init.h).

#include "kernels/init.h"

#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels {
namespace cuda {
namespace {

constexpr int kInitThreads = 256;

// One block per block row (the launch's rows from row_begin); threads stride over its columns.
template <typename T>
__global__ void trunc_normal_kernel(TruncNormalArgs args, int64_t row_begin) {
  const int64_t row = row_begin + blockIdx.x;
  const int64_t start = block_row_start(args, row);
  T* out_row = static_cast<T*>(args.out) + row * args.cols;
  for (int64_t col = threadIdx.x; col < args.cols; col += kInitThreads) {
    const float value = counter_trunc_normal(args.stream, static_cast<uint64_t>(start + col), args.mean, args.std,
                                             args.a, args.b, args.low, args.high);
    out_row[col] = store_as<T>(value);
  }
}

void trunc_normal(const TruncNormalArgs& args, const Launch& launch) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TDX_LAUNCH(blocks, kInitThreads, static_cast<cudaStream_t>(launch.stream), trunc_normal_kernel<T>)(
        args, launch.begin);
  });
  check_launch("init trunc_normal");
}

}  // namespace
}  // namespace cuda

const InitKernels& InitKernels::cuda() {
  static const InitKernels table{&cuda::trunc_normal};
  return table;
}

}  // namespace tdx::kernels
