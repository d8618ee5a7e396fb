// Paged decode attention (a decode row, or a short chunk's rows, per sequence; sliding window,
// soft cap, sinks) and KV-cache writes for the CPU, as torch ops
// (torch.ops.pagedserve.*). Keys and values are read once, straight from their blocks:
// the torch reference (model_runner/attention/torch_backend.py) gathers them into
// contiguous buffers first, which moves every byte three times.
// model_runner/kernels/cpu_kernels.py builds this file.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include "cpu_ops.h"
#include "vec8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using pagedserve::exp8;
using pagedserve::load8;
using pagedserve::sum8;
using pagedserve::Vec8;

// q . k for K keys `stride` apart, over R registers, each summed as a tree (a chain of R
// dependent FMAs would stall); each of q's registers read once for the K (a head of 256
// spills q from the registers: a key apiece read it K times as often).
template <int K, typename T>
inline void dots(const Vec8* q, const T* k, int64_t stride, int R, float* out) {
  Vec8 part[K][4] = {};
  for (int r = 0; r < R; ++r) {
    const Vec8 qr = q[r];
    for (int j = 0; j < K; ++j) part[j][r % 4] += qr * load8(k + j * stride + r * 8);
  }
  for (int j = 0; j < K; ++j) {
    out[j] = sum8((part[j][0] + part[j][1]) + (part[j][2] + part[j][3]));
  }
}

constexpr int MAX_HEAD_DIM = 256;
constexpr int32_t kSplitContext = 256;  // keys from which one sequence's heads are split

// Blocks are scattered, so the hardware prefetcher misses the jump to the next one.
inline void prefetch(const char* p, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

// One sequence's `rows` query rows, in one pass over its blocks (online softmax): a decode's
// one row, or a short chunk's rows, row j of which sees the first len - rows + 1 + j keys
// (causal). For each kv head, each row and each query head of its group, the block's keys
// are scored, the running maximum, sum and output rescaled when the maximum grows, and the
// block's values added. A block's keys and values are read from memory once for all the
// rows and heads of a kv head (they stay in cache between them); the query and the output
// row stay in registers (D / 8 vector registers a row; STATIC_D makes the common head dims
// compile-time constants, 0 takes head_dim at run time). Float32 throughout. With a
// sliding window (window > 0) a row reads only its last `window` keys; softcap > 0 caps
// each score at softcap * tanh(score / softcap); sinks (one logit per query head, or null)
// join each head's denominator at the end. Rows are [rows, num_heads, D] in q_in and out.
// The caller's per-thread scratch: scores (a block, padded to 8), acc (rows * num_heads
// rows), max and sum (rows * num_heads).
template <int STATIC_D, typename Q, typename T>
void attend_rows(int head_dim, const Q* q_in, const T* k_all, const T* v_all,
                 const int32_t* table, int64_t len, int64_t rows, int64_t num_heads,
                 int64_t num_kv_heads, int64_t kv_begin, int64_t kv_end, int64_t block_size,
                 int64_t block_stride, float scale, int64_t window, float softcap,
                 const float* sinks, float* scores, Vec8* acc, float* max, float* sum,
                 Q* out) {
  const int D = STATIC_D ? STATIC_D : head_dim;
  const int R = D / 8;  // vector registers per row
  constexpr int MAX_R = STATIC_D ? STATIC_D / 8 : MAX_HEAD_DIM / 8;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const int64_t first_len = len - rows + 1;  // row 0's keys
  auto start_of = [&](int64_t row_len) {  // a row's first key
    return window > 0 ? std::max<int64_t>(0, row_len - window) : int64_t{0};
  };
  const int64_t token_stride = num_kv_heads * D;
  const int64_t head_begin = kv_begin * group, head_end = kv_end * group;
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t at = j * num_heads;
    std::fill(max + at + head_begin, max + at + head_end, -std::numeric_limits<float>::max());
    std::fill(sum + at + head_begin, sum + at + head_end, 0.f);
    std::fill(acc + (at + head_begin) * R, acc + (at + head_end) * R, Vec8{});
  }
  for (int64_t b = start_of(first_len) / block_size; b < num_blocks; ++b) {
    const int64_t next = table[std::min(b + 1, num_blocks - 1)] * block_stride;
    for (int64_t kv = kv_begin; kv < kv_end; ++kv) {
      const T* keys = k_all + table[b] * block_stride + kv * D;
      const T* values = v_all + table[b] * block_stride + kv * D;
      for (int64_t i = 0; i < block_size; ++i) {
        prefetch(reinterpret_cast<const char*>(k_all + next + i * token_stride + kv * D),
                 D * sizeof(T));
        prefetch(reinterpret_cast<const char*>(v_all + next + i * token_stride + kv * D),
                 D * sizeof(T));
      }
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t row_len = first_len + j;
        const int64_t lo = std::max<int64_t>(0, start_of(row_len) - b * block_size);
        const int64_t n = std::min(block_size, row_len - b * block_size);
        if (n <= lo) continue;  // the block is before the row's window or after its keys
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          const int64_t at = j * num_heads + h;
          Vec8 q[MAX_R];
          for (int r = 0; r < R; ++r) q[r] = load8(q_in + at * D + r * 8) * scale;
          float block_max = max[at];
          int64_t i = lo;
          for (; i + 2 <= n; i += 2) {
            dots<2>(q, keys + i * token_stride, token_stride, R, scores + i);
          }
          if (i < n) dots<1>(q, keys + i * token_stride, token_stride, R, scores + i);
          for (i = lo; i < n; ++i) {
            if (softcap > 0.f) scores[i] = softcap * std::tanh(scores[i] / softcap);
            block_max = std::max(block_max, scores[i]);
          }
          Vec8 out_row[MAX_R];
          const float shrink = block_max > max[at] ? std::exp(max[at] - block_max) : 1.f;
          for (int r = 0; r < R; ++r) out_row[r] = acc[at * R + r] * shrink;
          float block_sum = 0.f;
          for (int64_t i = lo; i < n; i += 8) {
            Vec8 p;
            std::memcpy(&p, scores + i, sizeof(p));
            p = exp8(p - block_max);
            std::memcpy(scores + i, &p, sizeof(p));
          }
          for (int64_t i = lo; i < n; ++i) block_sum += scores[i];
          // the values four keys at a time: each output register read and written once
          // for the four, its sums in the keys' order as one at a time
          int64_t i4 = lo;
          for (; i4 + 4 <= n; i4 += 4) {
            const T* v = values + i4 * token_stride;
            const float s0 = scores[i4], s1 = scores[i4 + 1], s2 = scores[i4 + 2],
                        s3 = scores[i4 + 3];
            for (int r = 0; r < R; ++r) {
              Vec8 o = out_row[r];
              o += s0 * load8(v + r * 8);
              o += s1 * load8(v + token_stride + r * 8);
              o += s2 * load8(v + 2 * token_stride + r * 8);
              o += s3 * load8(v + 3 * token_stride + r * 8);
              out_row[r] = o;
            }
          }
          for (; i4 < n; ++i4) {
            const T* v = values + i4 * token_stride;
            for (int r = 0; r < R; ++r) out_row[r] += scores[i4] * load8(v + r * 8);
          }
          for (int r = 0; r < R; ++r) acc[at * R + r] = out_row[r];
          sum[at] = sum[at] * shrink + block_sum;
          max[at] = block_max;
        }
      }
    }
  }
  for (int64_t j = 0; j < rows; ++j) {
    const bool any = first_len + j > 0;
    for (int64_t h = head_begin; h < head_end; ++h) {
      const int64_t at = j * num_heads + h;
      float inv_sum = any ? 1.f / sum[at] : 0.f;  // no keys: a zero row
      if (sinks != nullptr && any) {
        // the sink's exp joins the sum, on the larger of the two maxima (no overflow)
        const float top = std::max(max[at], sinks[h]);
        const float keep = std::exp(max[at] - top);
        inv_sum = keep / (sum[at] * keep + std::exp(sinks[h] - top));
      }
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < 8; ++i) {
          out[at * D + r * 8 + i] = static_cast<Q>(acc[at * R + r][i] * inv_sum);
        }
      }
    }
  }
}

template <int STATIC_D, typename Q, typename T>
void decode_attention_kernel(const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, const int32_t* query_rows,
                             double scale, int64_t window, double softcap, const float* sinks,
                             at::Tensor& out) {
  const int64_t num_seqs = context_lens.size(0), num_heads = query.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t block_stride = k_cache.stride(0), table_stride = block_tables.stride(0);
  const Q* q_all = query.data_ptr<Q>();
  const T* k_all = k_cache.data_ptr<T>();
  const T* v_all = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  Q* out_all = out.data_ptr<Q>();
  const int D = STATIC_D ? STATIC_D : static_cast<int>(query.size(2));
  // each sequence's first query row, and the most rows one has
  std::vector<int64_t> first_row(num_seqs + 1, 0);
  int64_t most_rows = 1;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t rows = query_rows != nullptr ? query_rows[seq] : 1;
    first_row[seq + 1] = first_row[seq] + rows;
    most_rows = std::max(most_rows, rows);
  }
  // A thread takes a run of (sequence, kv head) pairs, so that fewer sequences than
  // threads with long contexts (an urgent stream's decode) are spread over the threads
  // too; short ones stay whole (a fork costs more than they do: ~11 us at 64 keys, 1.35x
  // faster split at 1024). A head's arithmetic does not depend on how pairs are split.
  const int64_t units = num_seqs * num_kv_heads;
  const int32_t longest = num_seqs > 0 ? *std::max_element(lens, lens + num_seqs) : 0;
  const bool split = num_seqs < at::get_num_threads() && longest >= kSplitContext;
  at::parallel_for(0, units, split ? 1 : num_kv_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block_size + 8), max(most_rows * num_heads),
        sum(most_rows * num_heads);
    std::vector<Vec8> acc(most_rows * num_heads * D / 8);
    for (int64_t unit = begin; unit < end;) {
      const int64_t seq = unit / num_kv_heads, kv_begin = unit % num_kv_heads;
      const int64_t kv_end = std::min(num_kv_heads, kv_begin + (end - unit));
      const int64_t row = first_row[seq];
      attend_rows<STATIC_D>(D, q_all + row * num_heads * D, k_all, v_all,
                            tables + seq * table_stride, lens[seq], first_row[seq + 1] - row,
                            num_heads, num_kv_heads, kv_begin, kv_end, block_size,
                            block_stride, static_cast<float>(scale), window,
                            static_cast<float>(softcap), sinks, scores.data(), acc.data(),
                            max.data(), sum.data(), out_all + row * num_heads * D);
      unit += kv_end - kv_begin;
    }
  });
}

// Head dims 64 and 128 as compile-time constants; any other multiple of 8 at run time.
template <typename Q, typename T>
void decode_attention_typed(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables,
                            const at::Tensor& lens, const int32_t* rows, double scale,
                            int64_t window,
                            double softcap, const float* sinks, at::Tensor& out) {
  switch (q.size(2)) {
    case 64:
      decode_attention_kernel<64, Q, T>(q, k_cache, v_cache, tables, lens, rows, scale, window,
                                        softcap, sinks, out);
      break;
    case 128:
      decode_attention_kernel<128, Q, T>(q, k_cache, v_cache, tables, lens, rows, scale, window,
                                         softcap, sinks, out);
      break;
    default:
      decode_attention_kernel<0, Q, T>(q, k_cache, v_cache, tables, lens, rows, scale, window,
                                       softcap, sinks, out);
  }
}

}  // namespace

namespace pagedserve {

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& query_rows) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap are >= 0 (0: none)");
  TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == query.size(1)),
              "sinks: one logit per query head");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [n, heads, d], caches 4-d");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must have one layout");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3),
              "a cache token's heads must be contiguous");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head_dim differ");
  TORCH_CHECK(query.size(2) % 8 == 0 && query.size(2) <= MAX_HEAD_DIM, "head_dim ",
              query.size(2), " is not a multiple of 8 up to ", MAX_HEAD_DIM);
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() ||
                  (query.scalar_type() == at::kFloat &&
                   (k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kBFloat16)),
              "the cache holds the query's dtype, or float16/bfloat16 under a float32 query");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  // the sequences: one a query row, or query_rows[i] consecutive rows each
  at::Tensor rows;
  if (query_rows.has_value()) {
    rows = query_rows->contiguous();
    TORCH_CHECK(rows.scalar_type() == at::kInt && rows.dim() == 1,
                "query_rows: int32, one count per sequence");
  }
  const int64_t num_seqs = query_rows.has_value() ? rows.size(0) : query.size(0);
  TORCH_CHECK(block_tables.size(0) >= num_seqs && context_lens.size(0) >= num_seqs,
              "one block table and context length per sequence");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor lens = context_lens.narrow(0, 0, num_seqs).contiguous();
  // A bad table would read outside the cache: check every block a context's window reaches.
  const int64_t block_size = k_cache.size(1), width = tables.size(1);
  const int32_t* table_data = tables.data_ptr<int32_t>();
  const int32_t* len_data = lens.data_ptr<int32_t>();
  const int32_t* row_data = query_rows.has_value() ? rows.data_ptr<int32_t>() : nullptr;
  int64_t total_rows = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = len_data[seq];
    const int64_t seq_rows = row_data != nullptr ? row_data[seq] : 1;
    TORCH_CHECK(seq_rows >= 1 && (seq_rows == 1 || seq_rows <= len), "a sequence of ", len,
                " keys cannot have ", seq_rows, " query rows");
    total_rows += seq_rows;
    TORCH_CHECK(len >= 0 && len <= width * block_size, "context length ", len,
                " does not fit a block table of ", width, " blocks");
    const int32_t* row = table_data + seq * tables.stride(0);
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - seq_rows + 1 - window) /
                                           block_size : 0;
    for (int64_t b = first; b < (len + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < k_cache.size(0), "block ", row[b],
                  " is not in the cache");
    }
  }
  TORCH_CHECK(total_rows == q.size(0), "query_rows count ", total_rows, " rows, the query has ",
              q.size(0));
  const at::Tensor sink_logits =
      sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  const float* sink_data = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(),
                                  "decode_attention", [&] {
    if (q.scalar_type() == k_cache.scalar_type()) {
      decode_attention_typed<scalar_t, scalar_t>(q, k_cache, v_cache, tables, lens, row_data,
                                                 scale, window, softcap, sink_data, out);
    } else {
      decode_attention_typed<float, scalar_t>(q, k_cache, v_cache, tables, lens, row_data,
                                              scale, window, softcap, sink_data, out);
    }
  });
  return out;
}

// Copies each token's keys and values (rows of num_kv_heads * head_dim) into its slot;
// a negative slot (a padding row) is skipped.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key, value: [n, kv_heads, d]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type(),
              "key/value and cache dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(k_cache.numel() % row == 0 && k_cache.size(2) * k_cache.size(3) == row,
              "cache rows and key rows differ");
  const int64_t num_slots = k_cache.numel() / row;
  // rows may be strided (a view of the fused qkv projection); heads within one are not
  const auto rows_of = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const at::Tensor k = rows_of(key), v = rows_of(value);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is past the cache's ", num_slots);
  }
  const int64_t bytes = row * k.element_size();
  const char* k_src = static_cast<const char*>(k.data_ptr());
  const char* v_src = static_cast<const char*>(v.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_row_stride = k.stride(0) * k.element_size();
  const int64_t v_row_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0) continue;
    std::copy_n(k_src + t * k_row_stride, bytes, k_dst + slot[t] * bytes);
    std::copy_n(v_src + t * v_row_stride, bytes, v_dst + slot[t] * bytes);
  }
}

}  // namespace pagedserve
