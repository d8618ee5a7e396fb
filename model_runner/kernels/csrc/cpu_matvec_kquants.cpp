// y = x @ W.T + bias on a weight kept in a GGUF's K-quant blocks as the file stores them
// (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights of a row, 144, 176 or 210 bytes), as
// torch ops (torch.ops.pagedserve.q4_k_matvec, q5_k_matvec, q6_k_matvec), and the same
// blocks dequantized into a float32 buffer (dequantize_k_: the larger batches' scratch).
//
// Exact on the dequantized weights: a super-block's weights are made in float32 as gguf-py
// (gguf.quants.dequantize) makes them, to the bit:
//   Q4_K, Q5_K: w = (d * sc) * q - (dmin * m), sc and m 6-bit, q 0..15 or 0..31
//   Q6_K:       w = (d * sc) * q, sc int8, q -32..31
// (d * sc and (d * sc) * q are exact in float32 - at most 11 + 7 + 5 bits - so a fused
// multiply-add rounds as the separate ones). Each super-block is made once into 256 floats
// on the stack and dotted with every row of x (up to eight: a verification's token and
// drafts cost about one row's weight reads), two accumulators of eight lanes a row, in
// float32; only the order of the sums differs from x @ dequantize(W).T.
//
// Built per ISA as every kernel here (model_runner/kernels/cpu_kernels.py): AVX2 + FMA +
// F16C vectors of eight on AVX2 and AVX-512 hosts alike, plain C++ vector code elsewhere.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include "cpu_ops.h"
#include "vec8.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#include <algorithm>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pagedserve::load8;
using pagedserve::sum8;
using pagedserve::Vec8;

constexpr int64_t kSuper = 256;  // weights a super-block
constexpr int64_t kMaxRows = 8;
constexpr int64_t kGrain = 16;  // output rows a thread takes at least

enum class KQuant : int64_t { q4_k = 0, q5_k = 1, q6_k = 2 };
constexpr int64_t kBytes[] = {144, 176, 210};  // a super-block's bytes, by KQuant

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block's twelve scale bytes.
inline void scale_min(int j, const uint8_t* s, float& sc, float& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

typedef int32_t Int32x8 __attribute__((vector_size(32)));
typedef uint8_t U8x8 __attribute__((vector_size(8)));

// Eight bytes from p, widened to int32 lanes (one vpmovzxbd under AVX2).
inline Int32x8 bytes8(const uint8_t* p) {
#if defined(__AVX2__)
  return reinterpret_cast<Int32x8>(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  U8x8 v;
  std::memcpy(&v, p, 8);
  return __builtin_convertvector(v, Int32x8);
#endif
}

inline Vec8 to_float(Int32x8 q) { return __builtin_convertvector(q, Vec8); }

inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// Q4_K: d, dmin (float16), 12 scale bytes, 128 bytes of nibbles; Q5_K the same with 32
// bytes of fifth bits (qh) before the nibbles. Four chunks of 64 weights: the low nibbles
// of 32 bytes, then their high nibbles, each sub-block of 32 with its own scale and min.
template <bool kFifthBit>
inline void q45_k_block(const uint8_t* b, float* w) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (kFifthBit ? 48 : 16);
  for (int j = 0; j < 4; ++j, qs += 32, w += 64) {
    float sc0, m0, sc1, m1;
    scale_min(2 * j, scales, sc0, m0);
    scale_min(2 * j + 1, scales, sc1, m1);
    const Vec8 d0 = Vec8{} + d * sc0, n0 = Vec8{} + dmin * m0;
    const Vec8 d1 = Vec8{} + d * sc1, n1 = Vec8{} + dmin * m1;
    for (int l = 0; l < 32; l += 8) {
      const Int32x8 q = bytes8(qs + l);
      Int32x8 lo = q & 0xF, hi = q >> 4;
      if constexpr (kFifthBit) {
        const Int32x8 h = bytes8(qh + l);
        lo |= ((h >> (2 * j)) & 1) << 4;
        hi |= ((h >> (2 * j + 1)) & 1) << 4;
      }
      store8(w + l, d0 * to_float(lo) - n0);
      store8(w + 32 + l, d1 * to_float(hi) - n1);
    }
  }
}

// Q6_K: 128 bytes of low nibbles (ql), 64 of high bit pairs (qh), 16 int8 scales (one per
// 16 weights), d (float16). Two halves of 128 weights, each four runs of 32.
inline void q6_k_block(const uint8_t* b, float* w) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, w += 128) {
    for (int l = 0; l < 32; l += 8) {
      const int is = l / 16;
      const Int32x8 a = bytes8(ql + l), c = bytes8(ql + 32 + l), h = bytes8(qh + l);
      const Int32x8 q0 = ((a & 0xF) | ((h & 3) << 4)) - 32;
      const Int32x8 q1 = ((c & 0xF) | (((h >> 2) & 3) << 4)) - 32;
      const Int32x8 q2 = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32;
      const Int32x8 q3 = ((c >> 4) | (((h >> 6) & 3) << 4)) - 32;
      store8(w + l, (Vec8{} + d * static_cast<float>(sc[is])) * to_float(q0));
      store8(w + l + 32, (Vec8{} + d * static_cast<float>(sc[is + 2])) * to_float(q1));
      store8(w + l + 64, (Vec8{} + d * static_cast<float>(sc[is + 4])) * to_float(q2));
      store8(w + l + 96, (Vec8{} + d * static_cast<float>(sc[is + 6])) * to_float(q3));
    }
  }
}

template <KQuant K>
inline void dequantize_block(const uint8_t* b, float* w) {
  if constexpr (K == KQuant::q6_k) {
    q6_k_block(b, w);
  } else {
    q45_k_block<K == KQuant::q5_k>(b, w);
  }
}

// Rows of x (R of them) dotted with one output row's super-blocks, each made once.
template <KQuant K, int R>
inline void dot_rows(const uint8_t* row, int64_t blocks, const float* x, int64_t x_stride,
                     float* out) {
  alignas(64) float w[kSuper];
  Vec8 even[R] = {}, odd[R] = {};
  for (int64_t k = 0; k < blocks; ++k) {
    dequantize_block<K>(row + k * kBytes[static_cast<int>(K)], w);
    const float* xk = x + k * kSuper;
    for (int i = 0; i < kSuper; i += 16) {
      const Vec8 w0 = load8(w + i), w1 = load8(w + i + 8);
      for (int r = 0; r < R; ++r) {
        even[r] += w0 * load8(xk + r * x_stride + i);
        odd[r] += w1 * load8(xk + r * x_stride + i + 8);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum8(even[r] + odd[r]);
}

template <KQuant K>
void matvec_rows(const uint8_t* blocks, int64_t row_bytes, const float* x, int64_t x_stride,
                 int64_t num_rows, const float* bias, float* y, int64_t out_features) {
  const int64_t per_row = row_bytes / kBytes[static_cast<int>(K)];
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    float dots[kMaxRows];
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row = blocks + o * row_bytes;
      switch (num_rows) {
        case 1: dot_rows<K, 1>(row, per_row, x, x_stride, dots); break;
        case 2: dot_rows<K, 2>(row, per_row, x, x_stride, dots); break;
        case 3: dot_rows<K, 3>(row, per_row, x, x_stride, dots); break;
        case 4: dot_rows<K, 4>(row, per_row, x, x_stride, dots); break;
        case 5: dot_rows<K, 5>(row, per_row, x, x_stride, dots); break;
        case 6: dot_rows<K, 6>(row, per_row, x, x_stride, dots); break;
        case 7: dot_rows<K, 7>(row, per_row, x, x_stride, dots); break;
        default: dot_rows<K, 8>(row, per_row, x, x_stride, dots); break;
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

#if defined(__AVX2__) && defined(__GNUC__)
// The same tiles in AVX-512's sixteen lanes and 32 registers (4 x 4 accumulators), on a
// host that has it: compiled for AVX-512 here only, chosen at run time.
#define PAGEDSERVE_AVX512_PANELS 1
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

inline bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

// Rows [r, r + kTile or kTile512) of x against a dequantized panel, in the host's widest
// vectors; returns the rows done.
inline int64_t panel_rows(const float* w, int64_t rows, int64_t width, const float* x,
                          int64_t x_stride, int64_t num_rows, float* y, int64_t out_stride) {
#if defined(PAGEDSERVE_AVX512_PANELS)
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

template <KQuant K>
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
        for (int64_t k = 0; k < width / kSuper; ++k) {
          dequantize_block<K>(blocks + (o + p) * row_bytes + k * kBytes[static_cast<int>(K)],
                              w.data() + p * width + k * kSuper);
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

// blocks: contiguous uint8 [out, in / 256 * bytes]; `op` names the op in the error.
void check_blocks(const at::Tensor& blocks, KQuant kind, int64_t in_features, const char* op) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte &&
                  blocks.stride(1) == 1 && blocks.stride(0) == blocks.size(1) &&
                  in_features % kSuper == 0 &&
                  blocks.size(1) == in_features / kSuper * kBytes[static_cast<int>(kind)],
              op, ": blocks must be contiguous uint8 [out, in / 256 * ",
              kBytes[static_cast<int>(kind)], "] (in a multiple of 256)");
}

// y = x @ W.T + bias: the matvec's rows (`gemm` false) or the panels' (any rows).
at::Tensor kquant_product(const at::Tensor& x, const at::Tensor& blocks,
                          const std::optional<at::Tensor>& bias, KQuant kind, const char* op,
                          bool gemm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              op, ": x must be float32 [n, in] with contiguous columns");
  check_blocks(blocks, kind, x.size(1), op);
  const int64_t out_features = blocks.size(0);
  TORCH_CHECK(!bias.has_value() ||
                  (bias->dim() == 1 && bias->size(0) == out_features &&
                   bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              op, ": bias must be float32 [out]");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const auto run = [&](auto k) {
    constexpr KQuant K = decltype(k)::value;
    if (gemm) {
      gemm_rows<K>(blocks.data_ptr<uint8_t>(), blocks.size(1), x.data_ptr<float>(),
                   x.stride(0), x.size(0), x.size(1), b, y.data_ptr<float>(), out_features);
    } else {
      matvec_rows<K>(blocks.data_ptr<uint8_t>(), blocks.size(1), x.data_ptr<float>(),
                     x.stride(0), x.size(0), b, y.data_ptr<float>(), out_features);
    }
  };
  switch (kind) {
    case KQuant::q4_k: run(std::integral_constant<KQuant, KQuant::q4_k>{}); break;
    case KQuant::q5_k: run(std::integral_constant<KQuant, KQuant::q5_k>{}); break;
    default: run(std::integral_constant<KQuant, KQuant::q6_k>{}); break;
  }
  return y;
}

at::Tensor kquant_matvec(const at::Tensor& x, const at::Tensor& blocks,
                         const std::optional<at::Tensor>& bias, KQuant kind, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows,
              op, ": x must be float32 [n <= 8, in] with contiguous columns");
  return kquant_product(x, blocks, bias, kind, op, false);
}

template <KQuant K>
void dequantize_rows(const uint8_t* blocks, int64_t row_bytes, float* out, int64_t rows,
                     int64_t in_features) {
  const int64_t per_row = in_features / kSuper;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t k = 0; k < per_row; ++k) {
        dequantize_block<K>(blocks + o * row_bytes + k * kBytes[static_cast<int>(K)],
                            out + o * in_features + k * kSuper);
      }
    }
  });
}

}  // namespace

namespace pagedserve {

// x [n <= 8, in] float32, blocks [out, in / 256 * 144] uint8 (Q4_K as the file has them):
// [n, out] float32.
at::Tensor q4_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return kquant_matvec(x, blocks, bias, KQuant::q4_k, "q4_k_matvec");
}

// As q4_k_matvec, blocks [out, in / 256 * 176] (Q5_K).
at::Tensor q5_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return kquant_matvec(x, blocks, bias, KQuant::q5_k, "q5_k_matvec");
}

// As q4_k_matvec, blocks [out, in / 256 * 210] (Q6_K).
at::Tensor q6_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias) {
  return kquant_matvec(x, blocks, bias, KQuant::q6_k, "q6_k_matvec");
}

// x [n, in] float32 (any n: a prefill chunk or a larger decode batch), blocks of `kind` (0
// Q4_K, 1 Q5_K, 2 Q6_K) as q4_k_matvec's: [n, out] float32, from the panels.
at::Tensor k_quant_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "k_quant_gemm: kind 0 (Q4_K), 1 (Q5_K) or 2 (Q6_K)");
  return kquant_product(x, blocks, bias, static_cast<KQuant>(kind), "k_quant_gemm", true);
}

// out [out, in] float32, contiguous: the K-quant blocks (kind 0 Q4_K, 1 Q5_K, 2 Q6_K)
// dequantized, gguf-py's values to the bit.
void dequantize_k_(at::Tensor& out, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "dequantize_k_: kind 0 (Q4_K), 1 (Q5_K) or 2 (Q6_K)");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == blocks.size(0),
              "dequantize_k_: out must be contiguous float32 [out, in]");
  const auto k = static_cast<KQuant>(kind);
  check_blocks(blocks, k, out.size(1), "dequantize_k_");
  const auto run = [&](auto kq) {
    dequantize_rows<decltype(kq)::value>(blocks.data_ptr<uint8_t>(), blocks.size(1),
                                         out.data_ptr<float>(), out.size(0), out.size(1));
  };
  switch (k) {
    case KQuant::q4_k: run(std::integral_constant<KQuant, KQuant::q4_k>{}); break;
    case KQuant::q5_k: run(std::integral_constant<KQuant, KQuant::q5_k>{}); break;
    default: run(std::integral_constant<KQuant, KQuant::q6_k>{}); break;
  }
}

}  // namespace pagedserve
