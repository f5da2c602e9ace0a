#pragma once
// How the CUDA kernels are launched. TDX_LAUNCH(grid, block, stream, kernel)(args...)
// stands for kernel<<<grid, block, 0, stream>>>(args...) (as HIP's
// hipLaunchKernelGGL does), so that tests/cpp can compile these sources with
// a host compiler and run them on its CPU stand-in of the runtime
// (tests/cpp/cuda_emulation), which defines its own TDX_LAUNCH.

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#ifndef TDX_LAUNCH
#define TDX_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>
#endif

namespace tdx::kernels::cuda {

// Throws if the last launch failed (a bad configuration, no kernel image for this GPU).
inline void check_launch(const char* kernel_name) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) throw std::runtime_error(std::string(kernel_name) + ": " + cudaGetErrorString(error));
}

}  // namespace tdx::kernels::cuda
