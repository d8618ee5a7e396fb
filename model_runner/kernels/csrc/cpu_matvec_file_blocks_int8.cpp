// y = x @ W.T + bias on a GGUF's blocks as the file stores them (block_formats.h), for up
// to eight rows, on llama.cpp's integer dot products: the blocks' integers times int8
// activations (torch.ops.pagedserve.q4_k_int8_matvec, q5_k_, q6_k_, q4_0_, q5_0_, q5_1_,
// q8_0_file_int8_matvec; which ISA runs them: file_blocks_int8_isa).
//
// Each row of x is quantized once per call, per 32 values, in two int8 planes: q0 on
// llama.cpp's Q8_0 grid (max|x| / 127), q1 the residual on a grid 254 times finer, so
// x ~ d (254 q0 + q1) with d = max|x| / 127 / 254. One plane alone (llama.cpp's own
// arithmetic) moved Gemma 3 270M's logits by up to 0.7 against the exact path, flipping
// HF's near ties of 0.06; two move them by 0.003 (docs/benchmarks.md, issue 45), and cost
// one more byte product a block, within the weights' reading on a batch-1 step. Each 32
// weights of an output row are made as bytes q with a scale and an offset per half
// (file_blocks_int8_rows.h); their dot with x is
//   sum over halves of  s d sum(q (254 q0 + q1))  +  o d sum(254 q0 + q1)
// the byte products summed exactly in int32, then in float32. The error against
// x @ dequantize(W).T is that of x's rounding: at most d / 2 a value, so per block
// |sum(w (x - x~))| <= d / 2 * sum|w|.
//
// Larger batches (file_blocks_amx_gemm, any rows) take AMX's int8 tiles where the host has
// them and the kernel grants them (amx_int8_granted): 16 weight rows unpacked once into
// bytes (the row kernels' unpacking), then per sub-block (a half, for Q6_K's scale per 16)
// one tile product per plane of x for every 16 rows of x, the int32 sums scaled in float32
// as above; the same arithmetic as the matvecs' two planes.
//
// Chosen at run time: on an AVX-512 VNNI host (avx512vnni and avx512vl) each 32 byte
// products are one vpdpbusd, on other AVX2 hosts maddubs then madd (AVX2's int16 pair sums,
// which the magnitudes here cannot saturate). The row kernels are written once
// (file_blocks_int8_rows.h) and compiled for both. Without AVX2 the ops refuse, and the
// kernel table keeps a file's blocks on their exact paths (cpu_kernel_table.py).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "block_formats.h"
#include "cpu_ops.h"
#include "weight_stream.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using pagedserve::prefetch_ahead;
using pagedserve::blocks::Type;

constexpr int64_t kMaxRows = 8;
constexpr int64_t kGrain = 16;  // output rows a thread takes at least

constexpr float kPlaneStep = 254.f;  // the second plane's unit: 1/254 of the first's

// x's rows quantized per 32 in two int8 planes: x ~ d (254 q0 + q1), d = max|x| / 127 / 254
// (q0 = x / (254 d) rounded to nearest even, q1 what it left, rounded: |q1| <= 127). q
// [2, rows, width]; d [rows, subs]; the halves' sums of 254 q0 + q1 [rows, subs, 2].
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
  int64_t rows, width, subs;

  const int8_t* plane(int p, int64_t row, int64_t k) const {
    return q.data() + (p * rows + row) * width + 32 * k;
  }
};

// Row r of x (stride apart) into a's planes, scales and halves' sums.
void quantize_row(const float* x, int64_t stride, int64_t r, Activations& a) {
  for (int64_t k = 0; k < a.subs; ++k) {
    const float* v = x + r * stride + 32 * k;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(v[i]));
    const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
    // the residual in double: v - d q0 exactly, then in the second plane's units
    const double to_second = d > 0.f ? kPlaneStep / static_cast<double>(d) : 0.;
    int8_t* q0 = a.q.data() + r * a.width + 32 * k;
    int8_t* q1 = a.q.data() + (a.rows + r) * a.width + 32 * k;
    int32_t sums[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      const float first = std::clamp(std::nearbyint(v[i] * inverse), -127.f, 127.f);
      const double residual = static_cast<double>(v[i]) - static_cast<double>(d) * first;
      q0[i] = static_cast<int8_t>(first);
      q1[i] = static_cast<int8_t>(std::clamp(std::nearbyint(residual * to_second), -127., 127.));
      sums[i / 16] += 254 * q0[i] + q1[i];
    }
    a.d[r * a.subs + k] = d / kPlaneStep;
    a.sums[2 * (r * a.subs + k)] = static_cast<float>(sums[0]);
    a.sums[2 * (r * a.subs + k) + 1] = static_cast<float>(sums[1]);
  }
}

Activations quantize(const float* x, int64_t stride, int64_t rows, int64_t width) {
  const int64_t subs = width / 32;
  Activations a{std::vector<int8_t>(2 * rows * width), std::vector<float>(rows * subs),
                std::vector<float>(2 * rows * subs), rows, width, subs};
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x, stride, r, a);
  });
  return a;
}

#if defined(__AVX2__) && defined(__GNUC__)
#define PAGEDSERVE_FILE_INT8 1

namespace avx2 {
#define PAGEDSERVE_INT8_VNNI 0
#include "file_blocks_int8_rows.h"
#undef PAGEDSERVE_INT8_VNNI
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define PAGEDSERVE_INT8_VNNI 1
#include "file_blocks_int8_rows.h"
#undef PAGEDSERVE_INT8_VNNI
}  // namespace vnni
#pragma GCC pop_options

// PAGEDSERVE_NO_VNNI set: the AVX2 kernels on a VNNI host too (their tests run them so).
bool has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw") &&
                          std::getenv("PAGEDSERVE_NO_VNNI") == nullptr;
  return has;
}
#endif

// What both products ask of blocks (contiguous uint8 rows of `type`'s blocks for x's
// width, out features a multiple of `out_multiple`) and of bias; `op` names the op.
void check_blocks_and_bias(const at::Tensor& x, const at::Tensor& blocks,
                           const std::optional<at::Tensor>& bias, Type type, const char* op,
                           int64_t out_multiple) {
  const int64_t out_features = blocks.dim() == 2 ? blocks.size(0) : 0;
  TORCH_CHECK(!bias.has_value() ||
                  (bias->dim() == 1 && bias->size(0) == out_features &&
                   bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              op, ": bias must be float32 [out]");
  pagedserve::blocks::with_format(type, [&](auto format) {
    using F = decltype(format);
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte &&
                    blocks.stride(1) == 1 && blocks.stride(0) == blocks.size(1) &&
                    x.size(1) % F::kWeights == 0 &&
                    blocks.size(1) == x.size(1) / F::kWeights * F::kBytes &&
                    out_features % out_multiple == 0,
                op, ": blocks must be contiguous uint8 [out, in / ", F::kWeights, " * ",
                F::kBytes, "] (in a multiple of ", F::kWeights,
                out_multiple > 1 ? ", out of " + std::to_string(out_multiple) : std::string(),
                ")");
  });
}

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& blocks,
                        const std::optional<at::Tensor>& bias, Type type, const char* op) {
#if defined(PAGEDSERVE_FILE_INT8)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows,
              op, ": x must be float32 [n <= 8, in] with contiguous columns");
  check_blocks_and_bias(x, blocks, bias, type, op, 1);
  const int64_t out_features = blocks.size(0);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  const Activations a = quantize(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  const bool vnni_host = has_vnni();
  at::parallel_for(0, out_features, kGrain, [&](int64_t begin, int64_t end) {
    if (vnni_host) {
      vnni::output_rows(type, w, row_bytes, a, b, out, out_features, begin, end);
    } else {
      avx2::output_rows(type, w, row_bytes, a, b, out, out_features, begin, end);
    }
  });
  return y;
#else
  TORCH_CHECK(false, op, ": needs a build for AVX2 (the kernel table keeps the exact paths)");
#endif
}

#if defined(PAGEDSERVE_FILE_INT8) && defined(__x86_64__)
#define PAGEDSERVE_AMX 1

// AMX's tile state is the kernel's to grant, per process (ARCH_REQ_XCOMP_PERM); a tile
// instruction without it faults, as llama.cpp's native build does on this kind of virtual
// machine. Asked once; PAGEDSERVE_NO_AMX set (or no VNNI: the combine is AVX-512): never.
bool amx_granted() {
  static const bool granted = [] {
    if (std::getenv("PAGEDSERVE_NO_AMX") != nullptr || !has_vnni()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    const bool tile = ((d >> 24) & 1) != 0, int8 = ((d >> 25) & 1) != 0;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return tile && int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

constexpr int64_t kTile = 16;  // weight rows, and rows of x, of one tile product
constexpr int64_t kPlaneTile = 512;  // bytes of one plane of a sub-block as tile B

// tmm0: A, 16 weight rows x a sub-block's 32 bytes (or a half's 16: K); tmm1, tmm2: B, x's
// two planes of it for 16 rows of x (K / 4 rows of 16 x 4 bytes); tmm3, tmm4: C, their
// int32 sums, 16 x 16.
struct alignas(64) TileConfig {
  explicit TileConfig(int k) {
    colsb[0] = static_cast<uint16_t>(k);
    rows[1] = rows[2] = static_cast<uint8_t>(k / 4);
  }
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {32, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 8, 8, 16, 16};
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
// half) as tile A [sub-block][16 rows][32], its scales and offsets [sub-block][half][16].
struct Panel {
  std::vector<int8_t> q;
  std::vector<float> s, o;
  explicit Panel(int64_t subs)
      : q(subs * kTile * 32), s(subs * 2 * kTile), o(subs * 2 * kTile) {}

  void put(const vnni::Sub& sub, int64_t m, int64_t k) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + (k * kTile + m) * 32), sub.q);
    s[2 * k * kTile + m] = sub.s0;
    s[(2 * k + 1) * kTile + m] = sub.s1;
    o[2 * k * kTile + m] = sub.o0;
    o[(2 * k + 1) * kTile + m] = sub.o1;
  }
};

template <class U>
void unpack_group(const uint8_t* w, int64_t row_bytes, int64_t subs, Panel& panel) {
  for (int64_t m = 0; m < kTile; ++m) {
    const uint8_t* row = w + m * row_bytes;
    if constexpr (U::kSubs == 1) {
      for (int64_t k = 0; k < subs; ++k) panel.put(U::unpack(row + k * U::kBytes), m, k);
    } else {
      vnni::Sub unpacked[U::kSubs];
      for (int64_t b = 0; b < subs / U::kSubs; ++b) {
        U::unpack_all(row + b * U::kBytes, unpacked);
        for (int64_t j = 0; j < U::kSubs; ++j) panel.put(unpacked[j], m, b * U::kSubs + j);
      }
    }
  }
}

// Weight rows [16 g0, 16 g1) (blocks of U, row_bytes apart) against every tile of x: y's
// columns there, plus bias. Per sub-block (or half, for U::kHalves) and plane one tile
// product; then acc[m] += (254 C0 + C1)[m] s[m] d + o[m] d S. Q8_0's bytes are read in
// place (tile A straight from the blocks, row_bytes apart), the others' unpacked first.
template <class U>
void gemm_groups(const uint8_t* w, int64_t row_bytes, const PackedX& x, int64_t subs,
                 int64_t rows, const float* bias, float* y, int64_t out_features, int64_t g0,
                 int64_t g1) {
  constexpr bool kInPlace = std::is_same_v<U, vnni::Q8_0>;
  constexpr int kHalves = U::kHalves ? 2 : 1;
  const TileConfig config(32 / kHalves);
  _tile_loadconfig(&config);
  alignas(64) int32_t first[kTile * kTile], second[kTile * kTile];
  alignas(64) float out[kTile * kTile];
  Panel panel(kInPlace ? 0 : subs);  // (Q8_0's bytes and scales are read in place)
  float scales[kTile];
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = w + g * kTile * row_bytes;
    if constexpr (!kInPlace) unpack_group<U>(group, row_bytes, subs, panel);
    for (int64_t t = 0; t < row_tiles; ++t) {
      __m512 acc[kTile];
      for (auto& v : acc) v = _mm512_setzero_ps();
      for (int64_t k = 0; k < subs; ++k) {
        const int64_t tk = t * subs + k;
        const __m512 dx = _mm512_loadu_ps(x.d.data() + tk * kTile);
        for (int h = 0; h < kHalves; ++h) {
          const int8_t* b = x.tiles.data() + 2 * tk * kPlaneTile + 256 * h;
          const float* s = scales;
          if constexpr (kInPlace) {
            const uint8_t* block = group + k * U::kBytes;
            _tile_loadd(0, block + 2, row_bytes);
            for (int64_t m = 0; m < kTile; ++m) {
              scales[m] = vnni::half_of(block + m * row_bytes);
            }
          } else {
            _tile_loadd(0, panel.q.data() + k * kTile * 32 + 16 * h, 32);
            s = panel.s.data() + (2 * k + h) * kTile;
          }
          _tile_loadd(1, b, 64);
          _tile_loadd(2, b + kPlaneTile, 64);
          _tile_zero(3);
          _tile_zero(4);
          _tile_dpbssd(3, 0, 1);
          _tile_dpbssd(4, 0, 2);
          _tile_stored(3, first, 64);
          _tile_stored(4, second, 64);
          for (int64_t m = 0; m < kTile; ++m) {
            const __m512i sum = _mm512_add_epi32(
                _mm512_mullo_epi32(_mm512_load_si512(first + kTile * m),
                                   _mm512_set1_epi32(254)),
                _mm512_load_si512(second + kTile * m));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                     _mm512_mul_ps(dx, _mm512_set1_ps(s[m])), acc[m]);
          }
          if constexpr (!kInPlace) {  // the offsets' part: o[m] d S (Q8_0 has none)
            const float* o = panel.o.data() + (2 * k + h) * kTile;
            const float* offsets = x.offsets.data() + 2 * tk * kTile;
            const __m512 dsum = kHalves == 2
                ? _mm512_loadu_ps(offsets + h * kTile)
                : _mm512_add_ps(_mm512_loadu_ps(offsets), _mm512_loadu_ps(offsets + kTile));
            for (int64_t m = 0; m < kTile; ++m) {
              acc[m] = _mm512_fmadd_ps(dsum, _mm512_set1_ps(o[m]), acc[m]);
            }
          }
        }
      }
      for (int64_t m = 0; m < kTile; ++m) _mm512_store_ps(out + kTile * m, acc[m]);
      for (int64_t n = 0; n < kTile && t * kTile + n < rows; ++n) {
        float* yr = y + (t * kTile + n) * out_features + g * kTile;
        for (int64_t m = 0; m < kTile; ++m) {
          yr[m] = out[kTile * m + n] + (bias != nullptr ? bias[g * kTile + m] : 0.f);
        }
      }
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
#endif

at::Tensor amx_product(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                       const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "file_blocks_amx_gemm";
  TORCH_CHECK(kind >= 0 && kind < pagedserve::blocks::kNumTypes, op,
              ": kind 0..6 (Q4_K, Q5_K, Q6_K, Q4_0, Q5_0, Q5_1, Q8_0)");
  const Type type = static_cast<Type>(kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be float32 [n, in] with contiguous columns");
  check_blocks_and_bias(x, blocks, bias, type, op, 16);
#if defined(PAGEDSERVE_AMX)
  const int64_t out_features = blocks.size(0);
  TORCH_CHECK(amx_granted(), op, ": this host has no AMX int8 tiles granted "
              "(torch.ops.pagedserve.amx_int8_granted())");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  const Activations a = quantize(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1));
  const PackedX packed = pack_x(a, (x.size(0) + kTile - 1) / kTile);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, out_features / kTile, 4, [&](int64_t begin, int64_t end) {
    amx::groups(type, w, blocks.size(1), packed, a.subs, a.rows, b, out, out_features, begin,
                end);
  });
  return y;
#else
  TORCH_CHECK(false, op, ": needs a build for x86-64 with AVX2");
#endif
}

}  // namespace

namespace pagedserve {

// x [n <= 8, in] float32, blocks [out, in / 256 * 144] uint8 (Q4_K as the file has them):
// [n, out] float32. The other types' ops alike, on their own blocks.
at::Tensor q4_k_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  return int8_product(x, blocks, bias, Type::q4_k, "q4_k_int8_matvec");
}

at::Tensor q5_k_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  return int8_product(x, blocks, bias, Type::q5_k, "q5_k_int8_matvec");
}

at::Tensor q6_k_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  return int8_product(x, blocks, bias, Type::q6_k, "q6_k_int8_matvec");
}

at::Tensor q4_0_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  return int8_product(x, blocks, bias, Type::q4_0, "q4_0_int8_matvec");
}

at::Tensor q5_0_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  return int8_product(x, blocks, bias, Type::q5_0, "q5_0_int8_matvec");
}

at::Tensor q5_1_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias) {
  return int8_product(x, blocks, bias, Type::q5_1, "q5_1_int8_matvec");
}

at::Tensor q8_0_file_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                                 const std::optional<at::Tensor>& bias) {
  return int8_product(x, blocks, bias, Type::q8_0, "q8_0_file_int8_matvec");
}

// Which code the ops above run on this host: "avx512_vnni", "avx2" or "none" (refused).
std::string file_blocks_int8_isa() {
#if defined(PAGEDSERVE_FILE_INT8)
  return has_vnni() ? "avx512_vnni" : "avx2";
#else
  return "none";
#endif
}

}  // namespace pagedserve

namespace pagedserve {

// x [n, in] float32 (any n), blocks of `kind` (block_formats.h's Type) as the matvecs above
// take them, out a multiple of 16: [n, out] float32, on AMX's int8 tiles (the matvecs' two
// planes of x). Refused where amx_int8_granted() is false.
at::Tensor file_blocks_amx_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                const std::optional<at::Tensor>& bias) {
  return amx_product(x, blocks, kind, bias);
}

// Whether this host has AMX's int8 tiles and the kernel granted this process their state.
bool amx_int8_granted() {
#if defined(PAGEDSERVE_AMX)
  return amx_granted();
#else
  return false;
#endif
}

}  // namespace pagedserve
