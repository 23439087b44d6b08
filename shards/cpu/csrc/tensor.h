// The part of ATen the kernels use: Tensor and its methods, the few factory functions
// they call, and TORCH_CHECK. <ATen/ATen.h> declares every operator and took 9 s of
// compile time per source file (benchmarks/NOTES.md 72).
#pragma once

#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
