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
// machines come in): there each block is unpacked in 4 vectors of 8 and dequantized in
// registers (w = d * q + m, one FMA), so x's block sums are not needed. Elsewhere
// `quant_supported` is false and the shards keep the float32 weights (shards/model/layers.py).
// The int8 products (`linear_quant_i8`) need AVX-512 VNNI, or AVX2 with FMA and F16C.
#include "ops.h"

#include "bias.h"
#include "claim.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define RAYGEN_QUANT_FLOAT 1
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

#if defined(RAYGEN_QUANT_FLOAT)

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The sum of a vector's 8 floats (the AVX2 tiles', float and int8).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

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

// As the AVX-512 tile above, on vectors of 8: MR x NR accumulators, each dequantized chunk
// of 8 weights used for MR rows of x, each chunk of x for NR weight rows.
template <int64_t T, int MR, int NR>
inline void dot_tile(const float* x, int64_t K, const float* /*sums*/, int64_t nb,
                     const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo,
                     const float* bias) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_setzero_ps();
  constexpr int64_t bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ8_0 ? 34 : 64;
  for (int64_t b = 0; b < nb; ++b) {
    float d[NR], m[NR];
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + NR * row_bytes), _MM_HINT_T0);
      scales<T>(blk, d[n], m[n]);
    }
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

template <int V>
using Int = std::integral_constant<int, V>;

// run(MR) with the step's row count as a constant: each tile shape compiles on its own.
template <typename Run>
void with_rows(int mr, Run&& run) {
  switch (mr) {
    case 8: run(Int<8>{}); break;
    case 7: run(Int<7>{}); break;
    case 6: run(Int<6>{}); break;
    case 5: run(Int<5>{}); break;
    case 4: run(Int<4>{}); break;
    case 3: run(Int<3>{}); break;
    case 2: run(Int<2>{}); break;
    default: run(Int<1>{}); break;
  }
}

// tile(MR, NR', r, n) for every tile of out[M, N]: threads claim 16 output rows at a time
// (claim.h), cut into tiles of NR weight rows (the last ones of a task one at a time,
// NR' = 1) by up to MAXR rows of x, as even as they go: 9 rows as 5 + 4, not 8 + 1, whose
// one-row tile has a single chain of FMAs, each waiting on the one before.
template <int NR, int MAXR, typename Tile>
void over_tiles(int64_t M, int64_t N, Tile&& tile) {
  const int64_t tasks = (N + kTaskRows - 1) / kTaskRows;
  const int64_t x_tiles = (M + MAXR - 1) / MAXR;
  const int64_t per_tile = (M + x_tiles - 1) / x_tiles;
  for_each_claimed(tasks, [&] {
    return [&](int64_t task) {
      const int64_t n1 = std::min(N, (task + 1) * kTaskRows);
      for (int64_t n = task * kTaskRows; n < n1; n += NR) {
        const bool whole = n + NR <= n1;
        for (int64_t r = 0; r < M; r += per_tile) {
          with_rows(static_cast<int>(std::min<int64_t>(per_tile, M - r)), [&](auto mr) {
            if (whole) {
              tile(mr, Int<NR>{}, r, n);
            } else {
              for (int64_t j = n; j < n1; ++j) tile(mr, Int<1>{}, r, j);
            }
          });
        }
      }
    };
  });
}

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


// x's rows as int8 blocks for the int8 products below: quants, dx and dx * the block's sum.
struct XQuant {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

#if defined(__AVX512VNNI__)
// The int8 products (`linear_quant_i8`), as llama.cpp multiplies: each row of x quantized
// to int8 in blocks of 32 (a scale dx = max|x| / 127 per block), and each block's dot
// product taken in integers by VNNI (vpdpbusd: unsigned 8-bit weights by signed 8-bit x,
// four products summed into each 32-bit lane). A weight block's quants are made unsigned
// (Q4: 0..15 already; Q8_0: q + 128) and the offset is taken back with x's block sum:
//   x_b . w_b = dw dx (sum u q_x) + (m - off dw) dx (sum q_x),   off = 0 | 8 | 128
// with m = 0 but for Q4_1. Faster than unpacking to float32 (one integer instruction per
// 64 weights against four float ones per 16), at the cost of x's rounding to 8 bits.

// For Q4 weights each pair of blocks is stored as [b lo | b+1 lo | b hi | b+1 hi] (16
// quants each: a block's first and last 16), the order in which a pair of weight blocks'
// nibbles unpack with the fewest instructions (`unpack_pair`); an odd last block, and
// every block for Q8_0, in x's own order.
XQuant quantize_x(const float* x, int64_t M, int64_t K, bool pair_order) {
  const int64_t nb = K / kBlock;
  XQuant xq{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      int8_t* row = xq.q.data() + r * K;
      int8_t* first = row + b * kBlock;
      int8_t* last = first + 16;
      if (pair_order && b + 1 - b % 2 < nb) {  // in a whole pair
        const int64_t pair = b - b % 2;
        first = row + pair * kBlock + (b % 2) * 16;
        last = first + 32;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(last), _mm512_cvtsepi32_epi8(qhi));
      xq.d[r * nb + b] = d;
      xq.s[r * nb + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
  return xq;
}

// A pair's product lanes (4 bytes each): Q8_0 has block b in lanes 0-7, b+1 in 8-15; the
// Q4 pair order has b in lanes 0-3 and 8-11. `lanes<T>(k, f)`: f's element k (block b's)
// and k + 2 (block b+1's) spread over their lanes.
template <int64_t T>
inline __m512 lanes(int k, __m512 f) {
  const int a = k, b = k + 2;
  const __m512i idx = T == kQ8_0
      ? _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a)
      : _mm512_set_epi32(b, b, b, b, a, a, a, a, b, b, b, b, a, a, a, a);
  return _mm512_permutexvar_ps(idx, f);
}

template <int64_t T>
inline __m512 pair_of(float a, float b) {  // a in block b's lanes, b in block b+1's
  return lanes<T>(0, _mm512_castps128_ps512(_mm_set_ps(0.0f, b, 0.0f, a)));
}

template <int64_t T>
constexpr int64_t kBytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34;

// The offset term of each weight block, c = m - off * dw (see above), from its dw (and m).
template <int64_t T>
inline __m512 offset_term(__m512 dw, __m512 m) {
  if constexpr (T == kQ4_1) return m;
  return _mm512_mul_ps(dw, _mm512_set1_ps(T == kQ4_0 ? -8.0f : -128.0f));
}

// Blocks b and b+1 of a weight row: their 64 quants as unsigned bytes, in the order
// quantize_x puts x's pair in; each block's dw in its product lanes (`lanes`); and the
// offset terms likewise, over 8 (each is added in each of its 8 lanes, then lanes summed).
template <int64_t T>
inline void unpack_pair(const uint8_t* blk, __m512i& q, __m512& dw, __m512& c8) {
  constexpr int64_t bytes = kBytes<T>;
  int32_t h0, h1;  // d (and m, for Q4_1) of each block, as fp16 pairs
  std::memcpy(&h0, blk, 4);
  std::memcpy(&h1, blk + bytes, 4);
  const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, h1, h0)));
  dw = lanes<T>(0, f);
  const __m512 m = lanes<T>(1, f);
  c8 = _mm512_mul_ps(offset_term<T>(dw, m), _mm512_set1_ps(0.125f));
  if constexpr (T == kQ8_0) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + bytes + 2));
    q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1),
                         _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    constexpr int64_t at = T == kQ4_1 ? 4 : 2;
    const __m256i both = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + at))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + bytes + at)), 1);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(both, mask)),
                           _mm256_and_si256(_mm256_srli_epi16(both, 4), mask), 1);
  }
}

// One block (an odd last one): its 32 quants unsigned, in x's order; dw and c.
template <int64_t T>
inline __m256i unpack_u8(const uint8_t* blk, float& dw, float& c) {
  dw = half_at(blk);
  if constexpr (T == kQ8_0) {
    c = -128.0f * dw;
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    c = T == kQ4_1 ? half_at(blk + 2) : -8.0f * dw;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
  }
}


// out[r, n:n+NR] for MR rows of x against NR weight rows, two blocks per 512-bit product.
template <int64_t T, int MR, int NR>
inline void dot_tile_i8(const XQuant& xq, int64_t r0, int64_t K, int64_t nb, const uint8_t* w,
                        int64_t row_bytes, float* out, int64_t ldo, const float* bias) {
  constexpr int64_t bytes = kBytes<T>;
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = _mm512_setzero_ps();
  const int8_t* xq_rows = xq.q.data() + r0 * K;
  const float* dxs = xq.d.data() + r0 * nb;
  const float* sxs = xq.s.data() + r0 * nb;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i wq[NR];
    __m512 dw[NR], c8[NR];
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + NR * row_bytes), _MM_HINT_T0);
      unpack_pair<T>(blk, wq[n], dw[n], c8[n]);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq_rows + r * K + b * kBlock);
      const __m512 dx = pair_of<T>(dxs[r * nb + b], dxs[r * nb + b + 1]);
      const __m512 sx = pair_of<T>(sxs[r * nb + b], sxs[r * nb + b + 1]);
      for (int n = 0; n < NR; ++n) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[n], xv);
        acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[n], dx), acc[r][n]);
        acc[r][n] = _mm512_fmadd_ps(c8[n], sx, acc[r][n]);
      }
    }
  }
  float corr[MR][NR] = {};
  for (; b < nb; ++b) {  // an odd last block: half a product
    for (int n = 0; n < NR; ++n) {
      float dw, c;
      const __m256i a = unpack_u8<T>(w + n * row_bytes + b * bytes, dw, c);
      for (int r = 0; r < MR; ++r) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq_rows + r * K + b * kBlock));
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, xv);
        const __m512 pf = _mm512_castps256_ps512(_mm256_cvtepi32_ps(p));
        acc[r][n] = _mm512_mask3_fmadd_ps(pf, _mm512_set1_ps(dw * dxs[r * nb + b]), acc[r][n],
                                          0x00FF);  // the low 8 lanes; the others kept
        corr[r][n] += c * sxs[r * nb + b];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n)
      out[r * ldo + n] = _mm512_reduce_add_ps(acc[r][n]) + corr[r][n] + (bias ? bias[n] : 0.0f);
}

#endif  // __AVX512VNNI__

#if !defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RAYGEN_QUANT_I8_AVX2 1
// The int8 products on AVX2 (no VNNI): x rounded to int8 blocks as above, in x's own order,
// and each block's dot product taken by vpmaddubsw (unsigned 8-bit by signed 8-bit, pairs
// summed to 16 bits) then vpmaddwd (pairs summed to 32 bits), as llama.cpp's AVX2 path
// does. Q4 quants (0..15) are the unsigned side as they are, the offset taken back with x's
// block sum (x_b . w_b = dw dx (sum q q_x) + c dx (sum q_x), c = -8 dw | m); Q8_0's signed
// quants go in as |q| against q_x with q's sign. No 16-bit sum can saturate: 2 * 15 * 127
// and 2 * 128 * 127 are below 2^15. 32 weights in about 5 instructions, against 4 chunks
// of 6 when the weights are unpacked to float32.

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// x's blocks always in x's own order here (`pair_order` is the VNNI tile's layout).
XQuant quantize_x(const float* x, int64_t M, int64_t K, bool /*pair_order*/) {
  const int64_t nb = K / kBlock;
  XQuant xq{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lanes
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
      }
      const float m = hmax8(amax);
      const float d = m / 127.0f, inv = m > 0.0f ? 127.0f / m : 0.0f;
      __m256i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq.q.data() + r * K + b * kBlock), packed);
      xq.d[r * nb + b] = d;
      xq.s[r * nb + b] = d * hsum(_mm256_cvtepi32_ps(sum));
    }
  return xq;
}

// A weight block's 32 quants in x's order (Q4: the low nibbles are weights 0-15, the high
// ones 16-31), its dw and its offset term c.
template <int64_t T>
inline __m256i quants8(const uint8_t* blk, float& dw, float& c) {
  dw = half_at(blk);
  if constexpr (T == kQ8_0) {
    c = 0.0f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    c = T == kQ4_1 ? half_at(blk + 2) : -8.0f * dw;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
  }
}

template <int64_t T>
inline __m256 block_dot8(__m256i wq, __m256i xv) {
  __m256i p;
  if constexpr (T == kQ8_0)
    p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq));
  else
    p = _mm256_maddubs_epi16(wq, xv);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// out[r, n:n+NR] for MR rows of x against NR weight rows, a block at a time.
template <int64_t T, int MR, int NR>
inline void dot_tile_i8(const XQuant& xq, int64_t r0, int64_t K, int64_t nb, const uint8_t* w,
                        int64_t row_bytes, float* out, int64_t ldo, const float* bias) {
  constexpr int64_t bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34;
  __m256 acc[MR][NR];
  float corr[MR][NR] = {};
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_setzero_ps();
  const int8_t* xq_rows = xq.q.data() + r0 * K;
  const float* dxs = xq.d.data() + r0 * nb;
  const float* sxs = xq.s.data() + r0 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wq[NR];
    float dw[NR], c[NR];
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + NR * row_bytes), _MM_HINT_T0);
      wq[n] = quants8<T>(blk, dw[n], c[n]);
    }
    for (int r = 0; r < MR; ++r) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(xq_rows + r * K + b * kBlock));
      const float dx = dxs[r * nb + b], sx = sxs[r * nb + b];
      for (int n = 0; n < NR; ++n) {
        acc[r][n] = _mm256_fmadd_ps(block_dot8<T>(wq[n], xv), _mm256_set1_ps(dw[n] * dx), acc[r][n]);
        if constexpr (T != kQ8_0) corr[r][n] += c[n] * sx;
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n)
      out[r * ldo + n] = hsum(acc[r][n]) + corr[r][n] + (bias ? bias[n] : 0.0f);
}

#endif  // AVX2 without VNNI

#if defined(__AVX512VNNI__) || defined(RAYGEN_QUANT_I8_AVX2)
template <int64_t T, int NR, int MAXR>
void product_i8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                int64_t N, const float* bias, float* out) {
  const int64_t nb = K / kBlock;
  const XQuant xq = quantize_x(x, M, K, T != kQ8_0);  // the ISA's own (above)
  over_tiles<NR, MAXR>(M, N, [&](auto mr, auto nr, int64_t r, int64_t n) {
    dot_tile_i8<T, decltype(mr)::value, decltype(nr)::value>(
        xq, r, K, nb, w + n * row_bytes, row_bytes, out + r * N + n, N,
        bias ? bias + n : nullptr);
  });
}
#endif

#endif  // RAYGEN_QUANT_FLOAT

}  // namespace

bool quant_supported() {
#if defined(RAYGEN_QUANT_FLOAT)
  return true;
#else
  return false;
#endif
}

namespace {

// What both products check and need: x contiguous, the output, the bias.
struct Call {
  at::Tensor x, out, bias_keep;
  const float* bias;
  int64_t M, K, row_bytes;
};

Call check_call(const char* name, const at::Tensor& x, const at::Tensor& weight, int64_t type,
                int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(block_bytes(type) > 0, name, ": unknown quantization type ", type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": 2-d float32 x");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, name, ": ", K, " input features are not whole blocks");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(0) == out_features &&
                  weight.size(1) == K / kBlock * block_bytes(type),
              name, ": weight ", weight.sizes(), " is not ", out_features, " rows of ",
              K / kBlock, " blocks");
  Call call;
  call.x = x.contiguous();
  call.M = call.x.size(0);
  call.K = K;
  call.row_bytes = weight.size(1);
  call.out = at::empty({call.M, out_features}, call.x.options());
  call.bias = bias_data(bias, out_features, name, call.bias_keep);
  return call;
}

// `run(type, NR, MAXR)` with the tile for the step's rows: 4 weight rows by 4 rows of x for
// steps of up to 4 rows, 2 by 8 beyond (16 accumulators either way). AVX2 has 16 vector
// registers, not 32: 8 accumulators, 4 by 2 up to 2 rows, 2 by 4 up to 4, and 1 by 8
// beyond (each block unpacked once per 8 rows: 22 against 28 ms at 8 rows, 46 against 56
// at 16, for SmolLM2's linears on an AMD EPYC; benchmarks/NOTES.md 63).
template <int64_t T, typename Run>
void with_tile(int64_t rows, Run&& run) {
#if !defined(__AVX512F__)
  if (rows <= 2)
    run(std::integral_constant<int64_t, T>{}, std::integral_constant<int, 4>{},
        std::integral_constant<int, 2>{});
  else if (rows <= 4)
    run(std::integral_constant<int64_t, T>{}, std::integral_constant<int, 2>{},
        std::integral_constant<int, 4>{});
  else
    run(std::integral_constant<int64_t, T>{}, std::integral_constant<int, 1>{},
        std::integral_constant<int, 8>{});
#else
  if (rows <= 4)
    run(std::integral_constant<int64_t, T>{}, std::integral_constant<int, 4>{},
        std::integral_constant<int, 4>{});
  else
    run(std::integral_constant<int64_t, T>{}, std::integral_constant<int, 2>{},
        std::integral_constant<int, 8>{});
#endif
}

}  // namespace

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

bool quant_i8_supported() {
#if defined(__AVX512VNNI__) || defined(RAYGEN_QUANT_I8_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor linear_quant_i8(at::Tensor x, at::Tensor weight, int64_t type, int64_t out_features,
                           std::optional<at::Tensor> bias) {
  TORCH_CHECK(quant_i8_supported(), "linear_quant_i8: built without AVX-512 VNNI or AVX2");
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ8_0,
              "linear_quant_i8: takes Q4_0, Q4_1 or Q8_0 blocks, not type ", type);
  Call c = check_call("linear_quant_i8", x, weight, type, out_features, bias);
  if (c.M == 0) return c.out;
#if defined(__AVX512VNNI__) || defined(RAYGEN_QUANT_I8_AVX2)
  const auto run = [&](auto t, auto nr, auto maxr) {
    product_i8<decltype(t)::value, decltype(nr)::value, decltype(maxr)::value>(
        c.x.data_ptr<float>(), c.M, c.K, weight.data_ptr<uint8_t>(), c.row_bytes, out_features,
        c.bias, c.out.data_ptr<float>());
  };
  switch (type) {
    case kQ4_0: with_tile<kQ4_0>(c.M, run); break;
    case kQ4_1: with_tile<kQ4_1>(c.M, run); break;
    default: with_tile<kQ8_0>(c.M, run); break;
  }
#endif
  return c.out;
}
