// Float32 vectors of eight for the C++ CPU kernels: GCC/Clang vector extensions, which
// compile to AVX registers where built for them (see model_runner/kernels/cpu_kernels.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedserve {

// Eight floats in a vector register (GCC/Clang vector extension; AVX when compiled for it).
typedef float Vec8 __attribute__((vector_size(32)));

typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// Eight elements as float32: float16 through F16C where compiled for it, bfloat16 by
// moving its bits to the top half of a float32.
template <typename T>
inline Vec8 load8(const T* p) {
  Vec8 v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    U16x8 bits;
    std::memcpy(&bits, p, sizeof(bits));
    const U32x8 wide = __builtin_convertvector(bits, U32x8) << 16;
    std::memcpy(&v, &wide, sizeof(v));
  } else {
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, c10::Half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
#endif
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

inline float sum8(Vec8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t Int32x8 __attribute__((vector_size(32)));

// e^x, to float32 precision (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
// degree-6 polynomial in r, times 2^n). Inputs are clamped to [-87, 88]: below, ~1e-38 instead of 0.
inline Vec8 exp8(Vec8 x) {
  const Vec8 lowest = Vec8{} - 87.0f, highest = Vec8{} + 88.0f;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  const Vec8 t = x * 1.44269504088896341f + 0.5f;  // x / ln2, rounded below by floor
  Int32x8 n = __builtin_convertvector(t, Int32x8);  // truncates toward zero
  Vec8 nf = __builtin_convertvector(n, Vec8);
  const Int32x8 above = nf > t;                      // -1 where truncation rounded up
  n += above;
  nf = __builtin_convertvector(n, Vec8);
  const Vec8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Vec8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Int32x8 bits = (n + 127) << 23;
  Vec8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace pagedserve
