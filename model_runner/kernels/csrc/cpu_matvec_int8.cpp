// The int8 projection (cpu_linear.Int8Linear) of a few rows, as a torch op
// (torch.ops.pagedserve.int8_matvec): what fbgemm's dynamic int8 linear
// (torch.ops.quantized.linear_dynamic with reduce_range) computes, to the bit, followed by
// Int8Linear's per-row scale and bias, read from a row-major copy of the int8 weight. At one
// to four rows fbgemm's blocked GEMM reaches a fraction of the memory's bandwidth
// (docs/benchmarks.md); here each weight row is read once and dotted with every input row.
//
// To give fbgemm's numbers, the input is quantized as fbgemm quantizes it: one grid for the
// whole call from the input's minimum and maximum (torch's ChooseQuantizationParams with
// 7 bits), each value rounded to nearest even after a fused multiply-add; the products of
// the quantized input (less its zero point) and the weight sum exactly in int32, in any
// order; then the same float32 dequantization, one rounding per multiply.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_ops.h"
#include "weight_stream.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;
// Output rows a thread takes at least: an int8 row of 576 is ~0.6 KiB of weight.
constexpr int64_t kGrain = 256;

struct Grid {
  float scale;
  int32_t zero_point;
};

// NOTE: torch's quant_utils::ChooseQuantizationParams (ATen/native/quantized/cpu/
// QuantUtils.h) as fbgemm's dynamic linear calls it: unsigned 8 bits halved to 0..127 by
// reduce_range, no symmetric grid, no power-of-two scale. Its double-precision steps and
// its small-scale cut are kept, so the grid is the same one.
Grid activation_grid(float min, float max) {
  constexpr int32_t qmin = 0, qmax = 127;
  constexpr float kSmallScale = 6.1e-5f;  // torch's SMALL_SCALE_THRESHOLD
  min = std::min(min, 0.f);
  max = std::max(max, 0.f);
  double scale = (static_cast<double>(max) - min) / (qmax - qmin);
  if (static_cast<float>(scale) == 0.f || std::isinf(1.f / static_cast<float>(scale))) {
    scale = 0.1;
  }
  if (scale < kSmallScale) {
    const float unclipped = static_cast<float>(scale);
    scale = kSmallScale;
    if (min == 0.f) {
      max = kSmallScale * (qmax - qmin);
    } else if (max == 0.f) {
      min = -kSmallScale * (qmax - qmin);
    } else {
      const float amplifier = kSmallScale / unclipped;
      min *= amplifier;
      max *= amplifier;
    }
  }
  const double from_min = qmin - min / scale, from_max = qmax - max / scale;
  const double from_min_error = std::abs(qmin) - std::abs(min / scale);
  const double from_max_error = std::abs(qmax) - std::abs(max / scale);
  const double initial = from_min_error < from_max_error ? from_min : from_max;
  const int32_t zero_point = initial < qmin   ? qmin
                             : initial > qmax ? qmax
                                              : static_cast<int32_t>(std::nearbyint(initial));
  return {static_cast<float>(scale), zero_point};
}

// Rows of x quantized on `grid` as fbgemm's QuantizeAvx2 does (fma(x, 1 / scale, zero
// point), rounded to nearest even, clamped to 0..255; clamping first rounds the same), less
// the zero point: int16 rows of `width` values, one after another.
std::vector<int16_t> quantized_rows(const float* x, int64_t stride, int64_t rows,
                                    int64_t width, Grid grid) {
  const float inverse = 1.f / grid.scale;
  const float zero_point = static_cast<float>(grid.zero_point);
  std::vector<int16_t> out(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; ++i) {
      const float t = std::clamp(std::fma(x[r * stride + i], inverse, zero_point), 0.f, 255.f);
      out[r * width + i] = static_cast<int16_t>(std::nearbyint(t) - zero_point);
    }
  }
  return out;
}

// sums[r] = w . x_r over `width` for R rows of x, exactly: products of int16 (the input,
// -127..255) and int8 (the weight) fit int16 pairs summed into int32 (madd), so nothing
// saturates, as AVX2's unsigned-by-signed byte products could.
template <int R>
inline void dot_rows(const int8_t* w, const int16_t* x, int64_t width, int32_t* sums) {
  int64_t i = 0;
#if defined(__AVX2__)
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (; i + 16 <= width; i += 16) {
    const __m256i w16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    for (int r = 0; r < R; ++r) {
      const __m256i xr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * width + i));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(w16, xr));
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128i half =
        _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
    sums[r] = _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 1)));
  }
#else
  for (int r = 0; r < R; ++r) sums[r] = 0;
#endif
  for (; i < width; ++i) {
    for (int r = 0; r < R; ++r) sums[r] += static_cast<int32_t>(w[i]) * x[r * width + i];
  }
}

// The value rounded to float32 as it stands: the compiler may not fuse the multiply that
// made it into the add that follows (one rounding instead of fbgemm's and torch's two).
inline float rounded(float v) {
  asm volatile("" : "+m"(v));
  return v;
}

struct Dequantization {
  float input_scale;
  const float* weight_scales;  // [out]
  const float* row_scales;     // [rows]
  const float* bias;           // [out] or nullptr
};

template <int R>
void matvec_rows(const int16_t* x, const int8_t* w, const Dequantization& dq, float* y,
                 int64_t width, int64_t out_features) {
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    int32_t sums[R];
    for (int64_t o = begin; o < end; ++o) {
      pagedserve::prefetch_ahead(w + o * width, width);
      dot_rows<R>(w + o * width, x, width, sums);
      // fbgemm's ReQuantizeForFloat, then Int8Linear's row scale and bias
      const float multiplier = dq.input_scale * dq.weight_scales[o];
      const float b = dq.bias == nullptr ? 0.f : dq.bias[o];
      for (int r = 0; r < R; ++r) {
        const float value = static_cast<float>(sums[r]) * multiplier * dq.row_scales[r];
        y[r * out_features + o] = dq.bias == nullptr ? value : rounded(value) + b;
      }
    }
  });
}

void check_inputs(const at::Tensor& x, const at::Tensor& row_scales, const at::Tensor& weight,
                  const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows && x.size(1) > 0,
              "int8_matvec: x must be float32 [n <= 4, in > 0] with contiguous columns");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() &&
                  row_scales.numel() == x.size(0),
              "int8_matvec: row_scales must be float32 with one value per row of x");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1) &&
                  weight.scalar_type() == at::kChar,
              "int8_matvec: weight must be contiguous int8 [out, in]");
  TORCH_CHECK(weight_scales.dim() == 1 && weight_scales.size(0) == weight.size(0) &&
                  weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous(),
              "int8_matvec: weight_scales must be float32 [out]");
  TORCH_CHECK(!bias.has_value() ||
                  (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                   bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "int8_matvec: bias must be float32 [out]");
}

}  // namespace

namespace pagedserve {

// x [n, in] float32 (n up to 4, columns contiguous), row_scales [n] or [n, 1] float32,
// weight [out, in] int8 contiguous with weight_scales [out] float32 (one grid per output
// row, zero point 0), bias [out] float32 or None: [n, out] float32, which is
// linear_dynamic(x, weight, reduce_range=True) * row_scales + bias.
at::Tensor int8_matvec(const at::Tensor& x, const at::Tensor& row_scales, const at::Tensor& weight,
                       const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias) {
  check_inputs(x, row_scales, weight, weight_scales, bias);
  const int64_t rows = x.size(0), width = x.size(1), out_features = weight.size(0);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  const float* in = x.data_ptr<float>();
  float min = in[0], max = in[0];
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in + r * x.stride(0);
    const auto [low, high] = std::minmax_element(row, row + width);
    min = std::min(min, *low);
    max = std::max(max, *high);
  }
  const Grid grid = activation_grid(min, max);
  const std::vector<int16_t> quantized = quantized_rows(in, x.stride(0), rows, width, grid);
  const Dequantization dq{grid.scale, weight_scales.data_ptr<float>(),
                          row_scales.data_ptr<float>(),
                          bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const int8_t* w = weight.data_ptr<int8_t>();
  float* out = y.data_ptr<float>();
  switch (rows) {
    case 1: matvec_rows<1>(quantized.data(), w, dq, out, width, out_features); break;
    case 2: matvec_rows<2>(quantized.data(), w, dq, out, width, out_features); break;
    case 3: matvec_rows<3>(quantized.data(), w, dq, out, width, out_features); break;
    default: matvec_rows<4>(quantized.data(), w, dq, out, width, out_features); break;
  }
  return y;
}

}  // namespace pagedserve
