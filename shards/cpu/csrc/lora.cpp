// LoRA deltas of a step's rows in one pass: each row dotted with its own adapter's A rows
// (a few), then those sums times its B rows, added to the row's output. The torch path runs
// three ops over every adapter (or two per prefill run); their dispatch cost more than the
// arithmetic at decode sizes (benchmarks/NOTES.md 62). fp32, rows split across threads.
#include "ops.h"

#include <ATen/Parallel.h>

#include <vector>

namespace {
constexpr int64_t kGrain = 8;
constexpr int64_t kMaxRank = 1024;  // a merged layer's parts' ranks together
}  // namespace

// y[r] += (x[r] A[:, c0:c1]) B[c0:c1] for each row r, (c0, c1) = columns[r] (c0 == c1:
// the base model, nothing added). x: M x K, a_rows: room x K (A stacked),
// b_rows: room x N (B^T stacked, the scale folded in), y: M x N with rows contiguous.
void lora_add(at::Tensor x, at::Tensor y, at::Tensor a_rows, at::Tensor b_rows,
              at::Tensor columns) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
              y.scalar_type() == at::kFloat && y.dim() == 2 &&
              a_rows.scalar_type() == at::kFloat && b_rows.scalar_type() == at::kFloat,
              "lora_add: float32 CPU matrices");
  TORCH_CHECK(columns.scalar_type() == at::kLong && columns.dim() == 2 &&
              columns.size(1) == 2 && columns.size(0) == x.size(0) && y.size(0) == x.size(0),
              "lora_add: one (first, end) column pair per row");
  x = x.contiguous();
  a_rows = a_rows.contiguous();
  b_rows = b_rows.contiguous();
  columns = columns.contiguous();
  TORCH_CHECK(y.stride(1) == 1, "lora_add: y's rows must be contiguous");
  const int64_t rows = x.size(0), k = x.size(1), n = y.size(1), room = a_rows.size(0);
  TORCH_CHECK(a_rows.size(1) == k && b_rows.size(1) == n,
              "lora_add: A is room x K and B^T room x N");
  const float* xp = x.data_ptr<float>();
  const float* a = a_rows.data_ptr<float>();
  const float* b = b_rows.data_ptr<float>();
  const int64_t* cols = columns.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  const int64_t y_stride = y.stride(0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c0 = cols[2 * r], c1 = cols[2 * r + 1];
    TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= room && c1 - c0 <= kMaxRank,
                "lora_add: row ", r, "'s columns ", c0, ":", c1, " are not within ", room);
  }
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> t(kMaxRank);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t c0 = cols[2 * r], rank = cols[2 * r + 1] - c0;
      if (rank == 0) continue;
      float* tp = t.data();
      const float* xr = xp + r * k;
      for (int64_t j = 0; j < rank; ++j) {
        const float* aj = a + (c0 + j) * k;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < k; ++i) s += xr[i] * aj[i];
        tp[j] = s;
      }
      float* yr = yp + r * y_stride;
      for (int64_t j = 0; j < rank; ++j) {
        const float tj = tp[j];
        const float* bj = b + (c0 + j) * n;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) yr[c] += tj * bj[c];
      }
    }
  });
}
