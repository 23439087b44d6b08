// The optional bias of a linear kernel, checked: nullptr without one, else its float32
// data, kept alive in `holder` (both linear kernels take it the same way).
#pragma once

#include "tensor.h"

#include <optional>

inline const float* bias_data(const std::optional<at::Tensor>& bias, int64_t out_features,
                              const char* op, at::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->contiguous();
  TORCH_CHECK(holder.numel() == out_features && holder.scalar_type() == at::kFloat, op,
              ": bias of ", out_features, " float32 values");
  return holder.data_ptr<float>();
}
