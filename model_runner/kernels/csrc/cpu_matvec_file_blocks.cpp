// y = x @ W.T + bias on a weight kept in a GGUF's blocks as the file stores them (Q4_0,
// Q5_0, Q5_1, Q8_0: blocks of 32 weights of a row; Q4_K, Q5_K, Q6_K: super-blocks of 256;
// block_formats.h), as torch ops (torch.ops.pagedserve.q4_k_matvec, q5_k_matvec,
// q6_k_matvec, q4_0_matvec, q5_0_matvec, q5_1_matvec, q8_0_file_matvec: up to eight rows;
// file_blocks_gemm: any rows), and the same blocks dequantized (dequantize_file_blocks_).
//
// Exact on the dequantized weights: each block's weights are made in float32 as gguf-py
// makes them, to the bit (block_formats.h), a run of 256 at a time on the stack, and dotted
// with every row of x (up to eight: a verification's token and drafts cost about one row's
// weight reads), two accumulators of eight lanes a row, in float32; only the order of the
// sums differs from x @ dequantize(W).T.
//
// Built per ISA as every kernel here (model_runner/kernels/cpu_kernels.py): AVX2 + FMA +
// F16C vectors of eight on AVX2 and AVX-512 hosts alike (the larger batches' tiles in
// AVX-512's sixteen lanes where the host has it), plain C++ vector code elsewhere.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "block_formats.h"
#include "cpu_ops.h"
#include "vec8.h"
#include "weight_stream.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pagedserve::load8;
using pagedserve::sum8;
using pagedserve::Vec8;
using pagedserve::blocks::Type;

constexpr int64_t kRun = 256;  // weights made at a time (a K-quant's super-block)
constexpr int64_t kMaxRows = 8;
constexpr int64_t kGrain = 16;  // output rows a thread takes at least


#if defined(__AVX2__) && defined(__GNUC__)
// AVX-512 code is compiled here only, in functions marked for it, and chosen at run time.
#define PAGEDSERVE_AVX512 1
inline bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

// Rows of x (R of them) dotted with one output row's blocks, each made once.
template <class F, int R>
inline void dot_rows(const uint8_t* row, int64_t blocks, const float* x, int64_t x_stride,
                     float* out) {
  constexpr int64_t kPerRun = kRun / F::kWeights;
  alignas(64) float w[kRun];
  Vec8 even[R] = {}, odd[R] = {};
  for (int64_t k = 0; k < blocks; k += kPerRun) {
    const int64_t n = std::min(kPerRun, blocks - k);
    for (int64_t j = 0; j < n; ++j) F::dequantize(row + (k + j) * F::kBytes, w + j * F::kWeights);
    const float* xk = x + k * F::kWeights;
    for (int64_t i = 0; i < n * F::kWeights; i += 16) {
      const Vec8 w0 = load8(w + i), w1 = load8(w + i + 8);
      for (int r = 0; r < R; ++r) {
        even[r] += w0 * load8(xk + r * x_stride + i);
        odd[r] += w1 * load8(xk + r * x_stride + i + 8);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum8(even[r] + odd[r]);
}

#if defined(PAGEDSERVE_AVX512)
// Q8_0 rows on an AVX-512 host (a tied LM head's: Gemma 3's 262k rows are most of a decode
// step): each block's 32 weights made as two vectors of sixteen (d * q, exact) and
// multiplied into the rows' sums as made, no stack buffer between; one instruction does
// the work of two, bound as this path is by its arithmetic, not by its 8.5 bits a weight.
template <int R>
__attribute__((target("avx512f"))) void q8_0_dot_rows512(
    const uint8_t* row, int64_t blocks, const float* x, int64_t x_stride, float* out) {
  using pagedserve::blocks::half_at;
  using pagedserve::blocks::Q8_0;
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < blocks; ++k) {
    const uint8_t* b = row + k * Q8_0::kBytes;
    const __m512 d = _mm512_set1_ps(half_at(b));
    const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))));
    const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))));
    const float* xk = x + k * Q8_0::kWeights;
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xk + r * x_stride), lo[r]);
      hi[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xk + r * x_stride + 16), hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
}
#endif

// One output row's dots with R rows of x, in the host's widest path for F.
template <class F, int R>
inline void row_dots(const uint8_t* row, int64_t blocks, const float* x, int64_t x_stride,
                     float* out) {
#if defined(PAGEDSERVE_AVX512)
  if constexpr (std::is_same_v<F, pagedserve::blocks::Q8_0>) {
    if (has_avx512()) return q8_0_dot_rows512<R>(row, blocks, x, x_stride, out);
  }
#endif
  dot_rows<F, R>(row, blocks, x, x_stride, out);
}

template <class F>
void matvec_rows(const uint8_t* blocks, int64_t row_bytes, const float* x, int64_t x_stride,
                 int64_t num_rows, const float* bias, float* y, int64_t out_features) {
  const int64_t per_row = row_bytes / F::kBytes;
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    float dots[kMaxRows];
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row = blocks + o * row_bytes;
      pagedserve::prefetch_ahead(row, row_bytes);
      switch (num_rows) {
        case 1: row_dots<F, 1>(row, per_row, x, x_stride, dots); break;
        case 2: row_dots<F, 2>(row, per_row, x, x_stride, dots); break;
        case 3: row_dots<F, 3>(row, per_row, x, x_stride, dots); break;
        case 4: row_dots<F, 4>(row, per_row, x, x_stride, dots); break;
        case 5: row_dots<F, 5>(row, per_row, x, x_stride, dots); break;
        case 6: row_dots<F, 6>(row, per_row, x, x_stride, dots); break;
        case 7: row_dots<F, 7>(row, per_row, x, x_stride, dots); break;
        default: row_dots<F, 8>(row, per_row, x, x_stride, dots); break;
      }
      const float b = bias == nullptr ? 0.f : bias[o];
      for (int64_t r = 0; r < num_rows; ++r) y[r * out_features + o] = dots[r] + b;
    }
  });
}

// Larger batches: a panel of output rows (as many as fit kPanelFloats) dequantized whole
// into a thread's buffer, each weight made once for every row of x; then, for each tile
// of kTile rows of x (read once a panel, from L1), the panel's rows kGroup at a time:
// kGroup * kTile accumulators (twelve of AVX2's sixteen registers), each x vector and
// each weight vector loaded once for them.
constexpr int kGroup = 3;
constexpr int kTile = 3;
constexpr int64_t kPanelFloats = 1 << 17;  // 512 KiB: an L2's share

template <int P, int X>
inline void group_tile(const float* w, int64_t width, const float* x, int64_t x_stride,
                       float* out, int64_t out_stride) {
  Vec8 acc[X][P] = {};
  for (int64_t i = 0; i < width; i += 8) {
    Vec8 wv[P];
    for (int p = 0; p < P; ++p) wv[p] = load8(w + p * width + i);
    for (int r = 0; r < X; ++r) {
      const Vec8 xv = load8(x + r * x_stride + i);
      for (int p = 0; p < P; ++p) acc[r][p] += wv[p] * xv;
    }
  }
  for (int r = 0; r < X; ++r) {
    for (int p = 0; p < P; ++p) out[r * out_stride + p] = sum8(acc[r][p]);
  }
}

// x's rows [0, X) against a panel's `rows` weight rows, kGroup at a time.
template <int X>
void tile_panel(const float* w, int64_t rows, int64_t width, const float* x,
                int64_t x_stride, float* out, int64_t out_stride) {
  int64_t p = 0;
  for (; p + kGroup <= rows; p += kGroup) {
    group_tile<kGroup, X>(w + p * width, width, x, x_stride, out + p, out_stride);
  }
  if (rows - p == 2) group_tile<2, X>(w + p * width, width, x, x_stride, out + p, out_stride);
  if (rows - p == 1) group_tile<1, X>(w + p * width, width, x, x_stride, out + p, out_stride);
}

#if defined(PAGEDSERVE_AVX512)
// The same tiles in AVX-512's sixteen lanes and 32 registers (4 x 4 accumulators), on a
// host that has it.
constexpr int kTile512 = 4;

template <int P, int X>
__attribute__((target("avx512f"))) inline void group_tile512(
    const float* w, int64_t width, const float* x, int64_t x_stride, float* out,
    int64_t out_stride) {
  __m512 acc[X][P];
  for (int r = 0; r < X; ++r) {
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < width; i += 16) {
    __m512 wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_ps(w + p * width + i);
    for (int r = 0; r < X; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * x_stride + i);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(wv[p], xv, acc[r][p]);
    }
  }
  for (int r = 0; r < X; ++r) {
    for (int p = 0; p < P; ++p) out[r * out_stride + p] = _mm512_reduce_add_ps(acc[r][p]);
  }
}

template <int X>
__attribute__((target("avx512f"))) void tile_panel512(
    const float* w, int64_t rows, int64_t width, const float* x, int64_t x_stride, float* out,
    int64_t out_stride) {
  int64_t p = 0;
  for (; p + 4 <= rows; p += 4) {
    group_tile512<4, X>(w + p * width, width, x, x_stride, out + p, out_stride);
  }
  for (; p < rows; ++p) group_tile512<1, X>(w + p * width, width, x, x_stride, out + p, out_stride);
}

#endif

// Rows [r, r + kTile or kTile512) of x against a dequantized panel, in the host's widest
// vectors; returns the rows done.
inline int64_t panel_rows(const float* w, int64_t rows, int64_t width, const float* x,
                          int64_t x_stride, int64_t num_rows, float* y, int64_t out_stride) {
#if defined(PAGEDSERVE_AVX512)
  if (has_avx512()) {
    switch (std::min<int64_t>(kTile512, num_rows)) {
      case 1: tile_panel512<1>(w, rows, width, x, x_stride, y, out_stride); return 1;
      case 2: tile_panel512<2>(w, rows, width, x, x_stride, y, out_stride); return 2;
      case 3: tile_panel512<3>(w, rows, width, x, x_stride, y, out_stride); return 3;
      default: tile_panel512<4>(w, rows, width, x, x_stride, y, out_stride); return 4;
    }
  }
#endif
  switch (std::min<int64_t>(kTile, num_rows)) {
    case 1: tile_panel<1>(w, rows, width, x, x_stride, y, out_stride); return 1;
    case 2: tile_panel<2>(w, rows, width, x, x_stride, y, out_stride); return 2;
    default: tile_panel<3>(w, rows, width, x, x_stride, y, out_stride); return 3;
  }
}

template <class F>
void gemm_rows(const uint8_t* blocks, int64_t row_bytes, const float* x, int64_t x_stride,
               int64_t num_rows, int64_t width, const float* bias, float* y,
               int64_t out_features) {
  const int64_t panel = std::max<int64_t>(kGroup, kPanelFloats / width / kGroup * kGroup);
  const int64_t panels = (out_features + panel - 1) / panel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(panel * width);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t o = n * panel, rows = std::min(panel, out_features - o);
      for (int64_t p = 0; p < rows; ++p) {
        for (int64_t k = 0; k < width / F::kWeights; ++k) {
          F::dequantize(blocks + (o + p) * row_bytes + k * F::kBytes,
                        w.data() + p * width + k * F::kWeights);
        }
      }
      for (int64_t r = 0; r < num_rows;) {
        float* yr = y + r * out_features + o;
        const int64_t done = panel_rows(w.data(), rows, width, x + r * x_stride, x_stride,
                                        num_rows - r, yr, out_features);
        for (int64_t i = 0; bias != nullptr && i < done; ++i) {
          for (int64_t p = 0; p < rows; ++p) yr[i * out_features + p] += bias[o + p];
        }
        r += done;
      }
    }
  });
}

// blocks: contiguous uint8 [out, in / weights * bytes]; `op` names the op in the error.
template <class F>
void check_blocks(const at::Tensor& blocks, int64_t in_features, const char* op) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte &&
                  blocks.stride(1) == 1 && blocks.stride(0) == blocks.size(1) &&
                  in_features % F::kWeights == 0 &&
                  blocks.size(1) == in_features / F::kWeights * F::kBytes,
              op, ": blocks must be contiguous uint8 [out, in / ", F::kWeights, " * ",
              F::kBytes, "] (in a multiple of ", F::kWeights, ")");
}

// y = x @ W.T + bias: the matvec's rows (`gemm` false) or the panels' (any rows).
at::Tensor product(const at::Tensor& x, const at::Tensor& blocks,
                   const std::optional<at::Tensor>& bias, Type type, const char* op, bool gemm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              op, ": x must be float32 [n, in] with contiguous columns");
  const int64_t out_features = blocks.dim() == 2 ? blocks.size(0) : 0;
  TORCH_CHECK(!bias.has_value() ||
                  (bias->dim() == 1 && bias->size(0) == out_features &&
                   bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              op, ": bias must be float32 [out]");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  pagedserve::blocks::with_format(type, [&](auto format) {
    using F = decltype(format);
    check_blocks<F>(blocks, x.size(1), op);
    if (gemm) {
      gemm_rows<F>(blocks.data_ptr<uint8_t>(), blocks.size(1), x.data_ptr<float>(),
                   x.stride(0), x.size(0), x.size(1), b, y.data_ptr<float>(), out_features);
    } else {
      matvec_rows<F>(blocks.data_ptr<uint8_t>(), blocks.size(1), x.data_ptr<float>(),
                     x.stride(0), x.size(0), b, y.data_ptr<float>(), out_features);
    }
  });
  return y;
}

at::Tensor small_batch(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias, Type type, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows,
              op, ": x must be float32 [n <= 8, in] with contiguous columns");
  return product(x, blocks, bias, type, op, false);
}

template <class F>
void dequantize_rows(const uint8_t* blocks, int64_t row_bytes, float* out, int64_t rows,
                     int64_t in_features) {
  const int64_t per_row = in_features / F::kWeights;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t k = 0; k < per_row; ++k) {
        F::dequantize(blocks + o * row_bytes + k * F::kBytes,
                      out + o * in_features + k * F::kWeights);
      }
    }
  });
}

Type type_of(int64_t kind, const char* op) {
  TORCH_CHECK(kind >= 0 && kind < pagedserve::blocks::kNumTypes, op,
              ": kind 0..6 (Q4_K, Q5_K, Q6_K, Q4_0, Q5_0, Q5_1, Q8_0)");
  return static_cast<Type>(kind);
}

}  // namespace

namespace pagedserve {

// x [n <= 8, in] float32, blocks [out, in / 256 * 144] uint8 (Q4_K as the file has them):
// [n, out] float32. The other types' ops alike, on their own blocks.
at::Tensor q4_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return small_batch(x, blocks, bias, Type::q4_k, "q4_k_matvec");
}

at::Tensor q5_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return small_batch(x, blocks, bias, Type::q5_k, "q5_k_matvec");
}

at::Tensor q6_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return small_batch(x, blocks, bias, Type::q6_k, "q6_k_matvec");
}

at::Tensor q4_0_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return small_batch(x, blocks, bias, Type::q4_0, "q4_0_matvec");
}

at::Tensor q5_0_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return small_batch(x, blocks, bias, Type::q5_0, "q5_0_matvec");
}

at::Tensor q5_1_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return small_batch(x, blocks, bias, Type::q5_1, "q5_1_matvec");
}

at::Tensor q8_0_file_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  return small_batch(x, blocks, bias, Type::q8_0, "q8_0_file_matvec");
}

// x [n, in] float32 (any n: a prefill chunk or a larger decode batch), blocks of `kind`
// (block_formats.h's Type) as the small-batch ops': [n, out] float32, from the panels.
at::Tensor file_blocks_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            const std::optional<at::Tensor>& bias) {
  return product(x, blocks, bias, type_of(kind, "file_blocks_gemm"), "file_blocks_gemm", true);
}

// out [rows, in] float32, contiguous: blocks [rows, ...] of `kind` dequantized, gguf-py's
// values to the bit (rows: a whole weight, or the rows an embedding lookup gathers).
void dequantize_file_blocks_(at::Tensor& out, const at::Tensor& blocks, int64_t kind) {
  const Type type = type_of(kind, "dequantize_file_blocks_");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  blocks.dim() == 2 && out.size(0) == blocks.size(0),
              "dequantize_file_blocks_: out must be contiguous float32 [out, in]");
  pagedserve::blocks::with_format(type, [&](auto format) {
    using F = decltype(format);
    check_blocks<F>(blocks, out.size(1), "dequantize_file_blocks_");
    dequantize_rows<F>(blocks.data_ptr<uint8_t>(), blocks.size(1), out.data_ptr<float>(),
                       out.size(0), out.size(1));
  });
}

}  // namespace pagedserve
