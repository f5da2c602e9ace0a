// FP8 scaled casts, host side for every device: argument checks and the cast
// kernel of kernels/fp8.h, whose per-chunk amaxes are reduced here.

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/fp8.h"
#include "ops/device.h"

namespace tdx::ops {
namespace {

constexpr const char* kCastAmax = "fp8_cast_amax";
constexpr int64_t kChunk = 8192;  // elements per work item (a CPU task's share, a GPU block's)

kernels::Fp8Format fp8_format(const char* op, c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float8_e4m3fn: return kernels::Fp8Format::kE4M3;
    case c10::ScalarType::Float8_e5m2: return kernels::Fp8Format::kE5M2;
    default: TORCH_CHECK_VALUE(false, op, ": fp8_dtype must be float8_e4m3fn or float8_e5m2, got ", type);
  }
}

std::tuple<at::Tensor, at::Tensor> fp8_cast_amax(const at::Tensor& x, const at::Tensor& scale,
                                                 c10::ScalarType fp8_dtype) {
  const auto format = fp8_format(kCastAmax, fp8_dtype);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   kCastAmax, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, kCastAmax, ": scale must be float32, got ", scale.scalar_type());
  TORCH_CHECK_VALUE(scale.numel() == 1, kCastAmax, ": scale must hold one value, got shape ", scale.sizes());
  TORCH_CHECK_VALUE(scale.device() == x.device(), kCastAmax, ": scale must be on x's device ", x.device(), ", got ",
                    scale.device());
  const auto input = x.contiguous();
  const auto scale_value = scale.contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  const int64_t count = x.numel();
  const int64_t items = (count + kChunk - 1) / kChunk;
  auto partial_amax = at::empty({items}, x.options().dtype(at::kFloat));
  const kernels::CastAmaxArgs args{element_type(kCastAmax, x.scalar_type()),
                                   format,
                                   count,
                                   kChunk,
                                   input.data_ptr(),
                                   scale_value.data_ptr<float>(),
                                   static_cast<uint8_t*>(out.data_ptr()),
                                   partial_amax.data_ptr<float>()};
  launch(kernels_for<kernels::Fp8Kernels>(kCastAmax, x.device()).cast_amax, args, x.device(), items, 1);
  // at::amax propagates NaN, so one NaN chunk makes the whole amax NaN.
  auto amax = items > 0 ? at::amax(partial_amax) : at::zeros({}, partial_amax.options());
  return {out, amax};
}

constexpr const char* kCastTransposeAmax = "fp8_cast_transpose_amax";

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_transpose_amax(const at::Tensor& x, const at::Tensor& scale,
                                                                       c10::ScalarType fp8_dtype,
                                                                       int64_t row_multiple) {
  const char* op = kCastTransposeAmax;
  const auto format = fp8_format(op, fp8_dtype);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be 2-D [rows, cols], got shape ", x.sizes());
  TORCH_CHECK_VALUE(row_multiple >= 1, op, ": row_multiple must be >= 1, got ", row_multiple);
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, op, ": scale must be float32, got ", scale.scalar_type());
  TORCH_CHECK_VALUE(scale.numel() == 1, op, ": scale must hold one value, got shape ", scale.sizes());
  TORCH_CHECK_VALUE(scale.device() == x.device(), op, ": scale must be on x's device ", x.device(), ", got ",
                    scale.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t ld_t = (rows + row_multiple - 1) / row_multiple * row_multiple;
  const auto input = x.contiguous();
  const auto scale_value = scale.contiguous();
  auto out = at::empty({rows, cols}, x.options().dtype(fp8_dtype));
  // The padding rows of the transposed copy (columns of out_t past rows) are zero bytes: +0 in both formats.
  auto out_t = ld_t == rows ? at::empty({cols, ld_t}, x.options().dtype(fp8_dtype))
                            : at::zeros({cols, ld_t}, x.options().dtype(at::kByte)).view(fp8_dtype);
  const int64_t items = ((rows + kernels::kFp8Tile - 1) / kernels::kFp8Tile) *
                        ((cols + kernels::kFp8Tile - 1) / kernels::kFp8Tile);
  auto partial_amax = at::empty({items}, x.options().dtype(at::kFloat));
  const kernels::CastTransposeAmaxArgs args{element_type(op, x.scalar_type()),
                                            format,
                                            rows,
                                            cols,
                                            ld_t,
                                            input.data_ptr(),
                                            scale_value.data_ptr<float>(),
                                            static_cast<uint8_t*>(out.data_ptr()),
                                            static_cast<uint8_t*>(out_t.data_ptr()),
                                            partial_amax.data_ptr<float>()};
  launch(kernels_for<kernels::Fp8Kernels>(op, x.device()).cast_transpose_amax, args, x.device(), items, 4);
  auto amax = items > 0 ? at::amax(partial_amax) : at::zeros({}, partial_amax.options());
  return {out, out_t, amax};
}

constexpr const char* kCastBlockwise = "fp8_cast_blockwise";

std::tuple<at::Tensor, at::Tensor> fp8_cast_blockwise(const at::Tensor& x, int64_t block_rows, int64_t block_cols,
                                                      c10::ScalarType fp8_dtype, bool power_of_2, double eps) {
  const char* op = kCastBlockwise;
  const auto format = fp8_format(op, fp8_dtype);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be 2-D [rows, cols], got shape ", x.sizes());
  TORCH_CHECK_VALUE(block_rows >= 1 && block_cols >= 1, op, ": block_rows and block_cols must be >= 1, got ",
                    block_rows, " and ", block_cols);
  TORCH_CHECK_VALUE(eps > 0 && eps < 1e38, op, ": eps must be a positive finite fp32 number, got ", eps);
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t grid_rows = (rows + block_rows - 1) / block_rows, grid_cols = (cols + block_cols - 1) / block_cols;
  const auto input = x.contiguous();
  auto out = at::empty({rows, cols}, x.options().dtype(fp8_dtype));
  auto inverse_scale = at::empty({grid_rows, grid_cols}, x.options().dtype(at::kFloat));
  const kernels::CastBlockwiseArgs args{element_type(op, x.scalar_type()),
                                        format,
                                        rows,
                                        cols,
                                        block_rows,
                                        block_cols,
                                        static_cast<float>(eps),
                                        power_of_2,
                                        input.data_ptr(),
                                        static_cast<uint8_t*>(out.data_ptr()),
                                        inverse_scale.data_ptr<float>()};
  const int64_t per_block = std::min(block_rows, rows) * std::min(block_cols, cols);
  launch(kernels_for<kernels::Fp8Kernels>(op, x.device()).cast_blockwise, args, x.device(), grid_rows * grid_cols,
         std::max<int64_t>(1, 16384 / std::max<int64_t>(1, per_block)));
  return {out, inverse_scale};
}

}  // namespace

TDX_IMPL_ON_EVERY_DEVICE(register_fp8) {
  m.impl("fp8_cast_amax", &fp8_cast_amax);
  m.impl("fp8_cast_transpose_amax", &fp8_cast_transpose_amax);
  m.impl("fp8_cast_blockwise", &fp8_cast_blockwise);
}

}  // namespace tdx::ops
