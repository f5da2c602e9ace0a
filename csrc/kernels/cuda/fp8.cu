// CUDA kernels of the FP8 casts (contracts: kernels/fp8.h).

#include "kernels/fp8.h"

#include <type_traits>

#include "kernels/cuda/element.cuh"

namespace tdx::kernels {
namespace cuda {
namespace {

constexpr int kCastThreads = 256;

// The max over the block's kCastThreads threads of each one's value (NaN if any is NaN), for thread 0.
__device__ float block_amax(float value) {
  __shared__ float values[kCastThreads];
  values[threadIdx.x] = value;
  __syncthreads();
  for (int half = kCastThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      const float a = values[threadIdx.x], b = values[threadIdx.x + half];
      values[threadIdx.x] = (a != a || b != b) ? NAN : (a > b ? a : b);
    }
    __syncthreads();
  }
  return values[0];
}

// One block per chunk: threads stride over its elements, then a block-wide max (NaN wins).
template <typename T>
__global__ void cast_amax_kernel(const T* __restrict__ x, const float* __restrict__ scale, Fp8Format format,
                                 int64_t count, int64_t chunk, uint8_t* __restrict__ out,
                                 float* __restrict__ partial_amax, int64_t item_begin) {
  const int64_t item = item_begin + blockIdx.x;
  const int64_t begin = item * chunk;
  const int64_t end = begin + chunk < count ? begin + chunk : count;
  const float s = *scale;
  float amax = 0;
  bool nan = false;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = static_cast<float>(load(x[i]));
    const float magnitude = fabsf(v);
    amax = magnitude > amax ? magnitude : amax;
    nan |= v != v;
    out[i] = to_fp8(v, s, format);
  }
  const float tile_amax = block_amax(nan ? NAN : amax);
  if (threadIdx.x == 0) partial_amax[item] = tile_amax;
}

void cast_amax(const CastAmaxArgs& args, const Launch& launch) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TDX_LAUNCH(blocks, kCastThreads, static_cast<cudaStream_t>(launch.stream), cast_amax_kernel<T>)(
        static_cast<const T*>(args.x), args.scale, args.format, args.count, args.chunk, args.out, args.partial_amax,
        launch.begin);
  });
  check_launch("fp8 cast_amax");
}

// One block per 32 x 32 tile, 256 threads as 8 rows of 32 lanes: each thread casts 4 elements of the tile
// (reads and row-major writes coalesced along the columns), the bytes meet in shared memory, and the
// transposed writes are coalesced along the rows; then a block-wide max (NaN wins).
template <typename T>
__global__ void cast_transpose_amax_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                                           Fp8Format format, int64_t rows, int64_t cols, int64_t ld_t,
                                           uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                           float* __restrict__ partial_amax, int64_t item_begin) {
  constexpr int kLanes = 32, kRowsPerPass = kCastThreads / kLanes;
  const int64_t item = item_begin + blockIdx.x;
  const int64_t tiles_per_row = (cols + kFp8Tile - 1) / kFp8Tile;
  const int64_t row_begin = (item / tiles_per_row) * kFp8Tile, col_begin = (item % tiles_per_row) * kFp8Tile;
  const int lane = static_cast<int>(threadIdx.x) % kLanes, pass_row = static_cast<int>(threadIdx.x) / kLanes;
  const float s = *scale;
  __shared__ uint8_t tile[kFp8Tile][kFp8Tile + 1];
  float amax = 0;
  bool nan = false;
  for (int j = pass_row; j < kFp8Tile; j += kRowsPerPass) {
    const int64_t r = row_begin + j, c = col_begin + lane;
    if (r < rows && c < cols) {
      const float v = static_cast<float>(load(x[r * cols + c]));
      const float magnitude = fabsf(v);
      amax = magnitude > amax ? magnitude : amax;
      nan |= v != v;
      const uint8_t byte = to_fp8(v, s, format);
      out[r * cols + c] = byte;
      tile[j][lane] = byte;
    }
  }
  __syncthreads();
  for (int j = pass_row; j < kFp8Tile; j += kRowsPerPass) {
    const int64_t c = col_begin + j, r = row_begin + lane;
    if (r < rows && c < cols) out_t[c * ld_t + r] = tile[lane][j];
  }
  const float tile_amax = block_amax(nan ? NAN : amax);
  if (threadIdx.x == 0) partial_amax[item] = tile_amax;
}

void cast_transpose_amax(const CastTransposeAmaxArgs& args, const Launch& launch) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TDX_LAUNCH(blocks, kCastThreads, static_cast<cudaStream_t>(launch.stream), cast_transpose_amax_kernel<T>)(
        static_cast<const T*>(args.x), args.scale, args.format, args.rows, args.cols, args.ld_t, args.out,
        args.out_t, args.partial_amax, launch.begin);
  });
  check_launch("fp8 cast_transpose_amax");
}

// One CUDA block per scale block: the threads stride over its elements for the amax (a block-wide max, NaN
// wins), then again to cast them with the block's scale; thread 0 writes the inverse scale.
template <typename T>
__global__ void cast_blockwise_kernel(const T* __restrict__ x, Fp8Format format, int64_t rows, int64_t cols,
                                      int64_t block_rows, int64_t block_cols, float eps, bool power_of_2,
                                      uint8_t* __restrict__ out, float* __restrict__ inverse_scale,
                                      int64_t item_begin) {
  const int64_t item = item_begin + blockIdx.x;
  const int64_t grid_cols = (cols + block_cols - 1) / block_cols;
  const int64_t row_begin = (item / grid_cols) * block_rows, col_begin = (item % grid_cols) * block_cols;
  const int64_t height = (row_begin + block_rows < rows ? row_begin + block_rows : rows) - row_begin;
  const int64_t width = (col_begin + block_cols < cols ? col_begin + block_cols : cols) - col_begin;
  float amax = 0;
  bool nan = false;
  for (int64_t i = threadIdx.x; i < height * width; i += blockDim.x) {
    const float v = static_cast<float>(load(x[(row_begin + i / width) * cols + col_begin + i % width]));
    const float magnitude = fabsf(v);
    amax = magnitude > amax ? magnitude : amax;
    nan |= v != v;
  }
  const float scale = block_scale(block_amax(nan ? NAN : amax), eps, format, power_of_2);
  for (int64_t i = threadIdx.x; i < height * width; i += blockDim.x) {
    const int64_t at = (row_begin + i / width) * cols + col_begin + i % width;
    out[at] = to_fp8(static_cast<float>(load(x[at])), scale, format);
  }
  if (threadIdx.x == 0) inverse_scale[item] = 1.0f / scale;
}

void cast_blockwise(const CastBlockwiseArgs& args, const Launch& launch) {
  const int64_t blocks = launch.end - launch.begin;
  if (blocks == 0) return;
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TDX_LAUNCH(blocks, kCastThreads, static_cast<cudaStream_t>(launch.stream), cast_blockwise_kernel<T>)(
        static_cast<const T*>(args.x), args.format, args.rows, args.cols, args.block_rows, args.block_cols,
        args.eps, args.power_of_2, args.out, args.inverse_scale, launch.begin);
  });
  check_launch("fp8 cast_blockwise");
}

}  // namespace
}  // namespace cuda

const Fp8Kernels& Fp8Kernels::cuda() {
  static const Fp8Kernels table{&cuda::cast_amax, &cuda::cast_transpose_amax, &cuda::cast_blockwise};
  return table;
}

}  // namespace tdx::kernels
