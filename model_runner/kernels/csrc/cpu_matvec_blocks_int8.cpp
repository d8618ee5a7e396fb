// `--weight-dtype int8` on a weight with exact GGUF blocks (model_runner/kernels/
// block_quant.py): the blocks' integers times activations quantized to int8, as torch ops
// (torch.ops.pagedserve.q4_1_int8_matvec, q8_0_int8_matvec), for up to eight rows; and
// `--weight-dtype float16`'s Q4_1 (q4_1_planes_matvec): the same integers times float32
// activations split per block into three int8 planes, float32's precision (split_rows).
//
// Each row of x is quantized per block of 32 values on its own grid: d_x = max|x| / 127,
// q_x = x / d_x rounded to nearest (even), s_x = d_x * sum(q_x) (llama.cpp's Q8_1, which
// is also what vLLM's GGUF kernels do at small batches). A block's dot product is then
//   Q4_1 (w = d q + m, q 0..15):   d d_x sum(q q_x) + m s_x
//   Q8_0 (w = d q, q -127..127):   d d_x sum(q q_x)
// with sum(q q_x) an exact integer, and each output row sums its blocks' terms in block
// order (the d d_x terms and the m s_x terms apart, added at the end), whatever the
// batch: a row's result depends on no other row.
//
// The weights come in groups of eight output rows (block_quant.py's Q41Groups,
// Q80Int8Groups), a group's blocks at one input position side by side, and d and m as
// float16 (a GGUF's own bytes: 20 or 34 a block), so that one pass over the group reads
// its weights in order and its eight rows' integer sums end in one vector: one conversion
// to float, one multiply-add for the eight. AVX2's unsigned-by-signed byte products (maddubs) sum pairs
// of at most 2 * 15 * 127 (Q4_1) or 2 * 127 * 127 (Q8_0, its signs moved onto x) into
// int16 without saturating; a Q4_1 group's sums stay within int16 through two pairwise
// additions more (at most 8 * 3810), then int32.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_ops.h"
#include "vec8.h"
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

using pagedserve::load8;  // eight float16 scales as float32

constexpr int64_t kBlock = 32;
constexpr int64_t kGrain = 8;  // groups of eight output rows a thread takes at least
constexpr int64_t kMaxRows = 8;

// x's rows as int8 planes per block: q [planes, rows, in], d and s [rows, in / 32]. One
// plane (int8 activations): x ~ d * q, s = d * sum(q). Three (float activations, Q4_1
// only): x ~ (d * 254) * (q0 + q1 / 254 + q2 / 254^2), within 2^-24 of the block's largest
// |x|, and s = sum(x).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t rows, width, blocks;

  const int8_t* plane(int p, int64_t row, int64_t k) const {
    return q.data() + (p * rows + row) * width + k * kBlock;
  }
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
                    std::vector<float>(rows * blocks), rows, width, blocks};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < blocks; ++k) {
      quantize_block(x + r * stride + k * kBlock, out.q.data() + r * width + k * kBlock,
                     &out.d[r * blocks + k], &out.s[r * blocks + k]);
    }
  }
  return out;
}

constexpr float kPlaneStep = 254.f;  // each plane 1/254 of the one before

// x's rows split into three int8 planes per block (see QuantizedRows), in double: each
// plane rounds what the ones before left, at most half a step, so 127 * 254^2 steps cover
// the block's largest |x| to 2^-24 of it.
QuantizedRows split_rows(const float* x, int64_t stride, int64_t rows, int64_t width) {
  const int64_t blocks = width / kBlock;
  QuantizedRows out{std::vector<int8_t>(3 * rows * width), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks), rows, width, blocks};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < blocks; ++k) {
      const float* v = x + r * stride + k * kBlock;
      double amax = 0.0, sum = 0.0;
      for (int64_t j = 0; j < kBlock; ++j) {
        amax = std::max(amax, std::abs(static_cast<double>(v[j])));
        sum += v[j];
      }
      const double step = amax / 127.0, inverse = step > 0.0 ? 1.0 / step : 0.0;
      for (int64_t j = 0; j < kBlock; ++j) {
        double left = v[j] * inverse;
        for (int p = 0; p < 3; ++p) {
          const double q = std::clamp(std::nearbyint(left), -127.0, 127.0);
          out.q[(p * rows + r) * width + k * kBlock + j] = static_cast<int8_t>(q);
          left = (left - q) * kPlaneStep;
        }
      }
      out.d[r * blocks + k] = static_cast<float>(step / kPlaneStep);
      out.s[r * blocks + k] = static_cast<float>(sum);
    }
  }
  return out;
}

#if defined(__AVX2__)
inline __m256i broadcast16(const int8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// Q4_1 groups: qs [groups, blocks, 8, 16] uint8 (byte j of a block: weight j in the low
// nibble, j + 16 in the high, as in a GGUF), d and m [groups, blocks, 8] float16 with a
// group's rows in the order 0, 2, 4, 6, 1, 3, 5, 7 (kQ41RowOf).
struct Q41Groups {
  const uint8_t* qs;
  const at::Half* d;
  const at::Half* m;
  int64_t blocks;

  void prefetch(int64_t g) const {
    pagedserve::prefetch_ahead(qs + g * blocks * 128, blocks * 128);
    pagedserve::prefetch_ahead(d + g * blocks * 8, blocks * 16);
    pagedserve::prefetch_ahead(m + g * blocks * 8, blocks * 16);
  }

  // rows [first, first + R) of x (in P planes) against group g: out[r * stride + j] for
  // its rows j. Three planes' integer sums S0..S2 make (S0 * 254 + S1) + S2 / 254, exact
  // but for the last step's rounding: int32 holds S0 * 254 + S1 (at most 60960 * 255).
  template <int R, int P>
  void dot(int64_t g, const QuantizedRows& x, int64_t first, float* out, int64_t stride) const {
    static_assert(P == 1 || P == 3);
    const uint8_t* q = qs + g * blocks * 128;
    const at::Half* dg = d + g * blocks * 8;
    const at::Half* mg = m + g * blocks * 8;
#if defined(__AVX2__)
    __m256 acc[R], mins[R];
    for (int r = 0; r < R; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < blocks; ++k) {
      // rows 2i and 2i + 1 of the group: low nibbles (weights 0..15 of each, one row a
      // 128-bit lane) and high nibbles (weights 16..31)
      __m256i low[4], high[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * 128 + 32 * i));
        low[i] = _mm256_and_si256(v, mask);
        high[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
      const __m256 dv = load8(dg + k * 8), mv = load8(mg + k * 8);
      for (int r = 0; r < R; ++r) {
        const int64_t row = first + r, xb = row * x.blocks + k;
        __m256i sums[P];
        for (int p = 0; p < P; ++p) {
          const int8_t* xq = x.plane(p, row, k);
          const __m256i x_low = broadcast16(xq), x_high = broadcast16(xq + 16);
          __m256i pairs[4];
          for (int i = 0; i < 4; ++i) {
            pairs[i] = _mm256_add_epi16(_mm256_maddubs_epi16(low[i], x_low),
                                        _mm256_maddubs_epi16(high[i], x_high));
          }
          // [rows 0 2 4 6 | 1 3 5 7], each row's sixteen int16 summed
          sums[p] = _mm256_madd_epi16(
              _mm256_hadd_epi16(_mm256_hadd_epi16(pairs[0], pairs[1]),
                                _mm256_hadd_epi16(pairs[2], pairs[3])),
              ones);
        }
        __m256 total = _mm256_cvtepi32_ps(sums[0]);
        if constexpr (P == 3) {
          const __m256i upper = _mm256_add_epi32(
              _mm256_mullo_epi32(sums[0], _mm256_set1_epi32(254)), sums[1]);
          total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[2]), _mm256_set1_ps(1.f / kPlaneStep),
                                  _mm256_cvtepi32_ps(upper));
        }
        acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(dv, _mm256_set1_ps(x.d[xb])), acc[r]);
        mins[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.s[xb]), mins[r]);
      }
    }
    const __m256i natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * stride,
                       _mm256_permutevar8x32_ps(_mm256_add_ps(acc[r], mins[r]), natural));
    }
#else
    constexpr int kQ41RowOf[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    for (int r = 0; r < R; ++r) {
      const int64_t row = first + r;
      for (int p = 0; p < 8; ++p) {
        const int j = kQ41RowOf[p];
        float acc = 0.f, mins = 0.f;
        for (int64_t k = 0; k < blocks; ++k) {
          const uint8_t* w = q + k * 128 + j * 16;
          int32_t sums[P];
          for (int plane = 0; plane < P; ++plane) {
            const int8_t* xq = x.plane(plane, row, k);
            sums[plane] = 0;
            for (int i = 0; i < 16; ++i) {
              sums[plane] += (w[i] & 15) * xq[i] + (w[i] >> 4) * xq[i + 16];
            }
          }
          float total = static_cast<float>(sums[0]);
          if constexpr (P == 3) {
            total = std::fma(static_cast<float>(sums[2]), 1.f / kPlaneStep,
                             static_cast<float>(sums[0] * 254 + sums[1]));
          }
          const int64_t xb = row * x.blocks + k;
          acc = std::fma(total, static_cast<float>(dg[k * 8 + p]) * x.d[xb], acc);
          mins = std::fma(static_cast<float>(mg[k * 8 + p]), x.s[xb], mins);
        }
        out[r * stride + j] = acc + mins;
      }
    }
#endif
  }
};

// Q8_0 groups: qs [groups, blocks, 8, 32] int8, d [groups, blocks, 8] float16.
struct Q80Groups {
  const int8_t* qs;
  const at::Half* d;
  int64_t blocks;

  void prefetch(int64_t g) const {
    pagedserve::prefetch_ahead(qs + g * blocks * 256, blocks * 256);
    pagedserve::prefetch_ahead(d + g * blocks * 8, blocks * 16);
  }

  template <int R, int P>
  void dot(int64_t g, const QuantizedRows& x, int64_t first, float* out, int64_t stride) const {
    static_assert(P == 1, "Q8_0 takes int8 activations only");
    const int8_t* q = qs + g * blocks * 256;
    const at::Half* dg = d + g * blocks * 8;
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < blocks; ++k) {
      const __m256 dv = load8(dg + k * 8);
      for (int r = 0; r < R; ++r) {
        const int64_t row = first + r;
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.plane(0, row, k)));
        __m256i sums[8];  // row j's eight int32 partial sums
        for (int j = 0; j < 8; ++j) {
          const __m256i w =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * 256 + 32 * j));
          sums[j] = _mm256_madd_epi16(
              _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
        }
        // [rows 0..3 of the low 128-bit lanes | 0..3 of the high], and so for rows 4..7
        const __m256i first4 = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]),
                                                 _mm256_hadd_epi32(sums[2], sums[3]));
        const __m256i last4 = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[4], sums[5]),
                                                _mm256_hadd_epi32(sums[6], sums[7]));
        const __m256i total =
            _mm256_add_epi32(_mm256_permute2x128_si256(first4, last4, 0x20),
                             _mm256_permute2x128_si256(first4, last4, 0x31));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                                 _mm256_mul_ps(dv, _mm256_set1_ps(x.d[row * x.blocks + k])),
                                 acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
#else
    for (int r = 0; r < R; ++r) {
      const int64_t row = first + r;
      for (int j = 0; j < 8; ++j) {
        float acc = 0.f;
        for (int64_t k = 0; k < blocks; ++k) {
          const int8_t* w = q + k * 256 + j * 32;
          const int8_t* xq = x.plane(0, row, k);
          int32_t sum = 0;
          for (int i = 0; i < kBlock; ++i) sum += w[i] * xq[i];
          acc = std::fma(static_cast<float>(sum),
                         static_cast<float>(dg[k * 8 + j]) * x.d[row * x.blocks + k], acc);
        }
        out[r * stride + j] = acc;
      }
    }
#endif
  }
};

// A group's rows four at a time (its weights stay in L1 between the passes).
template <int P, typename Q>
void group_rows(const Q& q, int64_t g, const QuantizedRows& x, int64_t rows, float* out,
                int64_t stride) {
  for (int64_t first = 0; first < rows; first += 4) {
    float* at = out + first * stride + g * 8;
    switch (std::min<int64_t>(rows - first, 4)) {
      case 1: q.template dot<1, P>(g, x, first, at, stride); break;
      case 2: q.template dot<2, P>(g, x, first, at, stride); break;
      case 3: q.template dot<3, P>(g, x, first, at, stride); break;
      default: q.template dot<4, P>(g, x, first, at, stride); break;
    }
  }
}

// x's rows in P planes (1: quantized to int8, 3: split) times the groups' integers.
template <int P, typename Q>
at::Tensor grouped_products(const Q& q, int64_t groups, const at::Tensor& x,
                         const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), out_features = groups * 8;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  const QuantizedRows xq = P == 1
      ? quantize_rows(x.data_ptr<float>(), x.stride(0), rows, x.size(1))
      : split_rows(x.data_ptr<float>(), x.stride(0), rows, x.size(1));
  float* out = y.data_ptr<float>();
  at::parallel_for(0, groups, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      q.prefetch(g);
      group_rows<P>(q, g, xq, rows, out, out_features);
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// x [n <= 8, in] float32 with contiguous columns (in a multiple of 32); qs [groups, in /
// 32, 8, bytes] of `qs_type`, d (and m) [groups, in / 32, 8] float16; bias [groups * 8]
// float32 or None. `op` names the op in the error.
void check_group_args(const at::Tensor& x, const at::Tensor& qs, at::ScalarType qs_type,
                      int64_t bytes, const at::Tensor& d, const std::optional<at::Tensor>& bias,
                      const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows && x.size(1) % kBlock == 0,
              op, ": x must be float32 [n <= 8, in] (in a multiple of 32), contiguous columns");
  TORCH_CHECK(qs.dim() == 4 && qs.scalar_type() == qs_type && qs.is_contiguous() &&
                  qs.size(1) * kBlock == x.size(1) && qs.size(2) == 8 && qs.size(3) == bytes,
              op, ": qs must be contiguous ", qs_type, " [groups, in / 32, 8, ", bytes, "]");
  TORCH_CHECK(d.dim() == 3 && d.scalar_type() == at::kHalf && d.is_contiguous() &&
                  d.size(0) == qs.size(0) && d.size(1) == qs.size(1) && d.size(2) == 8,
              op, ": scales must be contiguous float16 [groups, in / 32, 8]");
  TORCH_CHECK(!bias.has_value() ||
                  (bias->dim() == 1 && bias->size(0) == qs.size(0) * 8 &&
                   bias->scalar_type() == at::kFloat),
              op, ": bias must be float32 [groups * 8]");
}

Q41Groups q4_1_groups(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                      const at::Tensor& m, const std::optional<at::Tensor>& bias,
                      const char* op) {
  check_group_args(x, qs, at::kByte, 16, d, bias, op);
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kHalf && m.is_contiguous(),
              op, ": mins must be contiguous float16 [groups, in / 32, 8]");
  return {qs.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), qs.size(1)};
}

}  // namespace

namespace pagedserve {

// x [n, in] float32, qs [groups, in / 32, 8, 16] uint8, d and m [groups, in / 32, 8]
// float16 (Q41Groups): [n, groups * 8].
at::Tensor q4_1_int8_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                            const at::Tensor& m, const std::optional<at::Tensor>& bias) {
  return grouped_products<1>(q4_1_groups(x, qs, d, m, bias, "q4_1_int8_matvec"), qs.size(0), x,
                          bias);
}

// As q4_1_int8_matvec, x split into three int8 planes: float32's precision of x's blocks.
at::Tensor q4_1_planes_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                              const at::Tensor& m, const std::optional<at::Tensor>& bias) {
  return grouped_products<3>(q4_1_groups(x, qs, d, m, bias, "q4_1_planes_matvec"), qs.size(0), x,
                          bias);
}

// x [n, in] float32, qs [groups, in / 32, 8, 32] int8 (-127..127), d [groups, in / 32, 8]
// float16 (Q80Groups): [n, groups * 8].
at::Tensor q8_0_int8_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                            const std::optional<at::Tensor>& bias) {
  check_group_args(x, qs, at::kChar, 32, d, bias, "q8_0_int8_matvec");
  const Q80Groups q{qs.data_ptr<int8_t>(), d.data_ptr<at::Half>(), qs.size(1)};
  return grouped_products<1>(q, qs.size(0), x, bias);
}

}  // namespace pagedserve
