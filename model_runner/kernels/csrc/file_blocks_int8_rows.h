// The row kernels of cpu_matvec_file_blocks_int8.cpp, which includes this file twice: inside
// namespace `avx2` (AVX2's byte products: maddubs, then madd) and inside namespace `vnni`
// under `#pragma GCC target` for AVX-512 VNNI (one vpdpbusd), with PAGEDSERVE_INT8_VNNI
// saying which. No includes here: the includer's (immintrin.h, block_formats.h' Type and
// scale_min, Activations, weight_stream.h's prefetch_ahead).
//
// Each 32 weights of a row (a sub-block: a legacy block, or a K-quant's eighth) are made as
// 32 bytes q and per half of 16 a scale s and an offset o, w = s * q + o, q unsigned
// (0..15, 0..31 or 0..63) or, for Q8_0, signed with o = 0:
//   Q4_0  s = d, o = -8 d      Q5_0  s = d, o = -16 d      Q5_1  s = d, o = m
//   Q4_K, Q5_K  s = d * sc, o = -dmin * m (sc, m the sub-block's 6-bit scale and min)
//   Q6_K  s = d * sc (one sc per 16), o = -32 s            Q8_0  s = d
// Against a row of x quantized per 32 (x ~ d (254 q0 + q1), the halves' sums S of
// 254 q0 + q1; Activations):
//   dot = sum over halves of  s d sum(q (254 q0 + q1))  +  o d S
// with the byte products exact in int32 (lanes 0..3 of them are the first half).

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline float half_of(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Four-byte groups of u * s (u unsigned, s signed) summed into eight int32 lanes; AVX2's
// int16 pair sums cannot saturate: |u| <= 128 (Q8_0's magnitudes) and |s| <= 127.
inline __m256i dot_bytes(__m256i u, __m256i s) {
#if PAGEDSERVE_INT8_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

struct Sub {
  __m256i q;
  float s0, s1, o0, o1;  // the halves' scales and offsets (equal unless U::kHalves)
};

inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0xF)); }
inline __m256i high_nibbles(__m256i v) { return low_nibbles(_mm256_srli_epi16(v, 4)); }

// A legacy block's 16 bytes of nibbles as its 32 weights in order (low nibbles, then high).
inline __m256i nibbles16(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return low_nibbles(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw));
}

// 16 in byte l where bit l of `bits` is set (a Q5 block's fifth bits), else 0.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

struct Q4_0 {
  static constexpr int64_t kBytes = 18, kSubs = 1;
  static constexpr bool kSigned = false, kHalves = false;
  static Sub unpack(const uint8_t* b) {
    const float d = half_of(b);
    return {nibbles16(b + 2), d, d, -8.f * d, -8.f * d};
  }
};

struct Q5_0 {
  static constexpr int64_t kBytes = 22, kSubs = 1;
  static constexpr bool kSigned = false, kHalves = false;
  static Sub unpack(const uint8_t* b) {
    const float d = half_of(b);
    return {_mm256_or_si256(nibbles16(b + 6), fifth_bits(b + 2)), d, d, -16.f * d, -16.f * d};
  }
};

struct Q5_1 {
  static constexpr int64_t kBytes = 24, kSubs = 1;
  static constexpr bool kSigned = false, kHalves = false;
  static Sub unpack(const uint8_t* b) {
    const float d = half_of(b), m = half_of(b + 2);
    return {_mm256_or_si256(nibbles16(b + 8), fifth_bits(b + 4)), d, d, m, m};
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34, kSubs = 1;
  static constexpr bool kSigned = true, kHalves = false;
  static Sub unpack(const uint8_t* b) {
    const float d = half_of(b);
    return {load32(b + 2), d, d, 0.f, 0.f};
  }
};

// Q4_K (kFifthBit false) and Q5_K: sub-block j is the low (j even) or high nibbles of the
// 32 bytes of chunk j / 2; Q5_K's fifth bit of weight l is bit j of qh[l]. A super-block's
// eight sub-blocks are made at once (`unpack_all`: its scales decoded once).
template <bool kFifthBit>
struct QK45 {
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144, kSubs = 8;
  static constexpr bool kSigned = false, kHalves = false;
  static void unpack_all(const uint8_t* b, Sub* subs) {
    const float d = half_of(b), dmin = half_of(b + 2);
    const uint8_t* qs = b + (kFifthBit ? 48 : 16);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFifthBit) qh = load32(b + 16);
    for (int64_t j = 0; j < 8; ++j) {
      int sc, m;
      pagedserve::blocks::scale_min(j, b + 4, sc, m);
      const __m256i raw = load32(qs + 32 * (j / 2));
      __m256i q = (j & 1) ? high_nibbles(raw) : low_nibbles(raw);
      if constexpr (kFifthBit) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
      const float s = d * static_cast<float>(sc), o = -dmin * static_cast<float>(m);
      subs[j] = {q, s, s, o, o};
    }
  }
};
using Q4_K = QK45<false>;
using Q5_K = QK45<true>;

// Q6_K: half h (ql + 64 h, qh + 32 h, scales + 8 h), run t of 32 weights (sub-block
// 4 h + t): the low (t < 2) or high nibbles of ql[32 (t % 2) + l], bits 2t, 2t + 1 of
// qh[l] above them, a scale per 16.
struct Q6_K {
  static constexpr int64_t kBytes = 210, kSubs = 8;
  static constexpr bool kSigned = false, kHalves = true;
  static void unpack_all(const uint8_t* b, Sub* subs) {
    const float d = half_of(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i ql[2] = {load32(b + 64 * h), load32(b + 64 * h + 32)};
      const __m256i qh = load32(b + 128 + 32 * h);
      for (int64_t t = 0; t < 4; ++t) {
        const __m256i low = t < 2 ? low_nibbles(ql[t % 2]) : high_nibbles(ql[t % 2]);
        const __m256i high = _mm256_slli_epi16(
            _mm256_and_si256(_mm256_srli_epi16(qh, static_cast<int>(2 * t)),
                             _mm256_set1_epi8(3)), 4);
        const int8_t* sc = scales + 8 * h + 2 * t;
        const float s0 = d * static_cast<float>(sc[0]), s1 = d * static_cast<float>(sc[1]);
        subs[4 * h + t] = {_mm256_or_si256(low, high), s0, s1, -32.f * s0, -32.f * s1};
      }
    }
  }
};

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R rows of x against one output row of `blocks` blocks: two float accumulators a row
// (even and odd sub-blocks) so that a multiply-add need not wait for the one before.
template <class U, int R>
inline void row_dots(const uint8_t* row, int64_t blocks, const Activations& a, float* out) {
  __m256 even[R], odd[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    even[r] = odd[r] = _mm256_setzero_ps();
    offset[r] = 0.f;
  }
  // sub-block w, x's sub-block k, into acc
  const auto step = [&](__m256(&acc)[R], const Sub& w, int64_t k) {
    const __m256i magnitude = U::kSigned ? _mm256_sign_epi8(w.q, w.q) : w.q;
    for (int r = 0; r < R; ++r) {
      __m256i x0 = load32(reinterpret_cast<const uint8_t*>(a.plane(0, r, k)));
      __m256i x1 = load32(reinterpret_cast<const uint8_t*>(a.plane(1, r, k)));
      if constexpr (U::kSigned) {
        x0 = _mm256_sign_epi8(x0, w.q);
        x1 = _mm256_sign_epi8(x1, w.q);
      }
      const float dx = a.d[r * a.subs + k];
      // a lane's 254 sum(q q0) + sum(q q1), four products each: under 255 * 4 * 128 * 127
      // < 2^24, so exact in float32 too
      const __m256i both = _mm256_add_epi32(
          _mm256_mullo_epi32(dot_bytes(magnitude, x0), _mm256_set1_epi32(254)),
          dot_bytes(magnitude, x1));
      const __m256 products = _mm256_cvtepi32_ps(both);
      const __m256 scale = U::kHalves ? _mm256_setr_m128(_mm_set1_ps(w.s0 * dx),
                                                         _mm_set1_ps(w.s1 * dx))
                                      : _mm256_set1_ps(w.s0 * dx);
      acc[r] = _mm256_fmadd_ps(products, scale, acc[r]);
      if constexpr (!U::kSigned) {
        const float* sums = a.sums.data() + 2 * (r * a.subs + k);
        // multiply-adds spelled out: the compiler's own contraction of this line varied
        // with its inlining, so the AVX2 and the VNNI kernels' numbers could part
        offset[r] = std::fma(dx, std::fma(w.o0, sums[0], w.o1 * sums[1]), offset[r]);
      }
    }
  };
  Sub subs[U::kSubs];
  if constexpr (U::kSubs == 1) {
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
      step(even, U::unpack(row + b * U::kBytes), b);
      step(odd, U::unpack(row + (b + 1) * U::kBytes), b + 1);
    }
    if (b < blocks) step(even, U::unpack(row + b * U::kBytes), b);
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      U::unpack_all(row + b * U::kBytes, subs);
      for (int64_t j = 0; j < U::kSubs; j += 2) {
        step(even, subs[j], b * U::kSubs + j);
        step(odd, subs[j + 1], b * U::kSubs + j + 1);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes(_mm256_add_ps(even[r], odd[r])) + offset[r];
}

template <class U>
void rows_of(const uint8_t* blocks, int64_t row_bytes, const Activations& a, const float* bias,
             float* y, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t blocks_per_row = row_bytes / U::kBytes;
  float dots[8];
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = blocks + o * row_bytes;
    prefetch_ahead(row, row_bytes);
    switch (a.rows) {
      case 1: row_dots<U, 1>(row, blocks_per_row, a, dots); break;
      case 2: row_dots<U, 2>(row, blocks_per_row, a, dots); break;
      case 3: row_dots<U, 3>(row, blocks_per_row, a, dots); break;
      case 4: row_dots<U, 4>(row, blocks_per_row, a, dots); break;
      case 5: row_dots<U, 5>(row, blocks_per_row, a, dots); break;
      case 6: row_dots<U, 6>(row, blocks_per_row, a, dots); break;
      case 7: row_dots<U, 7>(row, blocks_per_row, a, dots); break;
      default: row_dots<U, 8>(row, blocks_per_row, a, dots); break;
    }
    const float b = bias == nullptr ? 0.f : bias[o];
    for (int64_t r = 0; r < a.rows; ++r) y[r * out_features + o] = dots[r] + b;
  }
}

// fn(U{}), U the unpacking of `type`'s blocks.
template <class Fn>
inline void with_unpacking(Type type, Fn&& fn) {
  switch (type) {
    case Type::q4_k: return fn(Q4_K{});
    case Type::q5_k: return fn(Q5_K{});
    case Type::q6_k: return fn(Q6_K{});
    case Type::q4_0: return fn(Q4_0{});
    case Type::q5_0: return fn(Q5_0{});
    case Type::q5_1: return fn(Q5_1{});
    default: return fn(Q8_0{});
  }
}

// Output rows [begin, end) of y = x @ W.T + bias, W in blocks of `type`.
void output_rows(Type type, const uint8_t* blocks, int64_t row_bytes, const Activations& a,
                 const float* bias, float* y, int64_t out_features, int64_t begin,
                 int64_t end) {
  with_unpacking(type, [&](auto unpacking) {
    rows_of<decltype(unpacking)>(blocks, row_bytes, a, bias, y, out_features, begin, end);
  });
}
