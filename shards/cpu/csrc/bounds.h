// Index checks in one pass over a contiguous integer tensor's data. aten's min() and
// max() are two reductions, two allocations and two syncs (.item()) apiece; a decode step
// ran 36 of each for checks on a few dozen integers (benchmarks/NOTES.md 50).
#pragma once

#include "tensor.h"

#include <cstdint>

// Whether every value of `t` (contiguous, of integer type T) lies in [lo, hi).
template <typename T>
bool all_within(const at::Tensor& t, int64_t lo, int64_t hi) {
  const T* p = t.data_ptr<T>();
  bool ok = true;
  for (int64_t i = 0, n = t.numel(); i < n; ++i)
    ok &= static_cast<int64_t>(p[i]) >= lo && static_cast<int64_t>(p[i]) < hi;
  return ok;
}
