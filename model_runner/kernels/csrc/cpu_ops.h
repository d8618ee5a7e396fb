// The C++ CPU kernels' entry points, as the torch ops registered in each file call them
// (torch.ops.pagedserve.*), for C++ that chains them without going back to Python
// (cpu_decode_stack.cpp). Each file's comment says what its functions do.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace pagedserve {

// cpu_attention.cpp
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping);

// cpu_layers.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
           int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> hadamard_rows(const at::Tensor& x, int64_t block);

// cpu_matvec.cpp, cpu_matvec_int8.cpp, cpu_matvec_blocks.cpp, cpu_matvec_blocks_int8.cpp
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

}  // namespace pagedserve
