// The C++ CPU kernels' entry points: the functions behind the torch ops and the decode
// stack's class that cpu_bindings.cpp registers (torch.ops.pagedserve.*,
// torch.classes.pagedserve.DecodeStack), for the bindings and for C++ that chains them
// without going back to Python (cpu_decode_stack.cpp). Each file's comment says what its
// functions do.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pagedserve {

// cpu_attention.cpp
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& query_rows = std::nullopt);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping);

// cpu_layers.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
           int64_t head_dim);
void qk_norm_rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   const at::Tensor& q_weight, const at::Tensor& k_weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> hadamard_rows(const at::Tensor& x, int64_t block);
// one row of hadamard_rows: `width` values of `in` turned and scaled into `out`; returns the
// row's largest magnitude (the width a multiple of 8 and of block)
float hadamard_row(const float* in, float* out, int64_t width, int64_t block);

// cpu_matvec.cpp, cpu_matvec_int8.cpp, cpu_matvec_blocks.cpp, cpu_matvec_blocks_int8.cpp
// (and cpu_matvec_file_blocks.cpp below)
at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias);
at::Tensor int8_matvec(const at::Tensor& x, const at::Tensor& row_scales, const at::Tensor& weight,
                       const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias);
at::Tensor q4_1_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& m, const std::optional<at::Tensor>& bias);
at::Tensor q8_0_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const std::optional<at::Tensor>& bias);

at::Tensor q4_1_int8_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                            const at::Tensor& m, const std::optional<at::Tensor>& bias);
at::Tensor q4_1_planes_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                              const at::Tensor& m, const std::optional<at::Tensor>& bias);
at::Tensor q8_0_int8_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                            const std::optional<at::Tensor>& bias);

// cpu_decode_stack.cpp: a LoRA adapter's delta on rows start..stop of a projection's output,
// out[r] += B (A x[r]) (B scaled, given as B.T [r, out]), summed on the calling thread.
// parts [p, 4]: (rank start, rank stop, column start, column stop) of each fused part the
// adapter targets: B.T is read only there (zero elsewhere).
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& shrink,
               const at::Tensor& expand, const at::Tensor& parts, int64_t start,
               int64_t stop);

// cpu_matvec_file_blocks.cpp: a GGUF's blocks as the file stores them (block_formats.h)
at::Tensor q4_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias);
at::Tensor q5_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias);
at::Tensor q6_k_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias);
at::Tensor q4_0_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias);
at::Tensor q5_0_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias);
at::Tensor q5_1_matvec(const at::Tensor& x, const at::Tensor& blocks,
                       const std::optional<at::Tensor>& bias);
at::Tensor q8_0_file_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);
at::Tensor file_blocks_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            const std::optional<at::Tensor>& bias);
void dequantize_file_blocks_(at::Tensor& out, const at::Tensor& blocks, int64_t kind);

// cpu_matvec_file_blocks_int8.cpp: the same blocks times int8 activations (llama.cpp's)
at::Tensor q4_k_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);
at::Tensor q5_k_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);
at::Tensor q6_k_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);
at::Tensor q4_0_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);
at::Tensor q5_0_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);
at::Tensor q5_1_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                            const std::optional<at::Tensor>& bias);
at::Tensor q8_0_file_int8_matvec(const at::Tensor& x, const at::Tensor& blocks,
                                 const std::optional<at::Tensor>& bias);
std::string file_blocks_int8_isa();
at::Tensor file_blocks_amx_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                const std::optional<at::Tensor>& bias);
bool amx_int8_granted();

// cpu_sampling.cpp: each row's first index of its largest value (torch.argmax's)
at::Tensor greedy_ids(const at::Tensor& logits);

// cpu_int8_amx.cpp: the int8 projection's larger batches on AMX's int8 tiles
at::Tensor int8_amx_pack(const at::Tensor& weight);
at::Tensor int8_amx_gemm(const at::Tensor& x, int64_t block, const at::Tensor& weight,
                         const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias);

// cpu_decode_stack.cpp: a decode step's decoder layers in one call. Built with the small-batch
// paths' names and weight-tensor counts in model_runner/kernels/cpu_kernel_table.py's order,
// which it checks against its own projection kinds.
struct DecodeStack : torch::CustomClassHolder {
  DecodeStack(std::vector<std::string> kind_names, std::vector<int64_t> tensors_per_kind);
  ~DecodeStack() override;

  // One layer, after those added before. norms: the weights (the scale the norm multiplies
  // by) of the input norm, the attention output's norm (Gemma's sandwich; empty for none),
  // the feed-forward input's norm, the feed-forward output's (empty for none), the per-head
  // q and k norms (both empty for none), all with one eps; shape: (num_heads, num_kv_heads,
  // head_dim, window, rope: its index in forward's cos and sin tables or -1 for none,
  // activation: 0 SwiGLU, 1 gelu-tanh gated); residual_multiplier: each block's output times
  // it before it joins the residual (1: none); parts: how many parts each of qkv, o,
  // gate_up, down is run as (one kernel call each, their outputs side by side: a GGUF's
  // fused projection of mixed block types), and for each part in that order its kind and
  // argument (its op's integer: int8 rows' rotation block, a GGUF's blocks' type), its
  // batch form (batches: three numbers a part, its kind or -1 for none, its argument and
  // the fewest rows it runs), its tensors (weights: one after the
  // other, the batch form's after its part's) and its bias (biases: an empty tensor for
  // none; a batch form shares its part's); sinks: empty for none.
  void add_layer(std::vector<at::Tensor> norms, double eps, std::vector<int64_t> shape,
                 double scale, double softcap, double residual_multiplier, at::Tensor sinks,
                 std::vector<int64_t> parts, std::vector<int64_t> kinds,
                 std::vector<int64_t> arguments, std::vector<int64_t> batches,
                 std::vector<at::Tensor> weights, std::vector<at::Tensor> biases);

  // The hidden states x [n, hidden] of n decode rows (row i: sequence i, one new token
  // at slot_mapping[i], context_lens[i] keys with it) through every layer: the residual
  // stream before the final norm. cos and sin: the RoPE tables the layers read, each
  // [n, head_dim / 2]; caches: one pair a layer. LoRA adapters' rows: lora_runs holds
  // (adapter, start, stop) of each run of rows of one adapter, after each other (empty: no
  // adapter in the step); lora_weights, for each adapter of the step, for each layer, its
  // A [r, in], B.T [r, out] (scaled) and parts (lora_add_'s) of qkv, o, gate_up and down
  // (empty where not targeted).
  at::Tensor forward(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor context_lens,
                     std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                     std::vector<int64_t> lora_runs, std::vector<at::Tensor> lora_weights);

 private:
  struct Layer;
  std::vector<Layer> layers_;
};

}  // namespace pagedserve
