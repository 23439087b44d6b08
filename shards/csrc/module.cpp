#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU, fp32)");
  m.def("add_rms_norm", &add_rms_norm,
        "(x + residual) RMS-normalized and scaled, and that sum (CPU, fp32)");
  m.def("rotary_qk", &rotary_qk,
        "q and k of a fused qkv row, rotated (rotate_half RoPE), as new tensors (CPU, fp32)");
}
