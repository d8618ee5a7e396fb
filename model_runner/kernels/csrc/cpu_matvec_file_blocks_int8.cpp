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
// them and the kernel grants them (amx_int8_granted; file_blocks_amx_tiles.h): 16 weight
// rows unpacked once into bytes (the row kernels' unpacking; Q8_0's read in place), then
// per sub-block (a half, for Q6_K's scale per 16) one tile product per plane of x for
// every 16 rows of x, the int32 sums scaled in float32 as above; the same arithmetic as
// the matvecs' two planes. At 16 rows the time is the tiles' round trip, not their
// products: each sub-block's 16 x 16 sums stored and combined in float32 (its scales are
// its own), so sub-block k+1's products are issued, into the other of two sets of tiles,
// before k's are combined; then the weights' reading (Q8_0's tile loads, the others'
// unpacking) and x's quantizing, vectorized and split over the threads.
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
constexpr int64_t kQuantizeGrain = 4;  // rows of x a thread quantizes at least (AMX batches)

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

#if defined(__AVX2__) && defined(__GNUC__)
#define PAGEDSERVE_FILE_INT8 1

// Eight int32 lanes as bytes: a[0..3] in bytes 0..7 .. a[3] in bytes 24..31, in order.
inline __m256i bytes_of(const __m256i (&a)[4]) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]),
                                            _mm256_packs_epi32(a[2], a[3]));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline int32_t sum_int_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// Row r of x (stride apart) into a's planes, scales and halves' sums, eight values a
// vector: the same IEEE steps as a value at a time (d times q0 is exact in double, so the
// residual is too; both roundings to nearest even).
void quantize_row(const float* x, int64_t stride, int64_t r, Activations& a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t k = 0; k < a.subs; ++k) {
    const float* v = x + r * stride + 32 * k;
    __m256 values[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      values[i] = _mm256_loadu_ps(v + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(values[i], magnitude));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float d = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.f;
    const __m256 inverse = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    // the residual in double: v - d q0 exactly, then in the second plane's units
    const __m256d to_second =
        _mm256_set1_pd(d > 0.f ? kPlaneStep / static_cast<double>(d) : 0.);
    const __m256d dd = _mm256_set1_pd(d);
    __m256i first[4], second[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 q0 = _mm256_min_ps(
          _mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(values[i], inverse), kNearest),
                        _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
      __m128i q1[2];
      for (int h = 0; h < 2; ++h) {
        const __m256d value = _mm256_cvtps_pd(h ? _mm256_extractf128_ps(values[i], 1)
                                                : _mm256_castps256_ps128(values[i]));
        const __m256d step = _mm256_cvtps_pd(h ? _mm256_extractf128_ps(q0, 1)
                                               : _mm256_castps256_ps128(q0));
        const __m256d residual = _mm256_sub_pd(value, _mm256_mul_pd(dd, step));
        const __m256d rounded = _mm256_round_pd(_mm256_mul_pd(residual, to_second), kNearest);
        q1[h] = _mm256_cvtpd_epi32(_mm256_min_pd(
            _mm256_max_pd(rounded, _mm256_set1_pd(-127.)), _mm256_set1_pd(127.)));
      }
      first[i] = _mm256_cvtps_epi32(q0);
      second[i] = _mm256_set_m128i(q1[1], q1[0]);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + r * a.width + 32 * k),
                        bytes_of(first));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(a.q.data() + (a.rows + r) * a.width + 32 * k),
        bytes_of(second));
    const __m256i both = _mm256_set1_epi32(254);
    for (int h = 0; h < 2; ++h) {
      const __m256i sum = _mm256_add_epi32(
          _mm256_mullo_epi32(_mm256_add_epi32(first[2 * h], first[2 * h + 1]), both),
          _mm256_add_epi32(second[2 * h], second[2 * h + 1]));
      a.sums[2 * (r * a.subs + k) + h] = static_cast<float>(sum_int_lanes(sum));
    }
    a.d[r * a.subs + k] = d / kPlaneStep;
  }
}

// x's rows in planes, `grain` rows at least a thread.
Activations quantize(const float* x, int64_t stride, int64_t rows, int64_t width,
                     int64_t grain) {
  const int64_t subs = width / 32;
  Activations a{std::vector<int8_t>(2 * rows * width), std::vector<float>(rows * subs),
                std::vector<float>(2 * rows * subs), rows, width, subs};
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x, stride, r, a);
  });
  return a;
}


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
  const Activations a = quantize(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1),
                                  kGrain);
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

#include "file_blocks_amx_tiles.h"
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
  const Activations a = quantize(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1),
                                  kQuantizeGrain);
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
