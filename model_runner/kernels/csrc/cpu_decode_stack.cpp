// A decoder's layers (Llama-style, Qwen3's q/k norms, Gemma's sandwich norms, gelu gate and
// per-layer RoPE tables, NoPE layers, Granite's residual multiplier, LoRA adapters' rows) for a
// decode step of a few rows, in one C++ call
// (torch.classes.pagedserve.DecodeStack, registered in cpu_bindings.cpp): the same kernels,
// in the same order, as the Python layers call one by one (model_runner/models/layers.py on
// the "cpu" backend), so the hidden states are the same to the bit (with LoRA adapters'
// rows too: their deltas are lora_add_'s, as the Python layers' on the CPU). At batch 1 a step's
// arithmetic is ~10 ms and its ~500 op calls from Python cost ~3 ms more; here each layer
// costs one loop turn. model_runner/models/decode_stack.py builds it from the layers' own
// forms and says when it runs.
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "cpu_ops.h"
#include "vec8.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace pagedserve {
namespace {

// Each kernel call shows in torch.profiler under its op's name (bench.step_profile), as
// when Python calls it; off the profiler this costs a flag check.
#define PROFILED(name) RECORD_FUNCTION("pagedserve::" name, c10::ArrayRef<c10::IValue>{})

// How a projection's small-batch copy is held: one kind per small-batch path, named by its
// op, in the order of model_runner/kernels/cpu_kernel_table.py's PATHS (the stack's
// constructor checks the names and tensor counts against it), with the weight tensors
// it reads after x (cpu_linear.py's DecodeForm gives them in this order).
enum class Kind : int64_t {
  matvec,              // [weight]: float32 or float16 rows (cpu_matvec.cpp)
  q4_1_matvec,         // [qs, d, m]: exact Q4_1 blocks (cpu_matvec_blocks.cpp)
  q8_0_matvec,         // [qs, d]: exact Q8_0 blocks
  int8_matvec,         // [weight, weight_scales]: rotated int8 rows (cpu_matvec_int8.cpp)
  q4_1_int8_matvec,    // [qs, d, m]: Q4_1 blocks times int8 activations
  q8_0_int8_matvec,    // [qs, d]: Q8_0 blocks times int8 activations (cpu_matvec_blocks_int8.cpp)
  q4_1_planes_matvec,  // [qs, d, m]: Q4_1 blocks times activations split in int8 planes
  q4_k_matvec,         // [blocks]: a GGUF's blocks as stored (cpu_matvec_file_blocks.cpp)
  q5_k_matvec,         // [blocks]
  q6_k_matvec,         // [blocks]
  q4_0_matvec,         // [blocks]
  q5_0_matvec,         // [blocks]
  q5_1_matvec,         // [blocks]
  q8_0_file_matvec,    // [blocks]
  // [blocks]: the same blocks times int8 activations (cpu_matvec_file_blocks_int8.cpp)
  q4_k_int8_matvec, q5_k_int8_matvec, q6_k_int8_matvec, q4_0_int8_matvec, q5_0_int8_matvec,
  q5_1_int8_matvec, q8_0_file_int8_matvec,
  // batch forms: a projection's larger batches past its small-batch kind's rows
  int8_amx_gemm,  // [tiles, weight_scales]: rotated int8 rows on AMX (cpu_int8_amx.cpp)
  file_blocks_amx_gemm,  // [blocks]: a GGUF's blocks on AMX (cpu_matvec_file_blocks_int8.cpp)
};
constexpr const char* kKindNames[] = {
    "matvec", "q4_1_matvec", "q8_0_matvec", "int8_matvec",
    "q4_1_int8_matvec", "q8_0_int8_matvec", "q4_1_planes_matvec",
    "q4_k_matvec", "q5_k_matvec", "q6_k_matvec", "q4_0_matvec", "q5_0_matvec",
    "q5_1_matvec", "q8_0_file_matvec", "q4_k_int8_matvec", "q5_k_int8_matvec",
    "q6_k_int8_matvec", "q4_0_int8_matvec", "q5_0_int8_matvec", "q5_1_int8_matvec",
    "q8_0_file_int8_matvec", "int8_amx_gemm", "file_blocks_amx_gemm",
};
constexpr size_t kTensorsOf[] = {1, 3, 2, 2, 3, 2, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                 2, 1};
constexpr int64_t kNumKinds = static_cast<int64_t>(Kind::file_blocks_amx_gemm) + 1;
static_assert(std::size(kKindNames) == kNumKinds && std::size(kTensorsOf) == kNumKinds);

struct Part {
  Kind kind = Kind::matvec;
  std::vector<at::Tensor> weights;
  std::optional<at::Tensor> bias;
  // the op's integer after its tensors: int8_matvec's and int8_amx_gemm's Hadamard block of
  // its input, file_blocks_amx_gemm's type of the blocks
  int64_t argument = 0;
  // the same weight's form for batches of batch_from rows or more (none: every batch here)
  std::shared_ptr<const Part> batch;
  int64_t batch_from = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (batch != nullptr && x.size(0) >= batch_from) return (*batch)(x);
    switch (kind) {
      case Kind::matvec: {
        PROFILED("matvec");
        return matvec(x, weights[0], bias);
      }
      case Kind::q4_1_matvec: {
        PROFILED("q4_1_matvec");
        return q4_1_matvec(x, weights[0], weights[1], weights[2], bias);
      }
      case Kind::q8_0_matvec: {
        PROFILED("q8_0_matvec");
        return q8_0_matvec(x, weights[0], weights[1], bias);
      }
      case Kind::q4_1_int8_matvec: {
        PROFILED("q4_1_int8_matvec");
        return q4_1_int8_matvec(x, weights[0], weights[1], weights[2], bias);
      }
      case Kind::q4_1_planes_matvec: {
        PROFILED("q4_1_planes_matvec");
        return q4_1_planes_matvec(x, weights[0], weights[1], weights[2], bias);
      }
      case Kind::q8_0_int8_matvec: {
        PROFILED("q8_0_int8_matvec");
        return q8_0_int8_matvec(x, weights[0], weights[1], bias);
      }
      case Kind::q4_k_matvec: {
        PROFILED("q4_k_matvec");
        return q4_k_matvec(x, weights[0], bias);
      }
      case Kind::q5_k_matvec: {
        PROFILED("q5_k_matvec");
        return q5_k_matvec(x, weights[0], bias);
      }
      case Kind::q6_k_matvec: {
        PROFILED("q6_k_matvec");
        return q6_k_matvec(x, weights[0], bias);
      }
      case Kind::q4_0_matvec: {
        PROFILED("q4_0_matvec");
        return q4_0_matvec(x, weights[0], bias);
      }
      case Kind::q5_0_matvec: {
        PROFILED("q5_0_matvec");
        return q5_0_matvec(x, weights[0], bias);
      }
      case Kind::q5_1_matvec: {
        PROFILED("q5_1_matvec");
        return q5_1_matvec(x, weights[0], bias);
      }
      case Kind::q8_0_file_matvec: {
        PROFILED("q8_0_file_matvec");
        return q8_0_file_matvec(x, weights[0], bias);
      }
      // clang-format off
      case Kind::q4_k_int8_matvec: { PROFILED("q4_k_int8_matvec"); return q4_k_int8_matvec(x, weights[0], bias); }
      case Kind::q5_k_int8_matvec: { PROFILED("q5_k_int8_matvec"); return q5_k_int8_matvec(x, weights[0], bias); }
      case Kind::q6_k_int8_matvec: { PROFILED("q6_k_int8_matvec"); return q6_k_int8_matvec(x, weights[0], bias); }
      case Kind::q4_0_int8_matvec: { PROFILED("q4_0_int8_matvec"); return q4_0_int8_matvec(x, weights[0], bias); }
      case Kind::q5_0_int8_matvec: { PROFILED("q5_0_int8_matvec"); return q5_0_int8_matvec(x, weights[0], bias); }
      case Kind::q5_1_int8_matvec: { PROFILED("q5_1_int8_matvec"); return q5_1_int8_matvec(x, weights[0], bias); }
      case Kind::q8_0_file_int8_matvec: { PROFILED("q8_0_file_int8_matvec"); return q8_0_file_int8_matvec(x, weights[0], bias); }
      // clang-format on
      case Kind::int8_amx_gemm: {
        PROFILED("int8_amx_gemm");
        return int8_amx_gemm(x, argument, weights[0], weights[1], bias);
      }
      case Kind::file_blocks_amx_gemm: {
        PROFILED("file_blocks_amx_gemm");
        return file_blocks_amx_gemm(x, weights[0], argument, bias);
      }
      default: {  // Kind::int8_matvec
        const auto [rotated, row_amax] = [&] {
          PROFILED("hadamard_rows");
          return hadamard_rows(x, argument);
        }();
        PROFILED("int8_matvec");
        return int8_matvec(rotated, row_amax, weights[0], weights[1], bias);
      }
    }
  }
};

// A projection: one part, or several (a GGUF's fused projection of mixed block types), each
// a kernel call on its run of output rows, the outputs side by side.
struct Projection {
  std::vector<Part> parts;

  at::Tensor operator()(const at::Tensor& x) const {
    if (parts.size() == 1) return parts[0](x);
    std::vector<at::Tensor> outs;
    outs.reserve(parts.size());
    for (const Part& part : parts) outs.push_back(part(x));
    return at::cat(outs, 1);
  }
};

}  // namespace

enum class Activation : int64_t { silu, gelu_tanh };

struct DecodeStack::Layer {
  at::Tensor input_norm, mlp_norm;
  // Gemma's sandwich norms on the attention's and feed-forward's outputs
  std::optional<at::Tensor> attention_out_norm, mlp_out_norm;
  std::optional<at::Tensor> q_norm, k_norm;  // per head, before RoPE (Qwen3, Gemma 3)
  double eps;
  Projection qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim, window, rope;  // rope -1: a layer without (NoPE)
  Activation activation;
  double scale, softcap;
  double residual_multiplier;  // each block's output times it (Granite's; 1: none)
  std::optional<at::Tensor> sinks;
};

namespace {

at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  PROFILED("rms_norm");
  return rms_norm(x, weight, eps);
}

// a block's output times the residual multiplier, as Python's `h * m` (none when 1)
at::Tensor scaled(const at::Tensor& h, double multiplier) {
  return multiplier == 1.0 ? h : h * multiplier;
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec8 sums{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) sums += load8(a + i) * load8(b + i);
  float sum = sum8(sums);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

// NOTE: on the calling thread, in plain loops: an adapter's work at a few rows is ~1e5
// multiply-adds a projection, less than a thread pool's wake-up (a GEMM's, ~0.1 ms each on
// a busy host, two a projection).
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& shrink,
               const at::Tensor& expand, const at::Tensor& parts, int64_t start,
               int64_t stop) {
  const int64_t rank = shrink.size(0), width = x.size(1), out_features = out.size(1);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && shrink.dim() == 2 && expand.dim() == 2 &&
                  shrink.is_contiguous() && expand.is_contiguous() &&
                  shrink.scalar_type() == at::kFloat && expand.scalar_type() == at::kFloat &&
                  x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  x.stride(1) == 1 && out.stride(1) == 1 && shrink.size(1) == width &&
                  expand.size(0) == rank && expand.size(1) == out_features &&
                  0 <= start && start <= stop && stop <= x.size(0) && stop <= out.size(0),
              "lora_add_: out [n, out] and x [n, in] rows, A [r, in] and B.T [r, out], float32");
  TORCH_CHECK(parts.dim() == 2 && parts.size(1) == 4 && parts.is_contiguous() &&
                  parts.scalar_type() == at::kLong,
              "lora_add_: parts [p, 4] int64 (rank start, rank stop, column start, stop)");
  const int64_t* spans = parts.data_ptr<int64_t>();
  for (int64_t p = 0; p < parts.size(0); ++p) {
    const int64_t* span = spans + 4 * p;
    TORCH_CHECK(0 <= span[0] && span[0] <= span[1] && span[1] <= rank && 0 <= span[2] &&
                    span[2] <= span[3] && span[3] <= out_features,
                "lora_add_: part ", p, " outside A's ", rank, " rows or ", out_features,
                " columns");
  }
  // each row of A read once for all the run's rows (the weights, not the rows, are what a
  // step streams from memory); of B.T only each part's block (its rows of the rank, its
  // columns of the fused output: the rest is zero), in panels of 64 columns (held in L1
  // across the rows), each row's 64 sums in registers
  const int64_t rows = stop - start;
  std::vector<float> shrunk(rows * rank);
  const float* a = shrink.data_ptr<float>();
  const float* b = expand.data_ptr<float>();
  const float* x_rows = x.data_ptr<float>() + start * x.stride(0);
  float* out_rows = out.data_ptr<float>() + start * out.stride(0);
  for (int64_t k = 0; k < rank; ++k) {
    for (int64_t r = 0; r < rows; ++r) {
      shrunk[r * rank + k] = dot(a + k * width, x_rows + r * x.stride(0), width);
    }
  }
  constexpr int64_t kPanel = 64;
  for (int64_t p = 0; p < parts.size(0); ++p) {
    const int64_t k0 = spans[4 * p], k1 = spans[4 * p + 1];
    const int64_t column_stop = spans[4 * p + 3];
    for (int64_t j0 = spans[4 * p + 2]; j0 < column_stop; j0 += kPanel) {
      const int64_t cols = std::min(kPanel, column_stop - j0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* s = shrunk.data() + r * rank;
        float* o = out_rows + r * out.stride(0) + j0;
        if (cols < kPanel) {
          for (int64_t j = 0; j < cols; ++j) {
            float sum = 0.0f;
            for (int64_t k = k0; k < k1; ++k) sum += b[k * out_features + j0 + j] * s[k];
            o[j] += sum;
          }
          continue;
        }
        Vec8 sums[kPanel / 8] = {};
        for (int64_t k = k0; k < k1; ++k) {
          const float* b_row = b + k * out_features + j0;
          for (int v = 0; v < kPanel / 8; ++v) sums[v] += load8(b_row + 8 * v) * s[k];
        }
        for (int v = 0; v < kPanel / 8; ++v) {
          const Vec8 sum = load8(o + 8 * v) + sums[v];
          std::memcpy(o + 8 * v, &sum, sizeof(sum));
        }
      }
    }
  }
}

namespace {

// The step's LoRA adapters (forward's lora_runs and lora_weights): runs of rows of one
// adapter, each projection's delta added after its base output (lora_add_); base rows pay
// nothing.
struct LoRARuns {
  static constexpr size_t kPerLayer = 12;  // qkv, o, gate_up, down: A, B.T and parts each
  const std::vector<int64_t>& runs;       // (adapter, start, stop) after each other
  const std::vector<at::Tensor>& weights;  // per adapter, per layer: kPerLayer tensors
  size_t per_adapter;

  void add(at::Tensor& out, const at::Tensor& x, size_t layer, size_t projection) const {
    for (size_t i = 0; i < runs.size(); i += 3) {
      const size_t first = runs[i] * per_adapter + layer * kPerLayer + projection * 3;
      if (weights[first].numel() == 0) continue;  // the adapter does not target it
      PROFILED("lora_add_");
      lora_add_(out, x, weights[first], weights[first + 1], weights[first + 2], runs[i + 1],
                runs[i + 2]);
    }
  }
};

}  // namespace

DecodeStack::DecodeStack(std::vector<std::string> kind_names,
                         std::vector<int64_t> tensors_per_kind) {
  bool same = kind_names.size() == kNumKinds && tensors_per_kind.size() == kNumKinds;
  for (size_t i = 0; same && i < kind_names.size(); ++i) {
    same = kind_names[i] == kKindNames[i] &&
           tensors_per_kind[i] == static_cast<int64_t>(kTensorsOf[i]);
  }
  TORCH_CHECK(same, "DecodeStack: cpu_kernel_table.PATHS (names and tensor counts) differ from "
              "the projection kinds of csrc/cpu_decode_stack.cpp: ", c10::Join(", ", kind_names),
              " against ", c10::Join(", ", std::vector<std::string>(std::begin(kKindNames),
                                                                   std::end(kKindNames))));
}

DecodeStack::~DecodeStack() = default;

void DecodeStack::add_layer(std::vector<at::Tensor> norms, double eps,
                            std::vector<int64_t> shape, double scale, double softcap,
                            double residual_multiplier, at::Tensor sinks,
                            std::vector<int64_t> parts, std::vector<int64_t> kinds,
                            std::vector<int64_t> arguments, std::vector<int64_t> batches,
                            std::vector<at::Tensor> weights, std::vector<at::Tensor> biases) {
  TORCH_CHECK(norms.size() == 6 && shape.size() == 6 && parts.size() == 4,
              "DecodeStack.add_layer: six norms, four projections and a shape of six");
  TORCH_CHECK(arguments.size() == kinds.size() && biases.size() == kinds.size() &&
                  batches.size() == 3 * kinds.size(),
              "DecodeStack.add_layer: a kind, an argument, a batch form and a bias for each part");
  TORCH_CHECK(shape[4] >= -1 && (shape[5] == 0 || shape[5] == 1),
              "DecodeStack.add_layer: a RoPE table's index (-1: none) and an activation of 0 or 1");
  const auto optional = [](const at::Tensor& t) {
    return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  TORCH_CHECK(optional(norms[4]).has_value() == optional(norms[5]).has_value(),
              "DecodeStack.add_layer: a q norm and a k norm, or neither");
  TORCH_CHECK(shape[4] >= 0 || !optional(norms[4]).has_value(),
              "DecodeStack.add_layer: q/k norms only on a layer with RoPE");
  Projection projections[4];
  size_t next = 0, part = 0;
  // a part's kind, argument and bias, and its kind's tensors: the next in `weights`
  const auto make = [&](Part& p, int64_t kind, int64_t argument,
                        const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(kind >= 0 && kind < kNumKinds, "unknown projection kind ", kind);
    p.kind = static_cast<Kind>(kind);
    p.argument = argument;
    p.bias = bias;
    const size_t count = kTensorsOf[kind];
    TORCH_CHECK(next + count <= weights.size(), "too few projection weights");
    p.weights.assign(weights.begin() + next, weights.begin() + next + count);
    next += count;
  };
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(parts[i] >= 1 && part + parts[i] <= kinds.size(),
                "DecodeStack.add_layer: each projection's parts, one kind each");
    for (int64_t j = 0; j < parts[i]; ++j, ++part) {
      Part& p = projections[i].parts.emplace_back();
      make(p, kinds[part], arguments[part], optional(biases[part]));
      const int64_t* batch = batches.data() + 3 * part;  // kind (-1: none), argument, from
      if (batch[0] >= 0) {
        TORCH_CHECK(batch[2] >= 1, "a batch form from ", batch[2], " rows");
        auto alternative = std::make_shared<Part>();
        make(*alternative, batch[0], batch[1], p.bias);
        p.batch = std::move(alternative);
        p.batch_from = batch[2];
      }
    }
  }
  TORCH_CHECK(part == kinds.size(), "DecodeStack.add_layer: more kinds than parts");
  TORCH_CHECK(next == weights.size(), "too many projection weights");
  layers_.push_back(Layer{norms[0], norms[2], optional(norms[1]), optional(norms[3]),
                          optional(norms[4]), optional(norms[5]), eps,
                          projections[0], projections[1], projections[2], projections[3],
                          shape[0], shape[1], shape[2], shape[3], shape[4],
                          static_cast<Activation>(shape[5]), scale, softcap,
                          residual_multiplier, optional(sinks)});
}

at::Tensor DecodeStack::forward(at::Tensor x, std::vector<at::Tensor> cos,
                                std::vector<at::Tensor> sin,
                                at::Tensor slot_mapping, at::Tensor block_tables,
                                at::Tensor context_lens, std::vector<at::Tensor> k_caches,
                                std::vector<at::Tensor> v_caches, std::vector<int64_t> lora_runs,
                                std::vector<at::Tensor> lora_weights) {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "DecodeStack.forward: one k and one v cache a layer");
  const int64_t rows = x.size(0);
  const LoRARuns lora{lora_runs, lora_weights, layers_.size() * LoRARuns::kPerLayer};
  const int64_t num_adapters = static_cast<int64_t>(lora_weights.size() / lora.per_adapter);
  TORCH_CHECK(lora_runs.size() % 3 == 0 && lora_weights.size() % lora.per_adapter == 0,
              "DecodeStack.forward: LoRA runs of three numbers, ", LoRARuns::kPerLayer,
              " LoRA tensors a layer for each adapter");
  for (size_t i = 0; i < lora_runs.size(); i += 3) {
    TORCH_CHECK(lora_runs[i] >= 0 && lora_runs[i] < num_adapters && lora_runs[i + 1] >= 0 &&
                    lora_runs[i + 1] < lora_runs[i + 2] && lora_runs[i + 2] <= rows,
                "DecodeStack.forward: a LoRA run of adapter ", lora_runs[i], " of ",
                num_adapters, " over rows ", lora_runs[i + 1], "..", lora_runs[i + 2], " of ", rows);
  }
  TORCH_CHECK(cos.size() == sin.size(), "DecodeStack.forward: a sin table for each cos table");
  for (const Layer& layer : layers_) {
    TORCH_CHECK(layer.rope < static_cast<int64_t>(cos.size()),
                "DecodeStack.forward: a layer reads RoPE table ", layer.rope, " of ", cos.size());
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    at::Tensor& k_cache = k_caches[i];
    at::Tensor& v_cache = v_caches[i];
    const int64_t q_size = layer.num_heads * layer.head_dim;
    const int64_t kv_size = layer.num_kv_heads * layer.head_dim;
    const at::Tensor attention_in = norm(x, layer.input_norm, layer.eps);
    at::Tensor qkv = layer.qkv(attention_in);
    lora.add(qkv, attention_in, i, 0);
    if (layer.rope < 0) {
      // a layer without positions: q and k as projected
    } else if (layer.q_norm) {
      PROFILED("qk_norm_rope_");
      qk_norm_rope_(qkv, cos[layer.rope], sin[layer.rope], layer.num_heads, layer.num_kv_heads, layer.head_dim,
                    *layer.q_norm, *layer.k_norm, layer.eps);
    } else {
      PROFILED("rope_");
      rope_(qkv, cos[layer.rope], sin[layer.rope], layer.num_heads + layer.num_kv_heads,
            layer.head_dim);
    }
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, layer.num_heads, layer.head_dim});
    const at::Tensor k =
        qkv.narrow(1, q_size, kv_size).view({rows, layer.num_kv_heads, layer.head_dim});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({rows, layer.num_kv_heads, layer.head_dim});
    {
      PROFILED("write_kv_cache");
      write_kv_cache(k.to(k_cache.scalar_type()), v.to(v_cache.scalar_type()), k_cache,
                     v_cache, slot_mapping);
    }
    const at::Tensor attended = [&] {
      PROFILED("decode_attention");
      return decode_attention(q, k_cache, v_cache, block_tables, context_lens, layer.scale,
                              layer.window, layer.softcap, layer.sinks);
    }();
    const at::Tensor o_in = attended.view({rows, q_size});
    at::Tensor attention_out = layer.o(o_in);
    lora.add(attention_out, o_in, i, 1);
    x = x + scaled(layer.attention_out_norm
                       ? norm(attention_out, *layer.attention_out_norm, layer.eps)
                       : attention_out,
                   layer.residual_multiplier);
    const at::Tensor mlp_in = norm(x, layer.mlp_norm, layer.eps);
    at::Tensor gate_up = layer.gate_up(mlp_in);
    lora.add(gate_up, mlp_in, i, 2);
    const at::Tensor activated = [&] {
      if (layer.activation == Activation::gelu_tanh) {
        PROFILED("gelu_tanh_and_mul");
        return gelu_tanh_and_mul(gate_up);
      }
      PROFILED("silu_and_mul");
      return silu_and_mul(gate_up);
    }();
    at::Tensor mlp_out = layer.down(activated);
    lora.add(mlp_out, activated, i, 3);
    x = x + scaled(layer.mlp_out_norm ? norm(mlp_out, *layer.mlp_out_norm, layer.eps) : mlp_out,
                   layer.residual_multiplier);
  }
  return x;
}

}  // namespace pagedserve
