// Every torch op and class of the C++ CPU kernels, registered here and only here
// (torch.ops.pagedserve.*, torch.classes.pagedserve.DecodeStack); the kernels themselves
// live in the other files, behind cpu_ops.h. model_runner/kernels/cpu_kernels.py builds and
// loads them; model_runner/kernels/cpu_kernel_table.py says which small-batch op a
// projection runs.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_ops.h"

TORCH_LIBRARY(pagedserve, m) {
  // cpu_attention.cpp
  m.def("decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, float softcap=0., Tensor? sinks=None, "
        "Tensor? query_rows=None) "
        "-> Tensor", &pagedserve::decode_attention);
  m.def("write_kv_cache", &pagedserve::write_kv_cache);

  // cpu_layers.cpp
  m.def("hadamard_rows", &pagedserve::hadamard_rows);
  m.def("rms_norm", &pagedserve::rms_norm);
  m.def("rope_", &pagedserve::rope_);
  m.def("qk_norm_rope_", &pagedserve::qk_norm_rope_);
  m.def("silu_and_mul", &pagedserve::silu_and_mul);
  m.def("gelu_tanh_and_mul", &pagedserve::gelu_tanh_and_mul);

  // the small-batch projections, one op per path of cpu_kernel_table.PATHS
  m.def("matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &pagedserve::matvec);
  m.def("q4_1_matvec(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor",
        &pagedserve::q4_1_matvec);
  m.def("q8_0_matvec(Tensor x, Tensor qs, Tensor d, Tensor? bias) -> Tensor",
        &pagedserve::q8_0_matvec);
  m.def("int8_matvec(Tensor x, Tensor row_scales, Tensor weight, Tensor weight_scales, "
        "Tensor? bias) -> Tensor", &pagedserve::int8_matvec);
  m.def("q4_1_int8_matvec(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor",
        &pagedserve::q4_1_int8_matvec);
  m.def("q8_0_int8_matvec(Tensor x, Tensor qs, Tensor d, Tensor? bias) -> Tensor",
        &pagedserve::q8_0_int8_matvec);
  m.def("q4_1_planes_matvec(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor",
        &pagedserve::q4_1_planes_matvec);
  m.def("q4_k_matvec(Tensor x, Tensor blocks, Tensor? bias) -> Tensor", &pagedserve::q4_k_matvec);
  m.def("q5_k_matvec(Tensor x, Tensor blocks, Tensor? bias) -> Tensor", &pagedserve::q5_k_matvec);
  m.def("q6_k_matvec(Tensor x, Tensor blocks, Tensor? bias) -> Tensor", &pagedserve::q6_k_matvec);
  m.def("q4_0_matvec(Tensor x, Tensor blocks, Tensor? bias) -> Tensor", &pagedserve::q4_0_matvec);
  m.def("q5_0_matvec(Tensor x, Tensor blocks, Tensor? bias) -> Tensor", &pagedserve::q5_0_matvec);
  m.def("q5_1_matvec(Tensor x, Tensor blocks, Tensor? bias) -> Tensor", &pagedserve::q5_1_matvec);
  m.def("q8_0_file_matvec(Tensor x, Tensor blocks, Tensor? bias) -> Tensor",
        &pagedserve::q8_0_file_matvec);
  // cpu_matvec_file_blocks_int8.cpp: the same blocks times int8 activations
  for (const auto& [name, fn] : {std::pair{"q4_k_int8_matvec", &pagedserve::q4_k_int8_matvec},
                                 std::pair{"q5_k_int8_matvec", &pagedserve::q5_k_int8_matvec},
                                 std::pair{"q6_k_int8_matvec", &pagedserve::q6_k_int8_matvec},
                                 std::pair{"q4_0_int8_matvec", &pagedserve::q4_0_int8_matvec},
                                 std::pair{"q5_0_int8_matvec", &pagedserve::q5_0_int8_matvec},
                                 std::pair{"q5_1_int8_matvec", &pagedserve::q5_1_int8_matvec},
                                 std::pair{"q8_0_file_int8_matvec",
                                           &pagedserve::q8_0_file_int8_matvec}}) {
    m.def((std::string(name) + "(Tensor x, Tensor blocks, Tensor? bias) -> Tensor").c_str(), fn);
  }
  m.def("file_blocks_int8_isa", &pagedserve::file_blocks_int8_isa);
  // the same file: larger batches on AMX's int8 tiles
  m.def("file_blocks_amx_gemm(Tensor x, Tensor blocks, int kind, Tensor? bias) -> Tensor",
        &pagedserve::file_blocks_amx_gemm);
  m.def("amx_int8_granted", &pagedserve::amx_int8_granted);
  // cpu_sampling.cpp
  m.def("greedy_ids(Tensor logits) -> Tensor", &pagedserve::greedy_ids);
  // cpu_int8_amx.cpp: the int8 rows' larger batches on AMX's int8 tiles
  m.def("int8_amx_pack(Tensor weight) -> Tensor", &pagedserve::int8_amx_pack);
  m.def("int8_amx_gemm(Tensor x, int block, Tensor weight, Tensor weight_scales, Tensor? bias) "
        "-> Tensor", &pagedserve::int8_amx_gemm);
  // cpu_matvec_file_blocks.cpp: a GGUF's blocks' larger batches, and their values
  m.def("file_blocks_gemm(Tensor x, Tensor blocks, int kind, Tensor? bias) -> Tensor",
        &pagedserve::file_blocks_gemm);
  m.def("dequantize_file_blocks_(Tensor(a!) out, Tensor blocks, int kind) -> ()",
        &pagedserve::dequantize_file_blocks_);

  // cpu_decode_stack.cpp
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor shrink, Tensor expand, Tensor parts, "
        "int start, int stop) -> ()", &pagedserve::lora_add_);
  m.class_<pagedserve::DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<std::string>, std::vector<int64_t>>())
      .def("add_layer", &pagedserve::DecodeStack::add_layer)
      .def("forward", &pagedserve::DecodeStack::forward);
}
