// raygen's CPU kernels (float32), one Python module: shards/cpu/kernels.py builds every
// .cpp here into it and module.cpp registers them.
#pragma once

#include "tensor.h"

#include <memory>
#include <optional>
#include <vector>

// Decode attention read in place through the block table (paged_attention.cpp).
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor seq_lens, double scale);

// A decoder layer's small ops in one pass each (layer_ops.cpp).
std::vector<at::Tensor> add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps);
std::vector<at::Tensor> rotary_qk(at::Tensor qkv, at::Tensor positions,
                                  at::Tensor cos, at::Tensor sin, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim);
at::Tensor silu_mul(at::Tensor gate_up);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slots);

// x W^T on W cut into 64-column panels that threads claim one at a time (panel_linear.cpp).
bool panels_supported();
at::Tensor pack_panels(at::Tensor weight);
at::Tensor linear_panels(at::Tensor x, at::Tensor panels, int64_t out_features,
                         std::optional<at::Tensor> bias);

// x W^T on W as GGUF quantization blocks (Q4_0 = 0, Q4_1 = 1, Q8_0 = 2) or bfloat16 (3),
// unpacked in registers (quant_linear.cpp).
bool quant_supported();
at::Tensor linear_quant(at::Tensor x, at::Tensor weight, int64_t type, int64_t out_features,
                        std::optional<at::Tensor> bias);
// The same with x quantized to int8 blocks, multiplied in integers (AVX-512 VNNI, or
// AVX2's vpmaddubsw) (Q4_0, Q4_1, Q8_0), as llama.cpp does: faster, not exact
// (quant_linear_i8.cpp).
bool quant_i8_supported();
at::Tensor linear_quant_i8(at::Tensor x, at::Tensor weight, int64_t type, int64_t out_features,
                           std::optional<at::Tensor> bias);

// One row of x times W^T with W's Q4_0, Q4_1 or Q8_0 blocks laid out again so that a
// vector's lanes hold 8 output rows (quant_lanes.cpp): a decode step's products.
bool quant_lanes_supported();
// The fewest rows of x that bfloat16 weights in lanes multiply rounded to bfloat16
// (vdpbf16ps: AVX-512 with avx512_bf16); 0 where not built: x stays float32.
int64_t bf16_dot_min_rows();
// Whether GGUF blocks in lanes (Q4_0, Q4_1, Q8_0) multiply bigger steps on AMX tiles
// (quant_amx.cpp).
bool amx_usable();
at::Tensor pack_quant_lanes(at::Tensor weight, int64_t type, int64_t in_features);
at::Tensor linear_quant_lanes(at::Tensor x, at::Tensor lanes, int64_t type, int64_t out_features,
                              std::optional<at::Tensor> bias);

// LoRA: each row's delta through its own adapter's columns, added to y (lora.cpp).
void lora_add(at::Tensor x, at::Tensor y, at::Tensor a_rows, at::Tensor b_rows,
              at::Tensor columns);

// A decode step's decoder layers, the same kernels in DecodeLoop's order, in one call
// (decode_stack.cpp). Each linear comes with its route for the step's row count:
// 0 linear_quant_lanes, 1 linear_quant, 2 linear_quant_i8, 3 linear_panels, 4 x @ W (a
// K x N copy).
class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps,
              at::Tensor cos, at::Tensor sin, at::Tensor final_norm);
  void add_layer(at::Tensor norm_in, at::Tensor norm_post, std::vector<int64_t> routes,
                 std::vector<at::Tensor> weights, std::vector<int64_t> types,
                 std::vector<int64_t> out_features, std::vector<std::optional<at::Tensor>> biases,
                 at::Tensor k_cache, at::Tensor v_cache);
  int64_t num_layers() const;
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                 at::Tensor block_tables, at::Tensor seq_lens) const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};
