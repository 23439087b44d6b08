// x W^T on W's GGUF blocks (Q4_0, Q4_1, Q8_0) with x rounded to int8 blocks and the
// products taken in integers, as llama.cpp multiplies (`quant_products=int8`): faster than
// unpacking the weights to float32 (quant_linear.cpp), at the cost of x's rounding to 8
// bits. Needs AVX-512 VNNI, or AVX2 with FMA and F16C.
#include "ops.h"

#include "quant.h"

namespace {

#if defined(RAYGEN_QUANT_FLOAT)

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
      _mm_prefetch(reinterpret_cast<const char*>(blk + rows_ahead<NR>() * row_bytes),
                   _MM_HINT_T0);
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
