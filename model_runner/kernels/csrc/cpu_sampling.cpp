// Greedy sampling's argmax on the CPU, as a torch op (torch.ops.pagedserve.greedy_ids): each
// row's first index of its largest value, as torch.argmax gives it (a NaN counts as the
// largest, its first one wins). torch's reduction over a row runs it on one thread, scalar:
// 16 rows of a 262k-token vocabulary took 2.4 ms, a Gemma 3 step's 8%.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_ops.h"
#include "vec8.h"

#include <cmath>
#include <cstdint>

namespace {

using pagedserve::Int32x8;
using pagedserve::load8;
using pagedserve::Vec8;

// The first index of the row's largest value (its first NaN, if any).
int64_t row_argmax(const float* row, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  int64_t at = 0;
  if (n >= 8) {
    // per lane: the largest value and its first index (a strict > keeps the first)
    Vec8 top = load8(row);
    Int32x8 where = {0, 1, 2, 3, 4, 5, 6, 7};
    Int32x8 index = where;
    Vec8 nan{};  // lanes that saw a NaN
    for (i = 8; i + 8 <= n; i += 8) {
      index += 8;
      const Vec8 v = load8(row + i);
      const Int32x8 greater = v > top;
      top = greater ? v : top;
      where = greater ? index : where;
      nan += (v != v) ? Vec8{} + 1.f : Vec8{};
    }
    bool any_nan = false;
    for (int lane = 0; lane < 8; ++lane) any_nan |= nan[lane] != 0.f || top[lane] != top[lane];
    if (any_nan) {
      for (int64_t j = 0; j < n; ++j) {
        if (std::isnan(row[j])) return j;
      }
    }
    best = top[0];
    at = where[0];
    for (int lane = 1; lane < 8; ++lane) {
      if (top[lane] > best || (top[lane] == best && where[lane] < at)) {
        best = top[lane];
        at = where[lane];
      }
    }
  }
  for (; i < n; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > best) {
      best = row[i];
      at = i;
    }
  }
  return at;
}

}  // namespace

namespace pagedserve {

at::Tensor greedy_ids(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "greedy_ids: logits must be float32 [n, vocab] with contiguous columns");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* data = logits.data_ptr<float>();
  int64_t* out = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(data + r * stride, n);
  });
  return ids;
}

}  // namespace pagedserve
