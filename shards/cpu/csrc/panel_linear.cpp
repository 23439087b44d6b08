// x W^T for steps of a few rows, on a copy of W cut into 64-column panels whose threads
// claim them one at a time.
//
// oneDNN splits each product across torch's threads in fixed shares, so when another
// process preempts one thread the other waits for it at the end of every product; on a
// 2-core machine the serving plane preempts them every few milliseconds (benchmarks/
// NOTES.md 45-46). Here each thread takes the next panel from a shared counter, so the
// thread left running does the preempted one's share. The copy is laid out for that:
// panel p holds columns [64p, 64p + 64) of W^T, K rows of 64 floats, contiguous, so one
// panel streams from memory in one pass. Rows are computed in blocks of at most 6 (6 x 4
// accumulators in registers), K in slices of 128 so that a slice of the panel stays in L1
// while every row block uses it, the first block prefetching the next slice into L2; one
// row streams the whole panel without slicing.
//
// AVX-512 only (the build is -march=native): elsewhere `panels_supported` is false and the
// shards keep oneDNN and the plain K x N copy (shards/model/layers.py).
#include "ops.h"

#include "bias.h"
#include "claim.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 64;    // columns per panel: 4 zmm registers
constexpr int64_t kSlice = 128;   // K rows of a panel per pass over the row blocks
constexpr int64_t kMaxBlock = 6;  // rows per register block

#if defined(__AVX512F__)

struct Masks {
  __mmask16 m[4];
  explicit Masks(int64_t cols) {
    for (int j = 0; j < 4; ++j) {
      const int64_t n = std::clamp<int64_t>(cols - 16 * j, 0, 16);
      m[j] = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    }
  }
};

// acc[r][:] += x[r, k] * panel[k, :] for the MR rows of a block.
template <int MR>
inline void fma_step(__m512 (&acc)[MR][4], const float* x, int64_t ldx, int64_t k,
                     const float* w) {
  const __m512 w0 = _mm512_load_ps(w), w1 = _mm512_load_ps(w + 16),
               w2 = _mm512_load_ps(w + 32), w3 = _mm512_load_ps(w + 48);
  for (int r = 0; r < MR; ++r) {
    const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
    acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    acc[r][2] = _mm512_fmadd_ps(xr, w2, acc[r][2]);
    acc[r][3] = _mm512_fmadd_ps(xr, w3, acc[r][3]);
  }
}

// out[r, :64] = (first ? bias : out[r, :64]) + x[r, k0:k1] . panel[k0:k1, :] for MR rows.
// The first `next_rows` k steps also prefetch one K row each of the panel's next slice
// (`next`) into L2; the rest run without that test in the loop, unrolled by two (7-10%
// faster at 64-256 rows than one loop that tests every step; NOTES.md 47).
template <int MR>
void row_block(const float* x, int64_t ldx, int64_t k0, int64_t k1, const float* panel,
               float* out, int64_t ldo, const Masks& mk, bool first, const float* bias,
               const float* next, int64_t next_rows) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = first ? (bias ? _mm512_maskz_loadu_ps(mk.m[j], bias + 16 * j)
                                : _mm512_setzero_ps())
                        : _mm512_maskz_loadu_ps(mk.m[j], out + r * ldo + 16 * j);
  const float* w = panel + k0 * kPanel;
  int64_t k = k0;
  for (const char* line = reinterpret_cast<const char*>(next); k < k0 + next_rows;
       ++k, w += kPanel, line += kPanel * sizeof(float)) {
    for (int j = 0; j < 4; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T1);  // its 4 cache lines
    fma_step<MR>(acc, x, ldx, k, w);
  }
#pragma GCC unroll 2
  for (; k < k1; ++k, w += kPanel) fma_step<MR>(acc, x, ldx, k, w);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(out + r * ldo + 16 * j, mk.m[j], acc[r][j]);
}

// One row: nothing to reuse, so the panel streams once with four k steps in flight (one
// chain of FMAs would wait on its own latency).
void one_row(const float* x, int64_t K, const float* panel, float* out, const Masks& mk,
             const float* bias) {
  __m512 acc[4][4];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const float* w = panel;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4, w += 4 * kPanel)
    for (int u = 0; u < 4; ++u) {
      const __m512 xk = _mm512_set1_ps(x[k + u]);
      for (int j = 0; j < 4; ++j)
        acc[u][j] = _mm512_fmadd_ps(xk, _mm512_load_ps(w + u * kPanel + 16 * j), acc[u][j]);
    }
  for (; k < K; ++k, w += kPanel) {
    const __m512 xk = _mm512_set1_ps(x[k]);
    for (int j = 0; j < 4; ++j)
      acc[0][j] = _mm512_fmadd_ps(xk, _mm512_load_ps(w + 16 * j), acc[0][j]);
  }
  for (int j = 0; j < 4; ++j) {
    __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]),
                               _mm512_add_ps(acc[2][j], acc[3][j]));
    if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mk.m[j], bias + 16 * j));
    _mm512_mask_storeu_ps(out + 16 * j, mk.m[j], sum);
  }
}

void rows(int64_t mr, const float* x, int64_t K, int64_t k0, int64_t k1, const float* panel,
          float* out, int64_t N, const Masks& mk, bool first, const float* bias,
          const float* next, int64_t next_rows) {
  switch (mr) {
    case 6: row_block<6>(x, K, k0, k1, panel, out, N, mk, first, bias, next, next_rows); break;
    case 5: row_block<5>(x, K, k0, k1, panel, out, N, mk, first, bias, next, next_rows); break;
    case 4: row_block<4>(x, K, k0, k1, panel, out, N, mk, first, bias, next, next_rows); break;
    case 3: row_block<3>(x, K, k0, k1, panel, out, N, mk, first, bias, next, next_rows); break;
    case 2: row_block<2>(x, K, k0, k1, panel, out, N, mk, first, bias, next, next_rows); break;
    default: row_block<1>(x, K, k0, k1, panel, out, N, mk, first, bias, next, next_rows); break;
  }
}

// Every row of x against panel p: out[:, 64p : 64p + 64].
void panel_product(const float* x, int64_t M, int64_t K, const float* panel, float* out,
                   int64_t N, int64_t p, const float* bias) {
  const Masks mk(std::min(kPanel, N - p * kPanel));
  const float* b = bias ? bias + p * kPanel : nullptr;
  float* o = out + p * kPanel;
  if (M == 1) {
    one_row(x, K, panel, o, mk, b);
    return;
  }
  // Blocks as even as they can be (32 rows: 6, 6, 5, 5, 5, 5): a lone short block wastes
  // most of its registers' FMAs.
  // The first row block of each slice also prefetches the next slice into L2: without it
  // every slice's first block waits on memory (the hardware prefetcher stops at each 4 KB
  // page), which cost 15-20% at 8-32 rows (benchmarks/NOTES.md 47).
  const int64_t blocks = (M + kMaxBlock - 1) / kMaxBlock;
  for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
    const int64_t k1 = std::min(K, k0 + kSlice);
    const int64_t next_rows = std::min(K, k1 + kSlice) - k1;
    for (int64_t i = 0, r = 0; i < blocks; ++i) {
      const int64_t mr = M / blocks + (i < M % blocks ? 1 : 0);
      rows(mr, x + r * K, K, k0, k1, panel, o + r * N, N, mk, k0 == 0, b,
           panel + k1 * kPanel, i == 0 ? next_rows : 0);
      r += mr;
    }
  }
}

#endif  // __AVX512F__

}  // namespace

bool panels_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(panels_supported(), "pack_panels: built without AVX-512");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && !weight.is_cuda(),
              "pack_panels: a 2-d float32 CPU weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  // Columns past N (the last panel's) are zeros: they are computed and never stored.
  at::Tensor panels = at::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t n = 0; n < kPanel && p * kPanel + n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          dst[(p * K + k) * kPanel + n] = src[(p * kPanel + n) * K + k];
  });
  return panels;
}

at::Tensor linear_panels(at::Tensor x, at::Tensor panels, int64_t out_features,
                         std::optional<at::Tensor> bias) {
  TORCH_CHECK(panels_supported(), "linear_panels: built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_panels: 2-d float32 x");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.size(1) == x.size(1) &&
                  panels.size(0) * kPanel >= out_features && panels.is_contiguous(),
              "linear_panels: panels do not match x (", x.sizes(), ") and ", out_features,
              " output features");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0,
              "linear_panels: panels must start on a 64-byte boundary (as pack_panels makes them)");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = (out_features + kPanel - 1) / kPanel;
  at::Tensor out = at::empty({M, out_features}, xc.options());
  at::Tensor bc;
  const float* b = bias_data(bias, out_features, "linear_panels", bc);
  if (M == 0) return out;
#if defined(__AVX512F__)
  const float* xp = xc.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_claimed(P, [&] {
    return [&](int64_t p) { panel_product(xp, M, K, wp + p * K * kPanel, op, out_features, p, b); };
  });
#endif
  return out;
}
