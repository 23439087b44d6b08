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
// Built for AVX-512, or for AVX2 with FMA and F16C (the AMD EPYC and older Intel kinds these
// machines come in): there each block is unpacked in 4 vectors of 8, dequantized in
// registers (w = d * q + m, one FMA) where a chunk serves several rows of x, and scaled
// once per block as above for one row (a decode step's), where the FMAs bound it. Elsewhere
// `quant_supported` is false and the shards keep the float32 weights (shards/model/layers.py).
// The same with x rounded to int8 blocks: quant_linear_i8.cpp. With float x, the blocks of
// weights whose rows come in groups of 8 are laid out again and multiplied by
// quant_lanes.cpp; these tiles serve the rest.
#include "ops.h"

#include "quant.h"

namespace {

#if defined(RAYGEN_QUANT_FLOAT)

#if defined(__AVX512F__)

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

#else  // AVX2, FMA, F16C

// A block's d and m (w = d * q + m; Q4_0: m = -8 d; Q8_0: m = 0; bfloat16: d = 1, m = 0).
template <int64_t T>
inline void scales(const uint8_t* blk, float& d, float& m) {
  if constexpr (T == kBF16) {
    d = 1.0f;
    m = 0.0f;
  } else {
    d = half_at(blk);
    m = T == kQ4_1 ? half_at(blk + 2) : T == kQ4_0 ? -8.0f * d : 0.0f;
  }
}

// Weights 8c .. 8c+7 of a block, dequantized. Q4 blocks hold weight j in byte j's low
// nibble and weight j + 16 in its high one, so chunks 0 and 1 are low nibbles, 2 and 3 high.
template <int64_t T>
inline __m256 weights8(const uint8_t* blk, int c, float d, float m) {
  if constexpr (T == kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (T == kQ8_0) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * c));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(d));
  } else {
    const uint8_t* qs = blk + (T == kQ4_1 ? 4 : 2) + 8 * (c & 1);
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs));
    if (c >= 2) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_set1_ps(d),
                           _mm256_set1_ps(m));
  }
}

// d and m of block `blk` in each of NR weight rows, asking for a later tile's block.
template <int64_t T, int NR>
inline void block_scales(const uint8_t* blk, int64_t row_bytes, float (&d)[NR], float (&m)[NR]) {
  for (int n = 0; n < NR; ++n) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + (n + rows_ahead<NR>()) * row_bytes),
                 _MM_HINT_T0);
    scales<T>(blk + n * row_bytes, d[n], m[n]);
  }
}

// A block's d and m as vectors of 8; a Q4_1 block's two halves side by side in one
// conversion. In registers, where scalars kept in arrays per tile went through memory:
// one-row steps 0.85-0.90x the time (benchmarks/NOTES.md 73).
template <int64_t T>
inline void scale_vectors(const uint8_t* blk, __m256& d, __m256& m) {
  if constexpr (T == kQ4_1) {
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
    d = _mm256_broadcastss_ps(v);
    m = _mm256_broadcastss_ps(_mm_movehdup_ps(v));
  } else {
    const float s = half_at(blk);
    d = _mm256_set1_ps(s);
    m = _mm256_set1_ps(T == kQ4_0 ? -8.0f * s : 0.0f);
  }
}

// x_b . q_b for one block of one weight row, the quants not yet scaled (the one-row tile
// below scales per block), x's block given as its 4 chunks of 8. A Q4 block's 16 bytes are
// loaded once and split into low nibbles (weights 0-15) and high ones (16-31): 33
// instructions a block and row where loading 8 bytes per chunk took 41, and one-row steps
// on SmolLM2's Q4_1 file 0.84-0.88x the time (benchmarks/NOTES.md 73).
template <int64_t T>
inline __m256 block_dot(const uint8_t* blk, const __m256 (&xv)[4]) {
  const auto widen = [](__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); };
  if constexpr (T == kQ8_0) {
    __m256 p = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * c));
      p = _mm256_fmadd_ps(xv[c], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), p);
    }
    return p;
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    __m256 p = _mm256_mul_ps(xv[0], widen(lo));
    p = _mm256_fmadd_ps(xv[1], widen(_mm_unpackhi_epi64(lo, lo)), p);
    p = _mm256_fmadd_ps(xv[2], widen(hi), p);
    return _mm256_fmadd_ps(xv[3], widen(_mm_unpackhi_epi64(hi, hi)), p);
  }
}

// As the AVX-512 tile above, on vectors of 8: MR x NR accumulators, each dequantized chunk
// of 8 weights used for MR rows of x, each chunk of x for NR weight rows.
template <int64_t T, int MR, int NR>
inline void dot_tile(const float* x, int64_t K, const float* /*sums*/, int64_t nb,
                     const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo,
                     const float* bias) {
  constexpr int64_t bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ8_0 ? 34 : 64;
  if constexpr (MR == 1 && T != kBF16) {
    // One row of x (a decode step's): x_b . w_b = d (x_b . q_b) + m sum(x_b), so a block's
    // quants meet x without being dequantized, and d and m are applied once per block:
    // one FMA per 8 weights instead of two.
    __m256 acc[NR];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 xv[4];
      for (int c = 0; c < 4; ++c) xv[c] = _mm256_loadu_ps(x + b * kBlock + 8 * c);
      const __m256 xs = _mm256_add_ps(_mm256_add_ps(xv[0], xv[1]), _mm256_add_ps(xv[2], xv[3]));
      for (int n = 0; n < NR; ++n) {
        const uint8_t* blk = w + n * row_bytes + b * bytes;
        _mm_prefetch(reinterpret_cast<const char*>(blk + rows_ahead<NR>() * row_bytes),
                     _MM_HINT_T0);
        __m256 d, m;
        scale_vectors<T>(blk, d, m);
        acc[n] = _mm256_fmadd_ps(d, block_dot<T>(blk, xv), acc[n]);
        if constexpr (T != kQ8_0) acc[n] = _mm256_fmadd_ps(m, xs, acc[n]);
      }
    }
    for (int n = 0; n < NR; ++n) out[n] = hsum(acc[n]) + (bias ? bias[n] : 0.0f);
    return;
  }
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    float d[NR], m[NR];
    block_scales<T, NR>(w + b * bytes, row_bytes, d, m);
    for (int c = 0; c < 4; ++c) {
      __m256 wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = weights8<T>(w + n * row_bytes + b * bytes, c, d[n], m[n]);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + b * kBlock + 8 * c);
        for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_fmadd_ps(xv, wv[n], acc[r][n]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n)
      out[r * ldo + n] = hsum(acc[r][n]) + (bias ? bias[n] : 0.0f);
}

#endif  // __AVX512F__

// Tiles of NR weight rows by up to MAXR rows of x: 4 by 4 for steps of up to 4 rows, 2
// by 8 beyond (16 accumulators either way): a weight block is unpacked once per MAXR rows.
template <int64_t T, int NR, int MAXR>
void product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
             int64_t N, const float* bias, float* out) {
  const int64_t nb = K / kBlock;
  std::vector<float> sums(M * nb, 0.0f);  // x's block sums (the min term; AVX-512's tile)
#if defined(__AVX512F__)
  if (T == kQ4_0 || T == kQ4_1)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) s += x[r * K + b * kBlock + j];
        sums[r * nb + b] = s;
      }
#endif
  over_tiles<NR, MAXR>(M, N, [&](auto mr, auto nr, int64_t r, int64_t n) {
    dot_tile<T, decltype(mr)::value, decltype(nr)::value>(
        x + r * K, K, sums.data() + r * nb, nb, w + n * row_bytes, row_bytes, out + r * N + n,
        N, bias ? bias + n : nullptr);
  });
}

#endif  // RAYGEN_QUANT_FLOAT

}  // namespace

bool quant_supported() {
#if defined(RAYGEN_QUANT_FLOAT)
  return true;
#else
  return false;
#endif
}

at::Tensor linear_quant(at::Tensor x, at::Tensor weight, int64_t type, int64_t out_features,
                        std::optional<at::Tensor> bias) {
  TORCH_CHECK(quant_supported(), "linear_quant: built without AVX-512 or AVX2 with FMA");
  Call c = check_call("linear_quant", x, weight, type, out_features, bias);
  if (c.M == 0) return c.out;
#if defined(RAYGEN_QUANT_FLOAT)
  const auto run = [&](auto t, auto nr, auto maxr) {
    product<decltype(t)::value, decltype(nr)::value, decltype(maxr)::value>(
        c.x.data_ptr<float>(), c.M, c.K, weight.data_ptr<uint8_t>(), c.row_bytes, out_features,
        c.bias, c.out.data_ptr<float>());
  };
  switch (type) {
    case kQ4_0: with_tile<kQ4_0>(c.M, run); break;
    case kQ4_1: with_tile<kQ4_1>(c.M, run); break;
    case kQ8_0: with_tile<kQ8_0>(c.M, run); break;
    default: with_tile<kBF16>(c.M, run); break;
  }
#endif
  return c.out;
}
