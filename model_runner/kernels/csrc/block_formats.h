// A GGUF's block types as the file stores them, each as a struct the kernels of
// cpu_matvec_file_blocks.cpp are written over: kWeights (a block's weights, all of one row),
// kBytes (its size) and dequantize(block, w): its weights made in float32 as gguf-py
// (gguf.quants.dequantize) makes them, to the bit.
//
//   Q4_0: w = d * (q - 8)        q 0..15   d float16            18 bytes / 32 weights
//   Q5_0: w = d * (q - 16)       q 0..31   the fifth bits in qh 22 bytes / 32
//   Q5_1: w = d * q + m          q 0..31                        24 bytes / 32
//   Q8_0: w = d * q              q -128..127                    34 bytes / 32
//   Q4_K, Q5_K: w = (d * sc) * q - (dmin * m), sc and m 6-bit, q 0..15 or 0..31 (256 weights)
//   Q6_K:       w = (d * sc) * q, sc int8, q -32..31 (256 weights)
// Every product of a float16 scale and q (or sc) is exact in float32 (at most 11 + 8 bits;
// d * sc * q at most 11 + 7 + 5), so a fused multiply-add rounds as gguf-py's separate ones.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "vec8.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedserve::blocks {

using pagedserve::Int32x8;
using pagedserve::Vec8;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

typedef uint8_t U8x8 __attribute__((vector_size(8)));
typedef int8_t I8x8 __attribute__((vector_size(8)));

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

// Eight signed bytes from p, widened (vpmovsxbd).
inline Int32x8 signed_bytes8(const uint8_t* p) {
#if defined(__AVX2__)
  return reinterpret_cast<Int32x8>(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  I8x8 v;
  std::memcpy(&v, p, 8);
  return __builtin_convertvector(v, Int32x8);
#endif
}

inline Vec8 to_float(Int32x8 q) { return __builtin_convertvector(q, Vec8); }

inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// The legacy types' 32 weights: nibbles 0..15 of 16 bytes are weights 0..15 (low) and
// 16..31 (high); a Q5 block's bit i of qh is weight i's fifth bit.
template <bool kFifthBit, bool kMin>
inline void q45_block(const uint8_t* b, float* w) {
  const float d = half_at(b);
  const float m = kMin ? half_at(b + 2) : 0.f;
  const uint8_t* after = b + (kMin ? 4 : 2);
  uint32_t qh = 0;
  if constexpr (kFifthBit) std::memcpy(&qh, after, 4);
  const uint8_t* qs = after + (kFifthBit ? 4 : 0);
  const int32_t offset = kMin ? 0 : (kFifthBit ? 16 : 8);
  const Vec8 dv = Vec8{} + d, mv = Vec8{} + m;
  const Int32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int l = 0; l < 16; l += 8) {
    const Int32x8 q = bytes8(qs + l);
    Int32x8 lo = q & 0xF, hi = q >> 4;
    if constexpr (kFifthBit) {
      const Int32x8 h = Int32x8{} + static_cast<int32_t>(qh);
      lo |= ((h >> (lane + l)) & 1) << 4;
      hi |= ((h >> (lane + l + 16)) & 1) << 4;  // an arithmetic shift: bit 31 still right
    }
    if constexpr (kMin) {
      store8(w + l, dv * to_float(lo) + mv);
      store8(w + 16 + l, dv * to_float(hi) + mv);
    } else {
      store8(w + l, dv * to_float(lo - offset));
      store8(w + 16 + l, dv * to_float(hi - offset));
    }
  }
}

struct Q4_0 {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static void dequantize(const uint8_t* b, float* w) { q45_block<false, false>(b, w); }
};

struct Q5_0 {
  static constexpr int64_t kWeights = 32, kBytes = 22;
  static void dequantize(const uint8_t* b, float* w) { q45_block<true, false>(b, w); }
};

struct Q5_1 {
  static constexpr int64_t kWeights = 32, kBytes = 24;
  static void dequantize(const uint8_t* b, float* w) { q45_block<true, true>(b, w); }
};

struct Q8_0 {
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static void dequantize(const uint8_t* b, float* w) {
    const Vec8 d = Vec8{} + half_at(b);
    for (int l = 0; l < 32; l += 8) store8(w + l, d * to_float(signed_bytes8(b + 2 + l)));
  }
};

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block's twelve scale bytes
// (as float for the dequantized weights, as int for the int8 row kernels' sums).
template <typename T>
inline void scale_min(int64_t j, const uint8_t* s, T& sc, T& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

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

struct Q4_K {
  static constexpr int64_t kWeights = 256, kBytes = 144;
  static void dequantize(const uint8_t* b, float* w) { q45_k_block<false>(b, w); }
};

struct Q5_K {
  static constexpr int64_t kWeights = 256, kBytes = 176;
  static void dequantize(const uint8_t* b, float* w) { q45_k_block<true>(b, w); }
};

// Q6_K: 128 bytes of low nibbles (ql), 64 of high bit pairs (qh), 16 int8 scales (one per
// 16 weights), d (float16). Two halves of 128 weights, each four runs of 32.
struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static void dequantize(const uint8_t* b, float* w) {
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
};

// The kernels' number of each type (file_blocks_gemm, dequantize_file_blocks_), in
// model_runner/kernels/block_quant.py's `code` order.
enum class Type : int64_t { q4_k, q5_k, q6_k, q4_0, q5_0, q5_1, q8_0 };
constexpr int64_t kNumTypes = 7;

// f(Format{}) for the format of `type`.
template <class F>
decltype(auto) with_format(Type type, F&& f) {
  switch (type) {
    case Type::q4_k: return f(Q4_K{});
    case Type::q5_k: return f(Q5_K{});
    case Type::q6_k: return f(Q6_K{});
    case Type::q4_0: return f(Q4_0{});
    case Type::q5_0: return f(Q5_0{});
    case Type::q5_1: return f(Q5_1{});
    default: return f(Q8_0{});
  }
}

}  // namespace pagedserve::blocks
