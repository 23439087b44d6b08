// pybind11 and its Tensor casters alone: <torch/extension.h> brings the whole C++ frontend
// (20 s more to compile).
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "decode attention over a paged KV cache (CPU, fp32 q, fp32 or fp16 caches)");
  m.def("add_rms_norm", &add_rms_norm,
        "(x + residual) RMS-normalized and scaled, and that sum (CPU, fp32)");
  m.def("rotary_qk", &rotary_qk,
        "q and k of a fused qkv row, rotated (rotate_half RoPE), as new tensors (CPU, fp32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows (CPU, fp32)");
  m.def("write_kv", &write_kv,
        "new tokens' k and v into the paged caches at their slots (CPU, fp32 or fp16 caches)");
  m.def("panels_supported", &panels_supported, "whether pack_panels/linear_panels are built");
  m.def("pack_panels", &pack_panels, "W (N x K) as ceil(N / 64) panels of K x 64 (CPU, fp32)");
  m.def("linear_panels", &linear_panels,
        "x W^T (+ bias) on pack_panels' layout, panels claimed by threads (CPU, fp32)");
  m.def("quant_supported", &quant_supported, "whether linear_quant is built");
  m.def("linear_quant", &linear_quant,
        "x W^T (+ bias) on W's GGUF blocks: Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, BF16 = 3 (CPU, fp32 x)");
  m.def("quant_i8_supported", &quant_i8_supported, "whether linear_quant_i8 is built");
  m.def("linear_quant_i8", &linear_quant_i8,
        "linear_quant with x quantized to int8 blocks, products in integers (Q4_0, Q4_1, Q8_0)");
  m.def("quant_lanes_supported", &quant_lanes_supported,
        "whether pack_quant_lanes/linear_quant_lanes are built");
  m.def("bf16_dot_min_rows", &bf16_dot_min_rows,
        "the fewest rows of x that bfloat16 lanes multiply rounded to bfloat16 (0: never)");
  m.def("amx_usable", &amx_usable,
        "whether GGUF blocks in lanes multiply bigger steps on AMX tiles (built and granted)");
  m.def("pack_quant_lanes", &pack_quant_lanes,
        "W's GGUF blocks (Q4_0, Q4_1, Q8_0) as groups of 8 rows, one row per vector lane");
  m.def("linear_quant_lanes", &linear_quant_lanes,
        "one row of x times W^T (+ bias) on pack_quant_lanes' layout (CPU, fp32 x)");
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "a decode step's layers and final norm on the embedded rows (CPU, fp32)");
  m.def("lora_add", &lora_add,
        "y[r] += x[r] A[:, c0:c1] B[c0:c1] with (c0, c1) each row's adapter's columns (CPU, fp32)");
}
