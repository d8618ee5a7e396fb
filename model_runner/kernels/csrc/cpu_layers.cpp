// The elementwise parts of a Llama layer for a float32 model on the CPU, fused into one
// pass each, as torch ops (torch.ops.pagedserve.*): torch runs each of them as several
// ops, every one a dispatch and a pass over memory, which at decode batch sizes costs
// more than the arithmetic. model_runner/models/llama.py calls them when the model runs
// on the CPU in float32 (see model_runner/kernels/cpu_kernels.py); its torch code is the
// reference.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_ops.h"
#include "vec8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using pagedserve::exp8;
using pagedserve::Int32x8;
using pagedserve::load8;
using pagedserve::sum8;
using pagedserve::Vec8;

inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              name, ": float32 rows [n, width] with contiguous columns");
  TORCH_CHECK(x.size(1) % 8 == 0, name, ": width must be a multiple of 8");
}

// v (n values, n a power of two from 8) times Sylvester's unnormalised n x n Hadamard
// matrix, in place: log2(n) rounds of butterflies (v[j], v[j + h]) -> (a + b, a - b). The
// rounds within eight values turn each vector with a shuffle (lane i takes lane i ^ h and
// adds its own value, negated where bit h of i is set: a + b and a - b, to the bit as one
// at a time); the wider ones pair whole vectors.
inline void walsh_hadamard_(float* v, int64_t n) {
  const Int32x8 swap1 = {1, 0, 3, 2, 5, 4, 7, 6}, swap2 = {2, 3, 0, 1, 6, 7, 4, 5},
                swap4 = {4, 5, 6, 7, 0, 1, 2, 3};
  const Vec8 sign1 = {1, -1, 1, -1, 1, -1, 1, -1}, sign2 = {1, 1, -1, -1, 1, 1, -1, -1},
             sign4 = {1, 1, 1, 1, -1, -1, -1, -1};
  for (int64_t i = 0; i < n; i += 8) {
    Vec8 a = load8(v + i);
    a = __builtin_shuffle(a, swap1) + a * sign1;
    a = __builtin_shuffle(a, swap2) + a * sign2;
    a = __builtin_shuffle(a, swap4) + a * sign4;
    store8(v + i, a);
  }
  for (int64_t h = 8; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += 8) {
        const Vec8 a = load8(v + j), b = load8(v + j + h);
        store8(v + j, a + b);
        store8(v + j + h, a - b);
      }
    }
  }
}

}  // namespace

namespace pagedserve {

// weight * x / sqrt(mean(x^2) + eps) per row, as Hugging Face's LlamaRMSNorm in float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "rms_norm: weight must be float32 [width]");
  const int64_t rows = x.size(0), width = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * stride;
      Vec8 squares = {};
      for (int64_t i = 0; i < width; i += 8) {
        const Vec8 v = load8(row + i);
        squares += v * v;
      }
      const float inv_rms =
          1.f / std::sqrt(sum8(squares) / static_cast<float>(width) + static_cast<float>(eps));
      for (int64_t i = 0; i < width; i += 8) {
        store8(o + r * width + i, load8(w + i) * (load8(row + i) * inv_rms));
      }
    }
  });
  return out;
}

// Rotates, in place, the first num_heads heads of head_dim columns of every row of x
// (the query and key heads at the front of a fused qkv projection) by the row's angle:
// halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), Hugging Face's layout.
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
           int64_t head_dim) {
  check_rows(x, "rope_");
  TORCH_CHECK(head_dim % 16 == 0 && num_heads * head_dim <= x.size(1),
              "rope_: head_dim must be a multiple of 16 and the heads fit in a row");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == head_dim / 2 && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rope_: cos and sin must be float32 [n, head_dim / 2]");
  const int64_t rows = x.size(0), stride = x.stride(0), half = head_dim / 2;
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_cos = c + r * cos_stride;
      const float* row_sin = s + r * sin_stride;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* head = data + r * stride + h * head_dim;
        for (int64_t i = 0; i < half; i += 8) {
          const Vec8 x1 = load8(head + i), x2 = load8(head + half + i);
          const Vec8 cs = load8(row_cos + i), sn = load8(row_sin + i);
          store8(head + i, x1 * cs - x2 * sn);
          store8(head + half + i, x2 * cs + x1 * sn);
        }
      }
    }
  });
}

// rope_ with each query head normed by q_weight and each key head by k_weight first (Qwen3's
// and Gemma 3's per-head q/k norm, one eps for both): a head's values become
// weight * x / sqrt(mean(x^2) + eps), rms_norm's arithmetic on a row of head_dim, then
// rotated as rope_ rotates them. num_heads query heads, then num_kv_heads key heads.
void qk_norm_rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   const at::Tensor& q_weight, const at::Tensor& k_weight, double eps) {
  for (const at::Tensor* weight : {&q_weight, &k_weight}) {
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == head_dim &&
                    weight->scalar_type() == at::kFloat && weight->is_contiguous(),
                "qk_norm_rope_: the q and k norm weights must be float32 [head_dim]");
  }
  check_rows(x, "qk_norm_rope_");
  TORCH_CHECK(head_dim % 16 == 0 && (num_heads + num_kv_heads) * head_dim <= x.size(1),
              "qk_norm_rope_: head_dim must be a multiple of 16 and the heads fit in a row");
  const int64_t rows = x.size(0), stride = x.stride(0);
  float* data = x.data_ptr<float>();
  const float* qw = q_weight.data_ptr<float>();
  const float* kw = k_weight.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* head = data + r * stride + h * head_dim;
        const float* w = h < num_heads ? qw : kw;
        Vec8 squares = {};
        for (int64_t i = 0; i < head_dim; i += 8) {
          const Vec8 v = load8(head + i);
          squares += v * v;
        }
        const float inv_rms = 1.f / std::sqrt(sum8(squares) / static_cast<float>(head_dim) +
                                              static_cast<float>(eps));
        for (int64_t i = 0; i < head_dim; i += 8) {
          store8(head + i, load8(w + i) * (load8(head + i) * inv_rms));
        }
      }
    }
  });
  rope_(x, cos, sin, num_heads + num_kv_heads, head_dim);
}

namespace {

// act(gate) * up for x = [gate | up] of width 2 * I: out [n, I], act(g) * u computed by
// `gated` on eight lanes at a time.
template <typename Gated>
at::Tensor gated_and_mul(const at::Tensor& x, const char* name, Gated gated) {
  check_rows(x, name);
  TORCH_CHECK(x.size(1) % 16 == 0, name, ": width must be a multiple of 16");
  const int64_t rows = x.size(0), half = x.size(1) / 2, stride = x.stride(0);
  at::Tensor out = at::empty({rows, half}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * stride;
      const float* up = gate + half;
      for (int64_t i = 0; i < half; i += 8) {
        store8(o + r * half + i, gated(load8(gate + i), load8(up + i)));
      }
    }
  });
  return out;
}

}  // namespace

// silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& x) {
  return gated_and_mul(x, "silu_and_mul",
                       [](Vec8 g, Vec8 u) { return g / (1.f + exp8(-g)) * u; });
}

// gelu(gate) * up, gelu in its tanh form (Gemma's gelu_pytorch_tanh) written as
// 0.5 g (1 + tanh(v)) = g / (1 + e^(-2v)), v = sqrt(2 / pi) (g + 0.044715 g^3).
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  constexpr float kTwoSqrtTwoOverPi = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  return gated_and_mul(x, "gelu_tanh_and_mul", [](Vec8 g, Vec8 u) {
    const Vec8 two_v = kTwoSqrtTwoOverPi * (g + 0.044715f * g * g * g);
    return g / (1.f + exp8(-two_v)) * u;
  });
}

// One row of `width` values turned by the block-diagonal orthonormal Hadamard matrix
// (blocks of `block`, a power of two; Sylvester's order, as cpu_linear.hadamard builds it)
// with an in-place fast Walsh-Hadamard transform, then divided by its largest magnitude,
// into `out`. Returns that magnitude (at least 1e-12, so a zero row stays zero).
float hadamard_row(const float* in, float* out, int64_t width, int64_t block) {
  const float norm = 1.f / std::sqrt(static_cast<float>(block));
  std::memcpy(out, in, width * sizeof(float));
  for (int64_t start = 0; start < width; start += block) walsh_hadamard_(out + start, block);
  Vec8 peak{};
  for (int64_t i = 0; i < width; i += 8) {
    const Vec8 a = load8(out + i);
    const Vec8 mag = a < 0 ? -a : a;
    peak = mag > peak ? mag : peak;
  }
  float row_max = 0.f;
  for (int j = 0; j < 8; ++j) row_max = std::max(row_max, peak[j]);
  row_max = std::max(row_max * norm, 1e-12f);
  const float scale = norm / row_max;
  for (int64_t i = 0; i < width; i += 8) store8(out + i, load8(out + i) * scale);
  return row_max;
}

// Each row of x as hadamard_row turns it: the int8 linear's input (cpu_linear.Int8Linear).
// Returns the scaled rows and each row's largest magnitude [n, 1].
std::tuple<at::Tensor, at::Tensor> hadamard_rows(const at::Tensor& x, int64_t block) {
  check_rows(x, "hadamard_rows");
  TORCH_CHECK(block >= 8 && block <= 1024 && (block & (block - 1)) == 0 &&
                  x.size(1) % block == 0,
              "hadamard_rows: block must be a power of two from 8 dividing the width");
  const int64_t rows = x.size(0), width = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, width}, x.options());
  at::Tensor amax = at::empty({rows, 1}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* row_maxes = amax.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row_maxes[r] = hadamard_row(in + r * stride, o + r * width, width, block);
    }
  });
  return {out, amax};
}

}  // namespace pagedserve
