// The float32 matvec of csrc/cpu_matvec.cpp read from a block-quantized copy of a weight
// whose float32 values lie on a GGUF grid, as torch ops (torch.ops.pagedserve.q4_1_matvec,
// q8_0_matvec): each block of 32 weights of a row is d * q + m (Q4_1: q 0..15, d and m
// float16 values) or d * q (Q8_0: q -127..127). A model converted from such a GGUF (the
// default model is Q4_1, its embedding Q8_0) holds exactly these values as float32, and
// reading 4.5 or 8.5 bits a weight instead of 32 is what a batch-1 decode step waits for.
//
// Exact: d * q is exact in float32 (an 11-bit mantissa times at most 8 bits), so d * q + m
// is the float32 weight to the bit whether or not the compiler fuses the multiply into
// the add; the products then go into the accumulators in cpu_matvec.cpp's order (sixteen
// weights at a time, the first eight to one accumulator, the next eight to the other), so
// a row's output equals that matvec's on the float32 weight, bit for bit
// (tests/runner/test_block_quant.py holds the two orders together). model_runner/kernels/
// block_quant.py finds the blocks.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_ops.h"
#include "vec8.h"
#include "weight_stream.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pagedserve::load8;
using pagedserve::sum8;
using pagedserve::Vec8;

typedef int32_t Int32x8 __attribute__((vector_size(32)));
typedef uint8_t U8x8 __attribute__((vector_size(8)));
typedef int8_t I8x8 __attribute__((vector_size(8)));

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 8;
constexpr int64_t kGrain = 64;  // output rows a thread takes at least

// One block's 32 weights as four vectors of eight, in order.
struct BlockWeights {
  Vec8 w[4];
};

// Q4_1: 16 bytes, byte j holding weight j in its low nibble and weight j + 16 in its high.
inline BlockWeights q4_1_block(const uint8_t* q, float d, float m) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  const auto weights = [&](__m128i eight) {
    return static_cast<Vec8>(
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)), dv, mv));
  };
  return {{weights(lo), weights(_mm_srli_si128(lo, 8)), weights(hi),
           weights(_mm_srli_si128(hi, 8))}};
#else
  U8x8 lo_bytes, hi_bytes;
  std::memcpy(&lo_bytes, q, 8);
  std::memcpy(&hi_bytes, q + 8, 8);
  const Int32x8 a = __builtin_convertvector(lo_bytes, Int32x8);
  const Int32x8 b = __builtin_convertvector(hi_bytes, Int32x8);
  const Vec8 dv = Vec8{} + d, mv = Vec8{} + m;
  return {{__builtin_convertvector(a & 15, Vec8) * dv + mv,
           __builtin_convertvector(b & 15, Vec8) * dv + mv,
           __builtin_convertvector(a >> 4, Vec8) * dv + mv,
           __builtin_convertvector(b >> 4, Vec8) * dv + mv}};
#endif
}

// Q8_0: 32 signed bytes, one a weight.
inline BlockWeights q8_0_block(const int8_t* q, float d) {
  BlockWeights out;
#if defined(__AVX2__)
  const __m256 dv = _mm256_set1_ps(d);
  for (int k = 0; k < 4; ++k) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k));
    out.w[k] = static_cast<Vec8>(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), dv));
  }
#else
  const Vec8 dv = Vec8{} + d;
  for (int k = 0; k < 4; ++k) {
    I8x8 bytes;
    std::memcpy(&bytes, q + 8 * k, 8);
    out.w[k] = __builtin_convertvector(__builtin_convertvector(bytes, Int32x8), Vec8) * dv;
  }
#endif
  return out;
}

struct Q41 {
  const uint8_t* qs;  // [out, in / 2]
  const float* d;     // [out, in / 32]
  const float* m;     // [out, in / 32]
  int64_t blocks;     // in / 32
  BlockWeights block(int64_t o, int64_t k) const {
    const int64_t at = o * blocks + k;
    return q4_1_block(qs + at * 16, d[at], m[at]);
  }
  void prefetch(int64_t o) const {
    pagedserve::prefetch_ahead(qs + o * blocks * 16, blocks * 16);
    pagedserve::prefetch_ahead(d + o * blocks, blocks * 4);
    pagedserve::prefetch_ahead(m + o * blocks, blocks * 4);
  }
};

struct Q80 {
  const int8_t* qs;  // [out, in]
  const float* d;    // [out, in / 32]
  int64_t blocks;
  BlockWeights block(int64_t o, int64_t k) const {
    const int64_t at = o * blocks + k;
    return q8_0_block(qs + at * kBlock, d[at]);
  }
  void prefetch(int64_t o) const {
    pagedserve::prefetch_ahead(qs + o * blocks * kBlock, blocks * kBlock);
    pagedserve::prefetch_ahead(d + o * blocks, blocks * 4);
  }
};

// Every row of x (up to eight) dotted with output row o, each block's weights made once for
// all of them (a verification's token and drafts: five rows cost about twice one).
template <int R, typename Q>
inline void dot_rows(const Q& q, int64_t o, const float* x, int64_t x_stride, float* out) {
  Vec8 even[R] = {}, odd[R] = {};
  for (int64_t k = 0; k < q.blocks; ++k) {
    const BlockWeights b = q.block(o, k);
    const float* xk = x + k * kBlock;
    for (int r = 0; r < R; ++r) {
      even[r] += b.w[0] * load8(xk + r * x_stride);
      odd[r] += b.w[1] * load8(xk + r * x_stride + 8);
      even[r] += b.w[2] * load8(xk + r * x_stride + 16);
      odd[r] += b.w[3] * load8(xk + r * x_stride + 24);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum8(even[r] + odd[r]);
}

template <typename Q>
void matvec_rows(const Q& q, const float* x, int64_t x_stride, int64_t num_rows,
                 const float* bias, float* y, int64_t out_features) {
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    float dots[kMaxRows];
    for (int64_t o = begin; o < end; ++o) {
      q.prefetch(o);
      switch (num_rows) {
        case 1: dot_rows<1>(q, o, x, x_stride, dots); break;
        case 2: dot_rows<2>(q, o, x, x_stride, dots); break;
        case 3: dot_rows<3>(q, o, x, x_stride, dots); break;
        case 4: dot_rows<4>(q, o, x, x_stride, dots); break;
        case 5: dot_rows<5>(q, o, x, x_stride, dots); break;
        case 6: dot_rows<6>(q, o, x, x_stride, dots); break;
        case 7: dot_rows<7>(q, o, x, x_stride, dots); break;
        default: dot_rows<8>(q, o, x, x_stride, dots); break;
      }
      const float b = bias == nullptr ? 0.f : bias[o];
      for (int64_t r = 0; r < num_rows; ++r) y[r * out_features + o] = dots[r] + b;
    }
  });
}

const float* bias_ptr(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->data_ptr<float>() : nullptr;
}

// [n <= 8, in] float32 with contiguous columns, in a multiple of 32; qs, d (and m) in the
// layouts above; bias [out] float32 or None. `op` names the op in the error.
void check_block_args(const at::Tensor& x, const at::Tensor& d, int64_t out_features,
                      const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows && x.size(1) % kBlock == 0,
              op, ": x must be float32 [n <= 8, in] (in a multiple of 32), contiguous columns");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == out_features && d.size(1) == x.size(1) / kBlock,
              op, ": scales must be float32 [out, in / 32]");
  TORCH_CHECK(!bias.has_value() ||
                  (bias->dim() == 1 && bias->size(0) == out_features &&
                   bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              op, ": bias must be float32 [out]");
}

void check_q4_1_args(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m, const std::optional<at::Tensor>& bias,
                     const char* op) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(1) * 2 == x.size(1),
              op, ": qs must be contiguous uint8 [out, in / 2]");
  check_block_args(x, d, qs.size(0), bias, op);
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kFloat && m.is_contiguous(),
              op, ": mins must be float32 [out, in / 32]");
}

void check_q8_0_args(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.is_contiguous() &&
                  qs.size(1) == x.size(1),
              op, ": qs must be contiguous int8 [out, in]");
  check_block_args(x, d, qs.size(0), bias, op);
}

}  // namespace

namespace pagedserve {

// x [n, in] float32, qs [out, in / 2] uint8, d and m [out, in / 32] float32: [n, out].
at::Tensor q4_1_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& m, const std::optional<at::Tensor>& bias) {
  check_q4_1_args(x, qs, d, m, bias, "q4_1_matvec");
  at::Tensor y = at::empty({x.size(0), qs.size(0)}, x.options());
  const Q41 q{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), d.size(1)};
  matvec_rows(q, x.data_ptr<float>(), x.stride(0), x.size(0), bias_ptr(bias),
              y.data_ptr<float>(), qs.size(0));
  return y;
}

// x [n, in] float32, qs [out, in] int8, d [out, in / 32] float32: [n, out].
at::Tensor q8_0_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const std::optional<at::Tensor>& bias) {
  check_q8_0_args(x, qs, d, bias, "q8_0_matvec");
  at::Tensor y = at::empty({x.size(0), qs.size(0)}, x.options());
  const Q80 q{qs.data_ptr<int8_t>(), d.data_ptr<float>(), d.size(1)};
  matvec_rows(q, x.data_ptr<float>(), x.stride(0), x.size(0), bias_ptr(bias),
              y.data_ptr<float>(), qs.size(0));
  return y;
}

}  // namespace pagedserve
