// The small ops of a decoder layer, each in one pass over its rows: eager torch runs them
// as 5-7 ops apiece (an allocation and a dispatch each), which costs more than the
// arithmetic at every size a step has (benchmarks/NOTES.md 44). Same formulas and, where
// the order of operations allows, the same rounding as shards/model/layers.py's torch path.
#include "ops.h"

#include "bounds.h"
#include "exp.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

// Rows per task: up to 16 rows run on the calling thread, more split across threads.
constexpr int64_t kGrain = 16;

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2,
              what, ": a float32 CPU matrix");
}

}  // namespace

// s = x + residual (x alone without one); out = weight * (s / sqrt(mean(s^2) + eps)).
// Returns {out, s}: s is the next layer's residual. Only the sum of squares differs from
// torch's `pow(2).mean(-1)` in the order of its additions (a few ulp of the variance).
std::vector<at::Tensor> add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm");
  x = x.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == n,
              "add_rms_norm: one float32 weight per column");
  weight = weight.contiguous();
  const bool add = residual.has_value();
  at::Tensor res = x, sum = x;
  if (add) {
    check_rows(*residual, "add_rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_rms_norm: residual of x's shape");
    res = residual->contiguous();
    sum = at::empty_like(x);
  }
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = res.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps), count = static_cast<float>(n);
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * n;
      if (add) {
        const float* a = xp + r * n;
        const float* b = rp + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) s[i] = a[i] + b[i];
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) squares += s[i] * s[i];
      const float inv = 1.f / std::sqrt(squares / count + feps);
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (s[i] * inv);
    }
  });
  return {out, sum};
}

// RoPE without fused multiply-adds, so each element rounds as torch's
// `x * cos + rotate_half(x) * sin` does (two products, then their sum): bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

void rotate_heads(const float* x, float* out, int64_t heads, int64_t head_dim,
                  const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h, x += head_dim, out += head_dim) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i] * cos[i], b = -x[i + half] * sin[i];
      out[i] = a + b;
    }
#pragma omp simd
    for (int64_t i = half; i < head_dim; ++i) {
      const float a = x[i] * cos[i], b = x[i - half] * sin[i];
      out[i] = a + b;
    }
  }
}

}  // namespace
#pragma GCC pop_options

// qkv: [T, (H + 2 KVH) * D], a row per token (q heads, then k, then v); positions: [T];
// cos, sin: [max_position, D]. Returns q [T, H, D] and k [T, KVH, D], rotated; v is left
// in place for the caller to view.
std::vector<at::Tensor> rotary_qk(at::Tensor qkv, at::Tensor positions,
                                  at::Tensor cos, at::Tensor sin, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim) {
  check_rows(qkv, "rotary_qk");
  TORCH_CHECK(qkv.stride(1) == 1, "rotary_qk: qkv rows must be contiguous");
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rotary_qk: qkv holds (heads + 2 kv_heads) * head_dim columns");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == head_dim,
              "rotary_qk: float32 cos and sin tables [max_position, head_dim]");
  const int64_t tokens = qkv.size(0), stride = qkv.stride(0);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens, "rotary_qk: one position per row");
  positions = positions.to(at::kLong).contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  auto k = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  if (tokens == 0) return {q, k};
  // Table reads go through these: check them once rather than per token.
  TORCH_CHECK(all_within<int64_t>(positions, 0, cos.size(0)),
              "rotary_qk: a position is outside the rotary table");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* src = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t q_width = num_heads * head_dim, k_width = num_kv_heads * head_dim;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = src + t * stride;
      const float* ct = c + pos[t] * head_dim;
      const float* st = s + pos[t] * head_dim;
      rotate_heads(row, qp + t * q_width, num_heads, head_dim, ct, st);
      rotate_heads(row + q_width, kp + t * k_width, num_kv_heads, head_dim, ct, st);
    }
  });
  return {q, k};
}

// silu(gate) * up for a gate_up row [gate | up] (the MLP's fused projection): one pass
// and one output, in place of chunk, silu and mul (three dispatches, an intermediate, and
// torch's thread team twice). silu(g) = g / (1 + exp(-g)) with the same operations as
// torch's; the exponential is a polynomial here (below), within a few ulp of torch's.
namespace {

#if defined(__AVX512F__)
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                                    : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    // Lanes past the row's end: masked off (a mask lane is on where its sign bit is set).
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(8, n - i))),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 g = _mm256_maskload_ps(gate + i, m);
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(s, _mm256_maskload_ps(up + i, m)));
  }
}
#else
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}
#endif

}  // namespace

at::Tensor silu_mul(at::Tensor gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: [gate | up] rows of even width");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_mul_row(src + r * 2 * n, src + r * 2 * n + n, dst + r * n, n);
  });
  return out;
}

// k_cache[slot] = k[t] and v_cache[slot] = v[t] for slot = slots[t]: the new tokens' keys
// and values into the paged cache, one copy per token for both, in place of two
// index_copy_ calls (each a dispatch, a TensorIterator and a thread team).
namespace {

// n floats into a float16 cache row, rounded to nearest even (as torch's .half()).
inline void narrow_row(const float* src, int64_t n, c10::Half* dst) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

}  // namespace

void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slots) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf) &&
                  k.device().is_cpu() && k_cache.device().is_cpu(),
              "write_kv: float32 k and v, float32 or float16 caches, on CPU");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.numel() % (k.size(1) * k.size(2)) == 0,
              "write_kv: k, v [T, KVH, D] and contiguous caches of [KVH, D] rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.size(0) == k.size(0),
              "write_kv: one int64 slot per token");
  const int64_t tokens = k.size(0), width = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.numel() / width;
  slots = slots.contiguous();
  TORCH_CHECK(all_within<int64_t>(slots, 0, num_slots), "write_kv: a slot is outside the cache");
  k = k.contiguous();
  v = v.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  if (k_cache.scalar_type() == at::kHalf) {
    c10::Half* kc = k_cache.data_ptr<c10::Half>();
    c10::Half* vc = v_cache.data_ptr<c10::Half>();
    for (int64_t t = 0; t < tokens; ++t) {
      narrow_row(kp + t * width, width, kc + slot[t] * width);
      narrow_row(vp + t * width, width, vc + slot[t] * width);
    }
    return;
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy_n(kp + t * width, width, kc + slot[t] * width);
    std::copy_n(vp + t * width, width, vc + slot[t] * width);
  }
}
