// The int8 projection's larger batches (cpu_linear.Int8Linear) on AMX's int8 tiles, as a
// torch op (torch.ops.pagedserve.int8_amx_gemm), where the host has the tiles and the
// kernel grants them (amx_int8_granted): W8A8, each weight row on its own int8 grid (the
// same rotated int8 values fbgemm's GEMM reads elsewhere), each row of x on its own.
//
// Each row of x is turned by the block-diagonal Hadamard rotation and scaled to a largest
// magnitude of 1 (hadamard_row, as hadamard_rows), then rounded to int8 on the grid 1 / 127:
//   y[r][o] = (amax_r / 127) * s_o * sum_k qx[r][k] qw[o][k] + bias[o]
// the byte products summed exactly in int32 over the whole row, then one float32 scaling.
// fbgemm's dynamic GEMM instead puts a whole call on one 7-bit grid from its minimum and
// maximum (its AVX2 pair sums would saturate on 8): here each row has all 8 bits, and the
// tiles' sums cannot saturate.
//
// The tiles: A, 16 rows of x by 64 of their bytes (x quantized row-major, rows padded to 16
// with zeros); B, 16 weight rows by the same 64 columns, packed once at load as the tile
// reads them (int8_amx_pack: [out / 16, in / 64, 16, 16, 4], B[kk][4 n + j] = w[n][4 kk +
// j]), so that a group's weights stream in 1 KB tiles one after another; C, their int32
// sums, [x row][weight row]: y's rows as they are stored. Up to two tiles of x and two
// groups of weight rows a pass (four sums, each A and B used twice); the next groups'
// bytes fetched meanwhile.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#define PAGEDSERVE_INT8_AMX 1
#endif

namespace {

constexpr int64_t kTile = 16;    // rows of x, and weight rows, of one tile
constexpr int64_t kDepth = 64;   // bytes of a row one tile product reads
constexpr int64_t kTileBytes = kTile * kDepth;

void check_weight(const at::Tensor& tiles, const at::Tensor& scales, int64_t in_features,
                  const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(tiles.dim() == 5 && tiles.scalar_type() == at::kChar && tiles.is_contiguous() &&
                  tiles.size(1) * kDepth == in_features && tiles.size(2) == kTile &&
                  tiles.size(3) == kTile && tiles.size(4) == 4,
              op, ": weight must be int8 tiles [out / 16, in / 64, 16, 16, 4] (int8_amx_pack)");
  const int64_t out_features = tiles.size(0) * kTile;
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == out_features &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              op, ": weight_scales must be float32 [out]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == out_features &&
                                    bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              op, ": bias must be float32 [out]");
}

#if defined(PAGEDSERVE_INT8_AMX)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-int8")

// tmm0, tmm1: A (x tiles 0, 1); tmm2, tmm3: B (weight groups 0, 1); tmm4..7: C [x][group].
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// y's rows [16 t, 16 t + 16) (those < rows), columns [16 g, 16 g + 16), from the sums.
inline void put_sums(const int32_t* sums, const float* x_scales, const float* w_scales,
                     const float* bias, float* y, int64_t rows, int64_t out_features,
                     int64_t t, int64_t g) {
  const __m512 ws = _mm512_loadu_ps(w_scales + g * kTile);
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + g * kTile) : _mm512_setzero_ps();
  for (int64_t r = 0; r < kTile && t * kTile + r < rows; ++r) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + kTile * r));
    const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(x_scales[t * kTile + r]));
    _mm512_storeu_ps(y + (t * kTile + r) * out_features + g * kTile,
                     _mm512_fmadd_ps(sum, scale, b));
  }
}

// X tiles of x from t, G groups of weight rows from g: the X x G sums over the whole depth.
template <int X, int G>
void tile_pass(const int8_t* qx, int64_t in_features, const int8_t* tiles, int64_t depth,
               int64_t t, int64_t g, int32_t (*sums)[kTile * kTile]) {
  _tile_zero(4);
  if constexpr (G == 2) _tile_zero(5);
  if constexpr (X == 2) _tile_zero(6);
  if constexpr (X == 2 && G == 2) _tile_zero(7);
  const int8_t* a = qx + t * kTile * in_features;
  const int8_t* b = tiles + g * depth * kTileBytes;
  for (int64_t c = 0; c < depth; ++c) {
    _tile_loadd(2, b + c * kTileBytes, 64);
    if constexpr (G == 2) _tile_loadd(3, b + (depth + c) * kTileBytes, 64);
    _tile_loadd(0, a + c * kDepth, in_features);
    if constexpr (X == 2) _tile_loadd(1, a + kTile * in_features + c * kDepth, in_features);
    _tile_dpbssd(4, 0, 2);
    if constexpr (G == 2) _tile_dpbssd(5, 0, 3);
    if constexpr (X == 2) _tile_dpbssd(6, 1, 2);
    if constexpr (X == 2 && G == 2) _tile_dpbssd(7, 1, 3);
  }
  _tile_stored(4, sums[0], 64);
  if constexpr (G == 2) _tile_stored(5, sums[1], 64);
  if constexpr (X == 2) _tile_stored(6, sums[2], 64);
  if constexpr (X == 2 && G == 2) _tile_stored(7, sums[3], 64);
}

// Weight groups [g0, g1) against every tile of x, two groups and two tiles a pass where
// there are two; the next pair of groups' bytes fetched while the first tile of x passes.
void gemm_groups(const int8_t* qx, const float* x_scales, int64_t rows, int64_t in_features,
                 const int8_t* tiles, const float* w_scales, const float* bias, float* y,
                 int64_t out_features, int64_t g0, int64_t g1) {
  const TileConfig config;
  _tile_loadconfig(&config);
  alignas(64) int32_t sums[4][kTile * kTile];
  const int64_t depth = in_features / kDepth, row_tiles = (rows + kTile - 1) / kTile;
  const int64_t group_bytes = depth * kTileBytes;
  for (int64_t g = g0; g < g1; g += 2) {
    const bool pair = g + 1 < g1;
    if (g + 2 < g1) {
      const int8_t* next = tiles + (g + 2) * group_bytes;
      const int64_t ahead = std::min<int64_t>(2, g1 - g - 2) * group_bytes;
      for (int64_t i = 0; i < ahead; i += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
      }
    }
    for (int64_t t = 0; t < row_tiles; t += 2) {
      const bool two = t + 1 < row_tiles;
      if (two && pair) {
        tile_pass<2, 2>(qx, in_features, tiles, depth, t, g, sums);
      } else if (two) {
        tile_pass<2, 1>(qx, in_features, tiles, depth, t, g, sums);
      } else if (pair) {
        tile_pass<1, 2>(qx, in_features, tiles, depth, t, g, sums);
      } else {
        tile_pass<1, 1>(qx, in_features, tiles, depth, t, g, sums);
      }
      put_sums(sums[0], x_scales, w_scales, bias, y, rows, out_features, t, g);
      if (pair) put_sums(sums[1], x_scales, w_scales, bias, y, rows, out_features, t, g + 1);
      if (two) put_sums(sums[2], x_scales, w_scales, bias, y, rows, out_features, t + 1, g);
      if (two && pair) {
        put_sums(sums[3], x_scales, w_scales, bias, y, rows, out_features, t + 1, g + 1);
      }
    }
  }
  _tile_release();
}

#pragma GCC pop_options
#endif

}  // namespace

namespace pagedserve {

// An int8 weight [out, in] (out a multiple of 16, in of 64) as int8_amx_gemm's B tiles.
at::Tensor int8_amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar &&
                  weight.size(0) % kTile == 0 && weight.size(1) % kDepth == 0,
              "int8_amx_pack: weight must be int8 [out, in], out a multiple of 16, in of 64");
  const int64_t out = weight.size(0), in = weight.size(1);
  return weight.reshape({out / kTile, kTile, in / kDepth, kTile, 4})
      .permute({0, 2, 3, 1, 4})
      .contiguous();
}

at::Tensor int8_amx_gemm(const at::Tensor& x, int64_t block, const at::Tensor& weight,
                         const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "int8_amx_gemm";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be float32 [n, in] with contiguous columns");
  const int64_t rows = x.size(0), in_features = x.size(1);
  check_weight(weight, weight_scales, in_features, bias, op);
  TORCH_CHECK(block >= 8 && block <= 1024 && (block & (block - 1)) == 0 &&
                  in_features % block == 0,
              op, ": block must be a power of two from 8 dividing the width");
  const int64_t out_features = weight.size(0) * kTile;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
#if defined(PAGEDSERVE_INT8_AMX)
  TORCH_CHECK(amx_int8_granted(), op, ": this host has no AMX int8 tiles granted "
              "(torch.ops.pagedserve.amx_int8_granted())");
  const int64_t padded = (rows + kTile - 1) / kTile * kTile;
  at::Tensor qx = at::empty({padded, in_features}, x.options().dtype(at::kChar));
  std::memset(qx.data_ptr<int8_t>() + rows * in_features, 0, (padded - rows) * in_features);
  at::Tensor x_scales = at::empty({rows}, x.options());
  const float* in = x.data_ptr<float>();
  int8_t* q = qx.data_ptr<int8_t>();
  float* scales = x_scales.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> turned(in_features);
    for (int64_t r = begin; r < end; ++r) {
      scales[r] = hadamard_row(in + r * x.stride(0), turned.data(), in_features, block) / 127.f;
      for (int64_t i = 0; i < in_features; ++i) {
        q[r * in_features + i] = static_cast<int8_t>(std::nearbyint(turned[i] * 127.f));
      }
    }
  });
  const int8_t* tiles = weight.data_ptr<int8_t>();
  const float* w_scales = weight_scales.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, out_features / kTile, 2, [&](int64_t begin, int64_t end) {
    gemm_groups(q, scales, rows, in_features, tiles, w_scales, b, out, out_features, begin,
                end);
  });
  return y;
#else
  TORCH_CHECK(false, op, ": needs a build for x86-64 with AVX2");
#endif
}

}  // namespace pagedserve
