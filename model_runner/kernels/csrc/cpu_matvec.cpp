// y = x @ weight.T + bias for a few rows of x (a small decode batch), on a row-major
// float32 or float16 weight, as a torch op (torch.ops.pagedserve.matvec). At one to four
// rows a projection only streams its weight once: each weight row is read once and dotted
// with every input row, four at a time, with two accumulators of eight lanes each. The
// GEMM libraries (oneDNN, fbgemm) run the same shapes through their blocked GEMM and
// reach less of the memory's bandwidth there (docs/benchmarks.md);
// model_runner/kernels/cpu_kernel_table.py gives the rows it takes (the path "matvec").
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_ops.h"
#include "vec8.h"
#include "weight_stream.h"

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

using pagedserve::load8;
using pagedserve::sum8;
using pagedserve::Vec8;

constexpr int64_t kMaxRows = 8;
// Output rows a thread takes at least: a float32 row of 576 is ~2 KiB of weight.
constexpr int64_t kGrain = 64;

// Up to four rows of x dotted with one weight row: each weight vector is loaded once for
// all of them. A row's products go sixteen at a time into its two accumulators, then a
// tail of eight: the same sums in the same order whatever the number of rows, so a row's
// result does not depend on the rows beside it (a verified draft's logits are the ones a
// plain decode of the same token would have had).
template <int R, typename W>
inline void dot_rows(const W* w, const float* x, int64_t x_stride, int64_t width, float* out) {
  Vec8 even[R] = {}, odd[R] = {};
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    const Vec8 w0 = load8(w + i), w1 = load8(w + i + 8);
    for (int r = 0; r < R; ++r) {
      even[r] += w0 * load8(x + r * x_stride + i);
      odd[r] += w1 * load8(x + r * x_stride + i + 8);
    }
  }
  if (i < width) {
    const Vec8 w0 = load8(w + i);
    for (int r = 0; r < R; ++r) even[r] += w0 * load8(x + r * x_stride + i);
  }
  for (int r = 0; r < R; ++r) out[r] = sum8(even[r] + odd[r]);
}

template <typename W>
inline void dot_any(const W* w, const float* x, int64_t x_stride, int64_t num_rows,
                    int64_t width, float* out) {
  for (int64_t r = 0; r < num_rows; r += 4, x += 4 * x_stride, out += 4) {
    switch (std::min<int64_t>(num_rows - r, 4)) {
      case 1: dot_rows<1>(w, x, x_stride, width, out); break;
      case 2: dot_rows<2>(w, x, x_stride, width, out); break;
      case 3: dot_rows<3>(w, x, x_stride, width, out); break;
      default: dot_rows<4>(w, x, x_stride, width, out); break;
    }
  }
}

template <typename W>
void matvec_rows(const float* x, int64_t x_stride, int64_t num_rows, const W* w,
                 const float* bias, float* y, int64_t width, int64_t out_features) {
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    float dots[kMaxRows];
    for (int64_t o = begin; o < end; ++o) {
      pagedserve::prefetch_ahead(w + o * width, width * static_cast<int64_t>(sizeof(W)));
      dot_any(w + o * width, x, x_stride, num_rows, width, dots);
      const float b = bias == nullptr ? 0.f : bias[o];
      for (int64_t r = 0; r < num_rows; ++r) y[r * out_features + o] = dots[r] + b;
    }
  });
}

}  // namespace

namespace pagedserve {

// x [n, in] float32 (n up to 8, columns contiguous), weight [out, in] float32 or float16
// contiguous (in a multiple of 8), bias [out] float32 or None: [n, out] float32.
at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows,
              "matvec: x must be float32 [n <= 8, in] with contiguous columns");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1) &&
                  weight.size(1) % 8 == 0 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kHalf),
              "matvec: weight must be contiguous float32 or float16 [out, in], in a multiple "
              "of 8");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                    bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "matvec: bias must be float32 [out]");
    b = bias->data_ptr<float>();
  }
  const int64_t rows = x.size(0), width = x.size(1), out_features = weight.size(0);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (weight.scalar_type() == at::kFloat) {
    matvec_rows(x.data_ptr<float>(), x.stride(0), rows, weight.data_ptr<float>(), b,
                y.data_ptr<float>(), width, out_features);
  } else {
    matvec_rows(x.data_ptr<float>(), x.stride(0), rows,
                reinterpret_cast<const c10::Half*>(weight.data_ptr<at::Half>()), b,
                y.data_ptr<float>(), width, out_features);
  }
  return y;
}

}  // namespace pagedserve
