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

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

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

Activations quantize(const float* x, int64_t stride, int64_t rows, int64_t width) {
  const int64_t subs = width / 32;
  Activations a{std::vector<int8_t>(2 * rows * width), std::vector<float>(rows * subs),
                std::vector<float>(2 * rows * subs), rows, width, subs};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < subs; ++k) {
      const float* v = x + r * stride + 32 * k;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(v[i]));
      const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
      // the residual in double: v - d q0 exactly, then in the second plane's units
      const double to_second = d > 0.f ? kPlaneStep / static_cast<double>(d) : 0.;
      int8_t* q0 = a.q.data() + r * width + 32 * k;
      int8_t* q1 = a.q.data() + (rows + r) * width + 32 * k;
      int32_t sums[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const float first = std::clamp(std::nearbyint(v[i] * inverse), -127.f, 127.f);
        const double residual = static_cast<double>(v[i]) - static_cast<double>(d) * first;
        q0[i] = static_cast<int8_t>(first);
        q1[i] = static_cast<int8_t>(std::clamp(std::nearbyint(residual * to_second), -127., 127.));
        sums[i / 16] += 254 * q0[i] + q1[i];
      }
      a.d[r * subs + k] = d / kPlaneStep;
      a.sums[2 * (r * subs + k)] = static_cast<float>(sums[0]);
      a.sums[2 * (r * subs + k) + 1] = static_cast<float>(sums[1]);
    }
  }
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

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& blocks,
                        const std::optional<at::Tensor>& bias, Type type, const char* op) {
#if defined(PAGEDSERVE_FILE_INT8)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(0) <= kMaxRows,
              op, ": x must be float32 [n <= 8, in] with contiguous columns");
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
                    blocks.size(1) == x.size(1) / F::kWeights * F::kBytes,
                op, ": blocks must be contiguous uint8 [out, in / ", F::kWeights, " * ",
                F::kBytes, "] (in a multiple of ", F::kWeights, ")");
  });
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
