// AMX's int8 tiles for a GGUF's blocks (file_blocks_amx_gemm's tile products), included
// once by cpu_matvec_file_blocks_int8.cpp where the host can have them (x86-64 with AVX2).
// No includes here: the includer's (immintrin.h, Activations, the `vnni` row kernels'
// unpacking, at::parallel_for). What the tiles compute, and why in this order: the
// includer's opening comment.
constexpr int64_t kTile = 16;  // weight rows, and rows of x, of one tile product
constexpr int64_t kPlaneTile = 512;  // bytes of one plane of a sub-block as tile B

// Two sets of tiles, sub-blocks taking them in turn: tmm0 (tmm5): A, 16 weight rows x a
// sub-block's 32 bytes (or a half's 16: K); tmm1, tmm2: B, both sets', x's two planes of it
// for 16 rows of x (K / 4 rows of 16 x 4 bytes); tmm3, tmm4 (tmm6, tmm7): C, the int32
// sums per plane, 16 x 16.
struct alignas(64) TileConfig {
  explicit TileConfig(int k) {
    colsb[0] = colsb[5] = static_cast<uint16_t>(k);
    rows[1] = rows[2] = static_cast<uint8_t>(k / 4);
  }
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {32, 64, 64, 64, 64, 32, 64, 64};
  uint8_t rows[16] = {16, 8, 8, 16, 16, 16, 16, 16};
};

// x's planes as tiles B, per (tile of 16 rows of x, sub-block, plane): B[kk][4 n + j] =
// q[row n][4 kk + j] (a half's tile: rows 4 h .. 4 h + 3); per (tile, sub-block) the 16
// rows' d, and per (tile, sub-block, half) d times the half's sum of 254 q0 + q1. Rows
// past x's end: zeros.
struct PackedX {
  std::vector<int8_t> tiles;
  std::vector<float> d, offsets;
};

PackedX pack_x(const Activations& a, int64_t row_tiles) {
  PackedX packed{std::vector<int8_t>(row_tiles * a.subs * 2 * kPlaneTile, 0),
                 std::vector<float>(row_tiles * a.subs * kTile, 0.f),
                 std::vector<float>(row_tiles * a.subs * 2 * kTile, 0.f)};
  at::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < a.subs; ++k) {
        const int64_t tk = t * a.subs + k;
        for (int64_t n = 0; n < kTile && t * kTile + n < a.rows; ++n) {
          const int64_t rk = (t * kTile + n) * a.subs + k;
          packed.d[tk * kTile + n] = a.d[rk];
          for (int h = 0; h < 2; ++h) {
            packed.offsets[(2 * tk + h) * kTile + n] = a.d[rk] * a.sums[2 * rk + h];
          }
          for (int p = 0; p < 2; ++p) {
            int8_t* tile = packed.tiles.data() + (2 * tk + p) * kPlaneTile;
            const int8_t* q = a.plane(p, t * kTile + n, k);
            for (int kk = 0; kk < 8; ++kk) std::memcpy(tile + 64 * kk + 4 * n, q + 4 * kk, 4);
          }
        }
      }
    }
  });
  return packed;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,amx-tile,amx-int8")
namespace amx {

// 16 weight rows as a panel: each sub-block's bytes q (vnni's unpacking: w = s q + o per
// half), less kZero's byte, as tile A [sub-block][16 rows][32], its scales and offsets
// [sub-block][half][16].
struct Panel {
  std::vector<int8_t> q;
  std::vector<float> s, o;
  explicit Panel(int64_t subs)
      : q(subs * kTile * 32), s(subs * 2 * kTile), o(subs * 2 * kTile) {}
};

// The byte a type's weights are offset by where the offset is a whole number of its scale
// (o = -zero s: Q4_0 8, Q5_0 16, Q6_K 32): the tiles take q - zero as signed bytes and
// need no offsets' part. 0: none such (Q5_1's, Q4_K's, Q5_K's offsets are their own).
template <class U>
constexpr int kZero = 0;
template <>
constexpr int kZero<vnni::Q4_0> = 8;
template <>
constexpr int kZero<vnni::Q5_0> = 16;
template <>
constexpr int kZero<vnni::Q6_K> = 32;

// 16 weight rows (`w`, row_bytes apart) into the panel: what the tiles read of it alone
// (a second half's scale and offset where the type has its own, offsets but for kZero's).
template <class U>
void unpack_group(const uint8_t* w, int64_t row_bytes, int64_t subs, Panel& panel) {
  int8_t* q = panel.q.data();
  float *s = panel.s.data(), *o = panel.o.data();  // (held here: not reloaded per store)
  const auto put = [&](const vnni::Sub& sub, int64_t m, int64_t k) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (k * kTile + m) * 32),
                        _mm256_sub_epi8(sub.q, _mm256_set1_epi8(kZero<U>)));
    s[2 * k * kTile + m] = sub.s0;
    if constexpr (U::kHalves) s[(2 * k + 1) * kTile + m] = sub.s1;
    if constexpr (kZero<U> == 0) {
      o[2 * k * kTile + m] = sub.o0;
      if constexpr (U::kHalves) o[(2 * k + 1) * kTile + m] = sub.o1;
    }
  };
  for (int64_t m = 0; m < kTile; ++m) {
    const uint8_t* row = w + m * row_bytes;
    if constexpr (U::kSubs == 1) {
      for (int64_t k = 0; k < subs; ++k) put(U::unpack(row + k * U::kBytes), m, k);
    } else {
      vnni::Sub unpacked[U::kSubs];
      for (int64_t b = 0; b < subs / U::kSubs; ++b) {
        U::unpack_all(row + b * U::kBytes, unpacked);
        for (int64_t j = 0; j < U::kSubs; ++j) put(unpacked[j], m, b * U::kSubs + j);
      }
    }
  }
}

// Where one group's tile A of sub-block k (half h) is, and its 16 rows' scales and offsets
// (none for Q8_0, whose bytes and scales are read in place, row_bytes apart).
struct Part {
  const void* a;
  int64_t stride;
  const float *s, *o;
};

template <class U>
Part part_of(const uint8_t* group, int64_t row_bytes, const Panel& panel, int64_t k, int h,
             float* scales) {
  if constexpr (std::is_same_v<U, vnni::Q8_0>) {
    const uint8_t* block = group + k * U::kBytes;
    // the 16 rows' float16 scales gathered, converted at once
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
    const __m512i words = _mm512_i32gather_epi32(rows, block, 1);
    _mm512_storeu_ps(scales, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)));
    return {block + 2, row_bytes, scales, nullptr};
  } else {
    const int64_t half = (2 * k + h) * kTile;
    return {panel.q.data() + k * kTile * 32 + 16 * h, 32, panel.s.data() + half,
            panel.o.data() + half};
  }
}

// acc[m] += (254 C0 + C1)[m] s[m] d, then (with offsets) += o[m] d S.
inline void combine(const int32_t* first, const int32_t* second, __m512 dx, const Part& part,
                    const __m512* dsum, __m512* acc) {
  for (int64_t m = 0; m < kTile; ++m) {
    const __m512i sum = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_load_si512(first + kTile * m), _mm512_set1_epi32(254)),
        _mm512_load_si512(second + kTile * m));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                             _mm512_mul_ps(dx, _mm512_set1_ps(part.s[m])), acc[m]);
  }
  if (dsum == nullptr) return;
  for (int64_t m = 0; m < kTile; ++m) {
    acc[m] = _mm512_fmadd_ps(*dsum, _mm512_set1_ps(part.o[m]), acc[m]);
  }
}

// 16 weight rows from `group` (their panel, for unpacked types) against x's row tile t:
// acc[m] = y[t's rows][m] less bias. Per sub-block (or half, for U::kHalves) and plane one
// tile product, issued into the other set of tiles before the previous one's sums are
// stored and combined, so that the matrix unit and the vector units work at once;
// meanwhile the next group's bytes (`next`, `next_bytes`; null: none) are fetched a
// slice a sub-block.
template <class U>
void tile_pass(const uint8_t* group, int64_t row_bytes, const Panel& panel, const PackedX& x,
               int64_t subs, int64_t t, const uint8_t* next, int64_t next_bytes,
               __m512 (&acc)[kTile]) {
  constexpr int kHalves = U::kHalves ? 2 : 1;
  constexpr bool kOffsets = !std::is_same_v<U, vnni::Q8_0> && kZero<U> == 0;
  alignas(64) int32_t sums[2][kTile * kTile];
  float scales[2][kTile];
  Part parts[2];
  const int64_t steps = subs * kHalves, slice = (next_bytes / subs + 64) & ~int64_t{63};
  // step j: sub-block j / kHalves, half j % kHalves, into slot j % 2's scales
  const auto issue = [&](int64_t j) {
    const int64_t k = j / kHalves, h = j % kHalves;
    parts[j % 2] = part_of<U>(group, row_bytes, panel, k, h, scales[j % 2]);
    const int8_t* b = x.tiles.data() + 2 * (t * subs + k) * kPlaneTile + 256 * h;
    _tile_loadd(1, b, 64);
    _tile_loadd(2, b + kPlaneTile, 64);
    if (j % 2 == 0) {
      _tile_loadd(0, parts[0].a, parts[0].stride);
      _tile_zero(3);
      _tile_zero(4);
      _tile_dpbssd(3, 0, 1);
      _tile_dpbssd(4, 0, 2);
    } else {
      _tile_loadd(5, parts[1].a, parts[1].stride);
      _tile_zero(6);
      _tile_zero(7);
      _tile_dpbssd(6, 5, 1);
      _tile_dpbssd(7, 5, 2);
    }
  };
  for (auto& v : acc) v = _mm512_setzero_ps();
  issue(0);
  for (int64_t j = 0; j < steps; ++j) {
    const int64_t k = j / kHalves, h = j % kHalves, tk = t * subs + k;
    const Part part = parts[j % 2];
    if (j + 1 < steps) issue(j + 1);
    if (j % 2 == 0) {
      _tile_stored(3, sums[0], 64);
      _tile_stored(4, sums[1], 64);
    } else {
      _tile_stored(6, sums[0], 64);
      _tile_stored(7, sums[1], 64);
    }
    for (int64_t i = k * slice; next != nullptr && h == 0 && i < std::min((k + 1) * slice,
                                                                          next_bytes);
         i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
    }
    const __m512 dx = _mm512_loadu_ps(x.d.data() + tk * kTile);
    // the offsets' part o[m] d S (Q8_0 and the kZero types have none)
    const float* offsets = x.offsets.data() + 2 * tk * kTile;
    const __m512 dsum = kHalves == 2 ? _mm512_loadu_ps(offsets + h * kTile)
        : _mm512_add_ps(_mm512_loadu_ps(offsets), _mm512_loadu_ps(offsets + kTile));
    combine(sums[0], sums[1], dx, part, kOffsets ? &dsum : nullptr, acc);
  }
}

// y's rows of tile t (of `rows`), columns [16 g, 16 g + 16), from acc[m] (lane n: x's row
// 16 t + n), plus bias.
void put_tile(const __m512* acc, int64_t t, int64_t rows, const float* bias, float* y,
              int64_t out_features, int64_t g) {
  alignas(64) float out[kTile * kTile];
  for (int64_t m = 0; m < kTile; ++m) _mm512_store_ps(out + kTile * m, acc[m]);
  for (int64_t n = 0; n < kTile && t * kTile + n < rows; ++n) {
    float* yr = y + (t * kTile + n) * out_features + g * kTile;
    for (int64_t m = 0; m < kTile; ++m) {
      yr[m] = out[kTile * m + n] + (bias != nullptr ? bias[g * kTile + m] : 0.f);
    }
  }
}

// Weight rows [16 g0, 16 g1) (blocks of U, row_bytes apart) against every tile of x: y's
// columns there, plus bias; a group of 16 at a time, the next one's bytes fetched
// meanwhile. Q8_0's bytes are read in place (tile A straight from the blocks), the
// others' unpacked once per group for every tile of x.
template <class U>
void gemm_groups(const uint8_t* w, int64_t row_bytes, const PackedX& x, int64_t subs,
                 int64_t rows, const float* bias, float* y, int64_t out_features, int64_t g0,
                 int64_t g1) {
  constexpr bool kInPlace = std::is_same_v<U, vnni::Q8_0>;
  const TileConfig config(U::kHalves ? 16 : 32);
  _tile_loadconfig(&config);
  Panel panel(kInPlace ? 0 : subs);
  __m512 acc[kTile];
  const int64_t row_tiles = (rows + kTile - 1) / kTile, group_bytes = kTile * row_bytes;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = w + g * group_bytes;
    if constexpr (!kInPlace) unpack_group<U>(group, row_bytes, subs, panel);
    for (int64_t t = 0; t < row_tiles; ++t) {
      const uint8_t* next = t == 0 && g + 1 < g1 ? group + group_bytes : nullptr;
      tile_pass<U>(group, row_bytes, panel, x, subs, t, next, group_bytes, acc);
      put_tile(acc, t, rows, bias, y, out_features, g);
    }
  }
  _tile_release();
}

void groups(Type type, const uint8_t* w, int64_t row_bytes, const PackedX& x, int64_t subs,
            int64_t rows, const float* bias, float* y, int64_t out_features, int64_t g0,
            int64_t g1) {
  vnni::with_unpacking(type, [&](auto unpacking) {
    gemm_groups<decltype(unpacking)>(w, row_bytes, x, subs, rows, bias, y, out_features, g0,
                                     g1);
  });
}

}  // namespace amx
#pragma GCC pop_options
