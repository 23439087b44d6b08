// x W^T with W as a GGUF file holds it: rows of quantization blocks (Q4_0, Q4_1, Q8_0),
// unpacked in registers, never dequantized into memory; and with W in bfloat16 (`BF16`:
// each weight widened to float32 in registers, so x stays float32).
//
// A decode step at batch 1 streams every weight once, so it runs at the speed memory
// delivers the weights: a Q4_1 weight is 5 bits against float32's 32. Each block holds 32
// consecutive weights of a row: an fp16 scale d (and for Q4_1 an fp16 min m) and the
// quants, so w = d * q (Q8_0), d * (q - 8) (Q4_0) or d * q + m (Q4_1). With x's block sums
// s_b = sum of x over block b computed once per call, one output is
//   sum_b d_b * (x_b . q_b) + m_b * s_b     (Q4_0: m_b = -8 d_b)
// in float32 throughout: the activations are not quantized (llama.cpp quantizes them to
// 8 bits), so the result is the dequantized weights' product up to summation order.
//
// Threads claim 16 output rows at a time (claim.h), computed in tiles of weight rows by
// rows of x (an accumulator register for each pair; `product`).
//
// AVX-512 only, as panel_linear.cpp: elsewhere `quant_supported` is false and the shards
// keep the float32 weights (shards/model/layers.py).
#include "ops.h"

#include "bias.h"
#include "claim.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum QuantType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kBF16 = 3 };
constexpr int64_t kBlock = 32;     // weights per block
constexpr int64_t kTaskRows = 16;  // output rows per claimed task

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;  // d, 16 bytes of nibbles
    case kQ4_1: return 20;  // d, m, 16 bytes of nibbles
    case kQ8_0: return 34;  // d, 32 int8
    case kBF16: return 64;  // 32 bfloat16, no scale
    default: return 0;
  }
}

#if defined(__AVX512F__)

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}


// The block's 32 quants as two vectors of 16 floats (weights 0-15, 16-31), and its d, m.
template <int64_t T>
inline void unpack(const uint8_t* blk, __m512& lo, __m512& hi, float& d, float& m) {
  if constexpr (T == kBF16) {  // the upper half of a float32: shift into place
    d = 1.0f;
    m = 0.0f;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32));
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    return;
  }
  d = half_at(blk);
  if constexpr (T == kQ8_0) {
    m = 0.0f;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    const uint8_t* qs = blk + (T == kQ4_1 ? 4 : 2);
    m = T == kQ4_1 ? half_at(blk + 2) : -8.0f * d;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
  }
}

// out[r, n:n+NR] for MR rows of x against NR consecutive weight rows from `w`: MR x NR
// independent accumulators, so no FMA waits on the one before it (one row against one
// weight row was a single chain, latency-bound), and each block of x is loaded once for
// NR weight rows, each unpacked block once for MR rows of x.
template <int64_t T, int MR, int NR>
inline void dot_tile(const float* x, int64_t K, const float* sums, int64_t nb, const uint8_t* w,
                     int64_t row_bytes, float* out, int64_t ldo, const float* bias) {
  __m512 acc[MR][NR];
  float mins[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      acc[r][n] = _mm512_setzero_ps();
      mins[r][n] = 0.0f;
    }
  constexpr int64_t bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ8_0 ? 34 : 64;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 lo[NR], hi[NR];
    float d[NR], m[NR];
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * bytes;
      // The next tile's same block, a tile ahead: rows of a few hundred bytes each end
      // before the hardware prefetcher ramps up (17.7 against 41.7 GB/s for oneDNN on a
      // bfloat16 weight past the cache, before this; benchmarks/NOTES.md 56).
      _mm_prefetch(reinterpret_cast<const char*>(blk + NR * row_bytes), _MM_HINT_T0);
      unpack<T>(blk, lo[n], hi[n], d[n], m[n]);
    }
    for (int r = 0; r < MR; ++r) {
      const float* xb = x + r * K + b * kBlock;
      const __m512 xlo = _mm512_loadu_ps(xb), xhi = _mm512_loadu_ps(xb + 16);
      for (int n = 0; n < NR; ++n) {
        if constexpr (T == kBF16) {
          acc[r][n] = _mm512_fmadd_ps(xhi, hi[n], _mm512_fmadd_ps(xlo, lo[n], acc[r][n]));
          continue;
        }
        const __m512 p = _mm512_fmadd_ps(xhi, hi[n], _mm512_mul_ps(xlo, lo[n]));
        acc[r][n] = _mm512_fmadd_ps(_mm512_set1_ps(d[n]), p, acc[r][n]);
        if constexpr (T != kQ8_0) mins[r][n] += m[n] * sums[r * nb + b];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n)
      out[r * ldo + n] = _mm512_reduce_add_ps(acc[r][n]) + mins[r][n] + (bias ? bias[n] : 0.0f);
}

template <int64_t T, int NR>
void dot_rows(int mr, const float* x, int64_t K, const float* sums, int64_t nb, const uint8_t* w,
              int64_t row_bytes, float* out, int64_t ldo, const float* bias) {
  switch (mr) {
    case 8: dot_tile<T, 8, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
    case 7: dot_tile<T, 7, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
    case 6: dot_tile<T, 6, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
    case 5: dot_tile<T, 5, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
    case 4: dot_tile<T, 4, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
    case 3: dot_tile<T, 3, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
    case 2: dot_tile<T, 2, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
    default: dot_tile<T, 1, NR>(x, K, sums, nb, w, row_bytes, out, ldo, bias); break;
  }
}

// Tiles of NR weight rows by up to MAXR rows of x: 4 by 4 for steps of up to 4 rows, 2
// by 8 beyond (16 accumulators either way): a weight block is unpacked once per MAXR rows.
template <int64_t T, int NR, int MAXR>
void product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
             int64_t N, const float* bias, float* out) {
  const int64_t nb = K / kBlock;
  std::vector<float> sums(M * nb, 0.0f);  // x's block sums (the min term)
  if (T == kQ4_0 || T == kQ4_1)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) s += x[r * K + b * kBlock + j];
        sums[r * nb + b] = s;
      }
  const int64_t tasks = (N + kTaskRows - 1) / kTaskRows;
  for_each_claimed(tasks, [&] {
    return [&](int64_t task) {
      const int64_t n1 = std::min(N, (task + 1) * kTaskRows);
      for (int64_t n = task * kTaskRows; n < n1; n += NR) {
        const bool whole = n + NR <= n1;
        for (int64_t r = 0; r < M; r += MAXR) {
          const int mr = static_cast<int>(std::min<int64_t>(MAXR, M - r));
          const float* b = bias ? bias + n : nullptr;
          if (whole) {
            dot_rows<T, NR>(mr, x + r * K, K, sums.data() + r * nb, nb, w + n * row_bytes,
                            row_bytes, out + r * N + n, N, b);
          } else {
            for (int64_t j = n; j < n1; ++j)
              dot_rows<T, 1>(mr, x + r * K, K, sums.data() + r * nb, nb, w + j * row_bytes,
                             row_bytes, out + r * N + j, N, bias ? bias + j : nullptr);
          }
        }
      }
    };
  });
}

#endif  // __AVX512F__

}  // namespace

bool quant_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor linear_quant(at::Tensor x, at::Tensor weight, int64_t type, int64_t out_features,
                        std::optional<at::Tensor> bias) {
  TORCH_CHECK(quant_supported(), "linear_quant: built without AVX-512");
  TORCH_CHECK(block_bytes(type) > 0, "linear_quant: unknown quantization type ", type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_quant: 2-d float32 x");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "linear_quant: ", K, " input features are not whole blocks");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(0) == out_features &&
                  weight.size(1) == K / kBlock * block_bytes(type),
              "linear_quant: weight ", weight.sizes(), " is not ", out_features, " rows of ",
              K / kBlock, " blocks");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor out = at::empty({M, out_features}, xc.options());
  at::Tensor bc;
  const float* b = bias_data(bias, out_features, "linear_quant", bc);
  if (M == 0) return out;
#if defined(__AVX512F__)
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = weight.size(1);
  const bool few = M <= 4;
  switch (type) {
    case kQ4_0:
      few ? product<kQ4_0, 4, 4>(xp, M, K, wp, row_bytes, out_features, b, op)
          : product<kQ4_0, 2, 8>(xp, M, K, wp, row_bytes, out_features, b, op);
      break;
    case kQ4_1:
      few ? product<kQ4_1, 4, 4>(xp, M, K, wp, row_bytes, out_features, b, op)
          : product<kQ4_1, 2, 8>(xp, M, K, wp, row_bytes, out_features, b, op);
      break;
    case kQ8_0:
      few ? product<kQ8_0, 4, 4>(xp, M, K, wp, row_bytes, out_features, b, op)
          : product<kQ8_0, 2, 8>(xp, M, K, wp, row_bytes, out_features, b, op);
      break;
    default:
      few ? product<kBF16, 4, 4>(xp, M, K, wp, row_bytes, out_features, b, op)
          : product<kBF16, 2, 8>(xp, M, K, wp, row_bytes, out_features, b, op);
      break;
  }
#endif
  return out;
}
