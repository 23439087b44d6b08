// A decode step's decoder layers in one call from Python (shards/model/llama.py DecodeLoop).
//
// The flat Python loop calls 10 kernels a layer, 300 for SmolLM2's 30 layers, and pays
// for each its dispatch: the loop's own lines, the linear's route, pybind's argument
// conversion and a result object, about 0.6 ms of a 4 ms one-row step of its Q4_1 file
// (benchmarks/NOTES.md 103). Here the same kernels run in the same order on the same
// tensors, so the output is the same to the bit; only the dispatch moves to C++. Each
// linear's route for the step's row count is chosen in Python (the routes the start-up
// timings picked) and handed over as a kind; a step any of whose linears takes a route
// not listed here stays in the Python loop. The GIL is released for the whole call.
#include "ops.h"

#include <ATen/ops/mm.h>

#include <optional>
#include <vector>

namespace {

// How a linear multiplies at the step's row count (layers.py _Matmul.matmul's routes).
enum Route : int64_t { kLanes = 0, kBlocks = 1, kBlocksInt8 = 2, kPanels = 3, kTransposed = 4 };

struct Linear {
  int64_t route;
  at::Tensor weight;  // the route's own layout of W
  int64_t type;       // GGUF block type (the quantized routes)
  int64_t out_features;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (route) {
      case kLanes: return linear_quant_lanes(x, weight, type, out_features, bias);
      case kBlocks: return linear_quant(x, weight, type, out_features, bias);
      case kBlocksInt8: return linear_quant_i8(x, weight, type, out_features, bias);
      case kPanels: return linear_panels(x, weight, out_features, bias);
      default: {
        at::Tensor out = at::mm(x, weight);
        return bias ? out.add_(*bias) : out;
      }
    }
  }
};

struct Layer {
  at::Tensor norm_in, norm_post;
  Linear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;
};

Linear make_linear(int64_t route, at::Tensor weight, int64_t type, int64_t out_features,
                   std::optional<at::Tensor> bias) {
  TORCH_CHECK(route >= kLanes && route <= kTransposed, "DecodeStack: route ", route,
              " is not one it runs");
  return Linear{route, std::move(weight), type, out_features, std::move(bias)};
}

}  // namespace

struct DecodeStack::Impl {
  int64_t heads, kv_heads, head_dim;
  double scale, eps;
  at::Tensor cos, sin, final_norm;
  std::vector<Layer> layers;
};

DecodeStack::DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                         double eps, at::Tensor cos, at::Tensor sin, at::Tensor final_norm)
    : impl_(std::make_shared<Impl>(Impl{heads, kv_heads, head_dim, scale, eps, std::move(cos),
                                        std::move(sin), std::move(final_norm), {}})) {}

void DecodeStack::add_layer(at::Tensor norm_in, at::Tensor norm_post,
                            std::vector<int64_t> routes, std::vector<at::Tensor> weights,
                            std::vector<int64_t> types, std::vector<int64_t> out_features,
                            std::vector<std::optional<at::Tensor>> biases,
                            at::Tensor k_cache, at::Tensor v_cache) {
  TORCH_CHECK(routes.size() == 4 && weights.size() == 4 && types.size() == 4 &&
                  out_features.size() == 4 && biases.size() == 4,
              "DecodeStack.add_layer: qkv, o, gate_up and down: four of each");
  std::vector<Linear> linears;
  for (size_t i = 0; i < 4; ++i)
    linears.push_back(make_linear(routes[i], weights[i], types[i], out_features[i], biases[i]));
  impl_->layers.push_back(Layer{std::move(norm_in), std::move(norm_post), linears[0], linears[1],
                                linears[2], linears[3], std::move(k_cache), std::move(v_cache)});
}

int64_t DecodeStack::num_layers() const { return static_cast<int64_t>(impl_->layers.size()); }

// The body of DecodeLoop.__call__ after the embedding, line for line.
at::Tensor DecodeStack::run(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                            at::Tensor block_tables, at::Tensor seq_lens) const {
  const Impl& s = *impl_;
  const int64_t v_from = (s.heads + s.kv_heads) * s.head_dim;
  std::optional<at::Tensor> residual;
  for (const Layer& layer : s.layers) {
    std::vector<at::Tensor> normed = add_rms_norm(x, residual, layer.norm_in, s.eps);
    residual = normed[1];
    at::Tensor qkv = layer.qkv(normed[0]);
    std::vector<at::Tensor> qk = rotary_qk(qkv, positions, s.cos, s.sin, s.heads, s.kv_heads,
                                           s.head_dim);
    write_kv(qk[1], qkv.slice(1, v_from).reshape({-1, s.kv_heads, s.head_dim}), layer.k_cache,
             layer.v_cache, slot_mapping);
    at::Tensor out = paged_decode(qk[0], layer.k_cache, layer.v_cache, block_tables, seq_lens,
                                  s.scale);
    normed = add_rms_norm(layer.o(out.reshape({-1, s.heads * s.head_dim})), residual,
                          layer.norm_post, s.eps);
    residual = normed[1];
    x = layer.down(silu_mul(layer.gate_up(normed[0])));
  }
  return add_rms_norm(x, residual, s.final_norm, s.eps)[0];
}
