// CPU kernels of the FP8 casts (contracts: kernels/fp8.h).

#include "kernels/fp8.h"

#include <type_traits>

#include "kernels/cpu/element.h"
#include "kernels/cpu/isa_clones.h"

namespace tdx::kernels {
namespace cpu {
namespace {

// The amax as the largest bit pattern of |x|: for non-negative floats the patterns order as the values,
// and every NaN's pattern lies above inf's, so a NaN wins. An integer max reduction vectorizes; a float
// one does not without fast-math.
template <typename T, Fp8Format kFormat>
void cast_chunk(const T* x, float scale, int64_t begin, int64_t end, uint8_t* out, float* partial_amax) {
  uint32_t amax_bits = 0;
  for (int64_t i = begin; i < end; ++i) {
    const float v = static_cast<float>(load(x[i]));
    const uint32_t magnitude_bits = float_bits(v) & 0x7FFFFFFFu;
    amax_bits = magnitude_bits > amax_bits ? magnitude_bits : amax_bits;
    out[i] = to_fp8(v, scale, kFormat);
  }
  *partial_amax = bits_float(amax_bits);
}

void cast_amax(const CastAmaxArgs& args, const Launch& launch) {
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(args.x);
    const float scale = *args.scale;
    for (int64_t item = launch.begin; item < launch.end; ++item) {
      const int64_t begin = item * args.chunk;
      const int64_t end = begin + args.chunk < args.count ? begin + args.chunk : args.count;
      if (args.format == Fp8Format::kE4M3) {
        cast_chunk<T, Fp8Format::kE4M3>(x, scale, begin, end, args.out, args.partial_amax + item);
      } else {
        cast_chunk<T, Fp8Format::kE5M2>(x, scale, begin, end, args.out, args.partial_amax + item);
      }
    }
  });
}

template <typename T, Fp8Format kFormat>
void cast_transpose_tile(const CastTransposeAmaxArgs& args, const T* x, float scale, int64_t item) {
  const int64_t tiles_per_row = (args.cols + kFp8Tile - 1) / kFp8Tile;
  const int64_t row_begin = (item / tiles_per_row) * kFp8Tile, col_begin = (item % tiles_per_row) * kFp8Tile;
  const int64_t row_end = row_begin + kFp8Tile < args.rows ? row_begin + kFp8Tile : args.rows;
  const int64_t col_end = col_begin + kFp8Tile < args.cols ? col_begin + kFp8Tile : args.cols;
  // Cast row by row (contiguous, vectorizable), keeping the tile's bytes; then write them column by column
  // from that L1-resident copy, so that the transposed writes are contiguous too.
  uint8_t tile[kFp8Tile][kFp8Tile];
  uint32_t amax_bits = 0;
  const int64_t width = col_end - col_begin;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* row = x + r * args.cols + col_begin;
    uint8_t* out = args.out + r * args.cols + col_begin;
    uint8_t* kept = tile[r - row_begin];
    for (int64_t c = 0; c < width; ++c) {
      const float v = static_cast<float>(load(row[c]));
      const uint32_t magnitude_bits = float_bits(v) & 0x7FFFFFFFu;
      amax_bits = magnitude_bits > amax_bits ? magnitude_bits : amax_bits;
      const uint8_t byte = to_fp8(v, scale, kFormat);
      out[c] = byte;
      kept[c] = byte;
    }
  }
  for (int64_t c = 0; c < width; ++c) {
    uint8_t* column = args.out_t + (col_begin + c) * args.ld_t + row_begin;
    for (int64_t r = 0; r < row_end - row_begin; ++r) column[r] = tile[r][c];
  }
  args.partial_amax[item] = bits_float(amax_bits);
}

void cast_transpose_amax(const CastTransposeAmaxArgs& args, const Launch& launch) {
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(args.x);
    const float scale = *args.scale;
    for (int64_t item = launch.begin; item < launch.end; ++item) {
      if (args.format == Fp8Format::kE4M3) {
        cast_transpose_tile<T, Fp8Format::kE4M3>(args, x, scale, item);
      } else {
        cast_transpose_tile<T, Fp8Format::kE5M2>(args, x, scale, item);
      }
    }
  });
}

// One block: its amax over the rows' contiguous runs (bit patterns, as cast_chunk), then the cast.
template <typename T, Fp8Format kFormat>
void cast_block(const CastBlockwiseArgs& args, const T* x, int64_t item) {
  const int64_t grid_cols = (args.cols + args.block_cols - 1) / args.block_cols;
  const int64_t row_begin = (item / grid_cols) * args.block_rows, col_begin = (item % grid_cols) * args.block_cols;
  const int64_t row_end = row_begin + args.block_rows < args.rows ? row_begin + args.block_rows : args.rows;
  const int64_t col_end = col_begin + args.block_cols < args.cols ? col_begin + args.block_cols : args.cols;
  uint32_t amax_bits = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* row = x + r * args.cols;
    for (int64_t c = col_begin; c < col_end; ++c) {
      const uint32_t magnitude_bits = float_bits(static_cast<float>(load(row[c]))) & 0x7FFFFFFFu;
      amax_bits = magnitude_bits > amax_bits ? magnitude_bits : amax_bits;
    }
  }
  const float scale = block_scale(bits_float(amax_bits), args.eps, kFormat, args.power_of_2);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* row = x + r * args.cols;
    uint8_t* out = args.out + r * args.cols;
    for (int64_t c = col_begin; c < col_end; ++c) out[c] = to_fp8(static_cast<float>(load(row[c])), scale, kFormat);
  }
  args.inverse_scale[item] = 1.0f / scale;
}

void cast_blockwise(const CastBlockwiseArgs& args, const Launch& launch) {
  visit_element_type(args.type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = static_cast<const T*>(args.x);
    for (int64_t item = launch.begin; item < launch.end; ++item) {
      if (args.format == Fp8Format::kE4M3) {
        cast_block<T, Fp8Format::kE4M3>(args, x, item);
      } else {
        cast_block<T, Fp8Format::kE5M2>(args, x, item);
      }
    }
  });
}

}  // namespace
}  // namespace cpu

const Fp8Kernels& Fp8Kernels::cpu(CpuIsa isa) {
  return cpu_kernel_table<Fp8Kernels, &cpu::cast_amax, &cpu::cast_transpose_amax, &cpu::cast_blockwise>(isa);
}

}  // namespace tdx::kernels
