// `--weight-dtype int8` on a weight with exact GGUF blocks (model_runner/kernels/
// block_quant.py): the blocks' integers times activations quantized to int8, as torch ops
// (torch.ops.pagedserve.q4_1_int8_matvec, q8_0_int8_matvec), for up to eight rows.
//
// Each row of x is quantized per block of 32 values on its own grid: d_x = max|x| / 127,
// q_x = x / d_x rounded to nearest (even), s_x = d_x * sum(q_x) (llama.cpp's Q8_1, which
// is also what vLLM's GGUF kernels do at small batches). A block's dot product is then
//   Q4_1 (w = d q + m, q 0..15):   d d_x sum(q q_x) + m s_x
//   Q8_0 (w = d q, q -127..127):   d d_x sum(q q_x)
// with the integer sums exact: AVX2's unsigned-by-signed byte products (maddubs) sum
// pairs of at most 2 * 15 * 127 (Q4_1) or 2 * 127 * 127 (Q8_0, its signs moved onto x)
// into int16 without saturating. The weights stay exact (4.5 or 8.5 bits each, read
// once); only the activations are rounded, finer than the per-call grid of the int8 GEMM.
// A row's result depends on no other row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGrain = 64;  // output rows a thread takes at least

// x's rows quantized per block: q [rows, in], d and s [rows, in / 32].
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t width, blocks;
};

// One block of 32 values quantized: q, and d_x and d_x * sum(q) returned.
inline void quantize_block(const float* v, int8_t* q, float* d_out, float* s_out) {
#if defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 values[4];
  __m256 peak = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    values[i] = _mm256_loadu_ps(v + 8 * i);
    peak = _mm256_max_ps(peak, _mm256_and_ps(values[i], magnitude));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  const float d = amax / 127.f;
  const __m256 inverse = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i ints[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    // x / d_x rounded to nearest even (the scalar path's nearbyint), then clamped
    const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(values[i], inverse),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    ints[i] = _mm256_max_epi32(_mm256_set1_epi32(-127),
                               _mm256_min_epi32(_mm256_cvtps_epi32(rounded),
                                                _mm256_set1_epi32(127)));
    sum = _mm256_add_epi32(sum, ints[i]);
  }
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute restores them
  const __m256i words = _mm256_packs_epi32(ints[0], ints[1]);
  const __m256i words2 = _mm256_packs_epi32(ints[2], ints[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  total = _mm_add_epi32(total, _mm_unpackhi_epi64(total, total));
  total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 1));
  *d_out = d;
  *s_out = d * static_cast<float>(_mm_cvtsi128_si32(total));
#else
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::abs(v[j]));
  const float d = amax / 127.f;
  const float inverse = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const int32_t value =
        std::clamp(static_cast<int32_t>(std::nearbyint(v[j] * inverse)), -127, 127);
    q[j] = static_cast<int8_t>(value);
    sum += value;
  }
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
#endif
}

QuantizedRows quantize_rows(const float* x, int64_t stride, int64_t rows, int64_t width) {
  const int64_t blocks = width / kBlock;
  QuantizedRows out{std::vector<int8_t>(rows * width), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks), width, blocks};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < blocks; ++k) {
      quantize_block(x + r * stride + k * kBlock, out.q.data() + r * width + k * kBlock,
                     &out.d[r * blocks + k], &out.s[r * blocks + k]);
    }
  }
  return out;
}

// The integer dot product of one block of weights (32 unsigned, or signed) with 32 int8
// activations, as eight int32 partial sums (AVX2) or one (elsewhere).
#if defined(__AVX2__)
inline __m256i products(__m256i unsigned_w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_w, xv), _mm256_set1_epi16(1));
}

inline __m256i signed_products(__m256i w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(
      _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)),
      _mm256_set1_epi16(1));
}

inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

struct Q41 {
  const uint8_t* qs;  // [out, in / 2]: byte j of a block, weight j (low nibble) and j + 16
  const float* d;     // [out, in / 32]
  const float* m;
  int64_t blocks;

  template <int R>
  void dot(int64_t o, const QuantizedRows& x, float* out) const {
    float mins[R] = {};
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(15);
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t at = o * blocks + k;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + at * 16));
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                                         _mm_and_si128(bytes, mask));
      for (int r = 0; r < R; ++r) {
        const int64_t xb = r * blocks + k;
        const __m256i sums = products(w, x.q.data() + r * x.width + k * kBlock);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d[at] * x.d[xb]),
                                 acc[r]);
        mins[r] += m[at] * x.s[xb];
      }
    }
    for (int r = 0; r < R; ++r) out[r] = sum8(acc[r]) + mins[r];
#else
    float acc[R] = {};
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t at = o * blocks + k;
      for (int r = 0; r < R; ++r) {
        const int64_t xb = r * blocks + k;
        const int8_t* xq = x.q.data() + r * x.width + k * kBlock;
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) {
          sum += (qs[at * 16 + j] & 15) * xq[j] + (qs[at * 16 + j] >> 4) * xq[j + 16];
        }
        acc[r] += static_cast<float>(sum) * (d[at] * x.d[xb]);
        mins[r] += m[at] * x.s[xb];
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r] + mins[r];
#endif
  }
};

// Two output rows (o, o + 1) against one row of x: the x side's loads are shared.
inline void q4_1_dot_pair(const Q41& w, int64_t o, const QuantizedRows& x, float* out) {
#if defined(__AVX2__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float mins0 = 0.f, mins1 = 0.f;
  const __m128i mask = _mm_set1_epi8(15);
  const int64_t blocks = w.blocks;
  const uint8_t* q0 = w.qs + o * blocks * 16;
  const uint8_t* q1 = q0 + blocks * 16;
  const float *d0 = w.d + o * blocks, *d1 = d0 + blocks;
  const float *m0 = w.m + o * blocks, *m1 = m0 + blocks;
  const auto unpack = [&](const uint8_t* q) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                            _mm_and_si128(bytes, mask));
  };
  for (int64_t k = 0; k < blocks; ++k) {
    const __m256i xv =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + k * kBlock));
    const float dx = x.d[k], sx = x.s[k];
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(unpack(q0 + k * 16), xv), ones);
    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(unpack(q1 + k * 16), xv), ones);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0[k] * dx), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1[k] * dx), acc1);
    mins0 += m0[k] * sx;
    mins1 += m1[k] * sx;
  }
  out[0] = sum8(acc0) + mins0;
  out[1] = sum8(acc1) + mins1;
#else
  w.dot<1>(o, x, out);
  w.dot<1>(o + 1, x, out + 1);
#endif
}

struct Q80 {
  const int8_t* qs;  // [out, in]
  const float* d;    // [out, in / 32]
  int64_t blocks;

  template <int R>
  void dot(int64_t o, const QuantizedRows& x, float* out) const {
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t at = o * blocks + k;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + at * kBlock));
      for (int r = 0; r < R; ++r) {
        const __m256i sums = signed_products(w, x.q.data() + r * x.width + k * kBlock);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                 _mm256_set1_ps(d[at] * x.d[r * blocks + k]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = sum8(acc[r]);
#else
    float acc[R] = {};
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t at = o * blocks + k;
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q.data() + r * x.width + k * kBlock;
        int32_t sum = 0;
        for (int j = 0; j < kBlock; ++j) sum += qs[at * kBlock + j] * xq[j];
        acc[r] += static_cast<float>(sum) * (d[at] * x.d[r * blocks + k]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
#endif
  }
};

template <int R, typename Q>
void rows_of(const Q& q, const QuantizedRows& x, const float* bias, float* y,
             int64_t out_features) {
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    float dots[2 * R];
    int64_t o = begin;
    // a batch of one: Q4_1's output rows in pairs (Q8_0's measured slower so)
    if constexpr (R == 1 && std::is_same_v<Q, Q41>) {
      for (; o + 2 <= end; o += 2) {
        q4_1_dot_pair(q, o, x, dots);
        for (int j = 0; j < 2; ++j) y[o + j] = dots[j] + (bias == nullptr ? 0.f : bias[o + j]);
      }
    }
    for (; o < end; ++o) {
      q.template dot<R>(o, x, dots);
      const float b = bias == nullptr ? 0.f : bias[o];
      for (int r = 0; r < R; ++r) y[r * out_features + o] = dots[r] + b;
    }
  });
}

template <typename Q>
at::Tensor int8_products(const Q& q, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), x.stride(0), rows, x.size(1));
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  switch (rows) {
    case 1: rows_of<1>(q, xq, b, out, out_features); break;
    case 2: rows_of<2>(q, xq, b, out, out_features); break;
    case 3: rows_of<3>(q, xq, b, out, out_features); break;
    case 4: rows_of<4>(q, xq, b, out, out_features); break;
    case 5: rows_of<5>(q, xq, b, out, out_features); break;
    case 6: rows_of<6>(q, xq, b, out, out_features); break;
    case 7: rows_of<7>(q, xq, b, out, out_features); break;
    default: rows_of<8>(q, xq, b, out, out_features); break;
  }
  return y;
}

}  // namespace

namespace pagedserve {

// x [n, in] float32, qs [out, in / 2] uint8, d and m [out, in / 32] float32: [n, out].
at::Tensor q4_1_int8_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                            const at::Tensor& m, const std::optional<at::Tensor>& bias) {
  check_q4_1_args(x, qs, d, m, bias, "q4_1_int8_matvec");
  const Q41 q{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), d.size(1)};
  return int8_products(q, x, bias, qs.size(0));
}

// x [n, in] float32, qs [out, in] int8 (-127..127), d [out, in / 32] float32: [n, out].
at::Tensor q8_0_int8_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                            const std::optional<at::Tensor>& bias) {
  check_q8_0_args(x, qs, d, bias, "q8_0_int8_matvec");
  const Q80 q{qs.data_ptr<int8_t>(), d.data_ptr<float>(), d.size(1)};
  return int8_products(q, x, bias, qs.size(0));
}

}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("q4_1_int8_matvec(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor",
        &pagedserve::q4_1_int8_matvec);
  m.def("q8_0_int8_matvec(Tensor x, Tensor qs, Tensor d, Tensor? bias) -> Tensor",
        &pagedserve::q8_0_int8_matvec);
}
