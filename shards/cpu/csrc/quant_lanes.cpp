// Small steps' x W^T, with W's GGUF blocks (Q4_0, Q4_1, Q8_0) laid out
// again at load so that the 8 lanes of an AVX2 vector hold 8 output rows ("rows in
// lanes"), not 8 weights of one row as in the file.
//
// A decode step at batch 1 multiplies each weight once. In the file's layout each block is
// reduced across a vector (x . q in 8 lanes, then d and m applied per block and weight
// row), so every 32 weights cost a load, nibble masks, 4 widenings, 4 conversions, 4 FMAs
// and the block's scales: gcc's loop runs ~33 instructions a block and row, and the
// product is bound by them, not by memory (quant_linear.cpp). Here a vector holds the
// same weight position of 8 rows, so x[k] is one broadcast from memory for all 8, and a
// block's d and m are one vector each for 8 rows:
//   Q4: a 32-bit lane holds 8 consecutive nibbles of its row. With one row of x, nibble j
//       is taken with one AND (in place: it converts to q * 16^j, exactly) and summed into
//       accumulator j, scaled back by 16^-j once per block (exact: a power of two); with
//       2-7 rows on AVX-512 builds, the same against x scaled by 16^-j (group_qdot_rows);
//       with more, it is shifted down, dequantized once (w = d q + m) and used for each.
//   Q8: 8 rows' int8 quants of one position are 8 consecutive bytes, widened in one op.
// One row: per 8 weights a mask, a conversion, an FMA and a broadcast; nothing per row per
// block. The same arithmetic as the block kernel (d (x . q) + m sum(x) per block, or the
// dequantized weights, in float32), summed in another order: the dequantized weights'
// product up to rounding. SmolLM2's Q4_1 layer products take 0.64x the block kernel's time
// at 1 row and 0.70-0.78x at 2-8 (benchmarks/NOTES.md 81).
//
// Built for AVX-512 too, where it is AVX2 code beside the 16-wide block tiles: on a Zen 4
// EPYC (AVX-512 in two halves) the same products took 0.56x the tiles' time in Q4_1 and
// 0.61x in bfloat16 at 1-2 rows, 0.55x and 0.94x at 8 (benchmarks/NOTES.md 95). There,
// steps of several rows run two groups to a 512-bit vector (TwoGroups), the same bits.
//
// Float weights take the same layout with no scales: bfloat16 (the upper half of a float32,
// shifted into place; positions in pairs, which vdpbf16ps multiplies where steps of several
// rows take x rounded to bfloat16: bf16_dot_product) and float32 (a copy that AVX2 CPUs
// keep for their small float32 steps; oneDNN reads a weight past one row at about half the
// rate these do, benchmarks/NOTES.md 83; AVX-512 builds cut that copy into panels instead,
// 0.96x the lanes' time at one row).
//
// Threads take contiguous ranges of 16 output rows and claim within them in order, so that
// each thread streams its weights front to back (claims handed out in turn cut each
// thread's stream into pieces that the hardware prefetcher starts over: 7.8 against 5.4 ms
// for those 120 products at one row, NOTES.md 81); a thread done with its own range takes
// from the others', so a preempted thread still holds no one up.
#include "ops.h"

#include "claim.h"
#include "quant.h"

#include <cmath>

namespace {

#if defined(RAYGEN_QUANT_FLOAT)  // AVX2 with FMA and F16C, which AVX-512 CPUs have
#define RAYGEN_QUANT_LANES 1
#endif

constexpr int64_t kLanes = 8;  // output rows per group (AVX2's floats per vector)
constexpr int kMaxTileRows = 8;  // rows of x per pass over the weights
// bfloat16 weights: steps of at least this many rows multiply x rounded to bfloat16
// (bf16_dot_product), where a CPU has vdpbf16ps; smaller ones keep float32 x.
constexpr int64_t kBf16DotRows = 4;
// Steps of at least this many rows multiply on AMX tiles where the CPU has them
// (quant_amx.cpp): SmolLM2's 120 Q4_1 layer products on an AMX Xeon took 0.77-0.89x the
// vector tiles' time at 5 rows, 0.87-0.90x at 8, 0.69-0.73x at 16; 1.01-1.13x at 4 and
// 1.08-1.20x at 2-3, which keep the x . q tiles. Its Q8_0 LM head: 1.10x at 5 rows, 0.99x
// at 6, 0.81x at 8, 0.54x at 16, 0.49x at 32 (benchmarks/NOTES.md 114).
constexpr int64_t kAmxMinRows = 5;
constexpr int64_t kAmxQ8MinRows = 8;

// Bytes of one block of a group of 8 rows: the quants, then 8 fp16 d (and for Q4_1 8 fp16 m);
// for float32 weights the 32 positions' 8 rows, position by position; for bfloat16 ones the
// 16 position pairs' 8 rows, pair by pair, a row's two weights side by side.
constexpr int64_t lane_block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 128 + 16;
    case kQ4_1: return 128 + 32;
    case kQ8_0: return 256 + 16;
    case kBF16: return 32 * 8 * 2;
    case kF32: return 32 * 8 * 4;
    default: return 0;
  }
}

// Bytes of one block of one row as pack_quant_lanes takes them: a GGUF block, or 32 floats.
int64_t source_block_bytes(int64_t type) { return type == kF32 ? 32 * 4 : block_bytes(type); }

constexpr bool is_float(int64_t type) { return type == kBF16 || type == kF32; }

#if defined(RAYGEN_QUANT_LANES)

// Blocks of a group asked for ahead of the one in use, 1-2 KB: 8 of Q4_1's 160 bytes, 4 of
// bfloat16's 512, 2 of float32's 1024. Float weights at 2 threads read 22-25 GB/s at one
// row with or without; at 4 rows 19-20 GB/s with, 16-18 without (benchmarks/NOTES.md 83).
template <int64_t T>
constexpr int64_t blocks_ahead() {
  return T == kF32 ? 2 : T == kBF16 ? 4 : 8;
}

// The weights of position k of a float block for the group's 8 rows. bfloat16 blocks hold
// positions in pairs (pack_quant_lanes): a 32-bit lane holds row r's weights 2p and 2p + 1,
// so the even one is shifted into the upper half of a float32 and the odd one masked.
template <int64_t T>
inline __m256 float_lanes(const uint8_t* blk, int k) {
  if constexpr (T == kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(blk) + 8 * k);
  } else {
    const __m256i pair =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (k >> 1)));
    return _mm256_castsi256_ps((k & 1) ? _mm256_and_si256(pair, _mm256_set1_epi32(-65536))
                                       : _mm256_slli_epi32(pair, 16));
  }
}

inline void prefetch_block(const uint8_t* blk, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + line), _MM_HINT_T0);
}

inline __m256 sum8(const __m256 (&a)[8]) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])),
                       _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7])));
}

// x . w for the 8 rows of group `w` (nb blocks of lane_block_bytes(T)); xsum[b]: x's sum over
// block b (the min term of Q4 blocks).
template <int64_t T>
inline __m256 group_dot(const float* x, const float* xsum, int64_t nb, const uint8_t* w) {
  constexpr int64_t bytes = lane_block_bytes(T);
  constexpr int64_t quants = T == kQ8_0 ? 256 : 128;
  static_assert(!is_float(T), "float weights take group_dot_rows: no scales per block");
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    // Sequential within a thread's range: ask for the block 8 ahead (its lines).
    prefetch_block(blk + blocks_ahead<T>() * bytes, bytes);
    const float* xb = x + b * kBlock;
    __m256 a[8];
    for (auto& v : a) v = _mm256_setzero_ps();
    __m256 p;
    if constexpr (T == kQ8_0) {
#pragma GCC unroll 32
      for (int k = 0; k < 32; ++k) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 8 * k));
        a[k & 7] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + k),
                                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), a[k & 7]);
      }
      p = sum8(a);
    } else {
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * g));
#pragma GCC unroll 7
        for (int j = 0; j < 7; ++j) {
          const __m256i q = _mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * j)));
          a[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + 8 * g + j), _mm256_cvtepi32_ps(q), a[j]);
        }
        // The top nibble shifted down: in place it would not fit a positive int32.
        a[7] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + 8 * g + 7),
                               _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28)), a[7]);
      }
      p = _mm256_add_ps(a[0], a[7]);
      float scale = 1.0f;
      for (int j = 1; j < 7; ++j) {
        scale *= 1.0f / 16.0f;
        p = _mm256_fmadd_ps(a[j], _mm256_set1_ps(scale), p);
      }
    }
    // d (x . q) + m sum(x) for the block, then into the sum: the min term cancels most of
    // the product's size within the block, as in the block kernel.
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants)));
    if constexpr (T == kQ4_1) {
      const __m256 m = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants + 16)));
      acc = _mm256_add_ps(acc, _mm256_fmadd_ps(d, p, _mm256_mul_ps(m, _mm256_set1_ps(xsum[b]))));
    } else if constexpr (T == kQ4_0) {  // w = d (q - 8)
      acc = _mm256_add_ps(acc, _mm256_mul_ps(d, _mm256_sub_ps(p, _mm256_set1_ps(8.0f * xsum[b]))));
    } else {
      acc = _mm256_fmadd_ps(d, p, acc);
    }
  }
  return acc;
}

// The width a tile runs at: one group of 8 output rows in an AVX2 vector, or (AVX-512)
// two groups side by side in a 512-bit vector, group a's 8 lanes then group b's. Each lane
// takes the same operations either way, so both widths give the same bits.
struct OneGroup {
  using F = __m256;
  using I = __m256i;
  static constexpr bool kPair = false;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static I mask(int v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I shift(I v, int n) { return _mm256_srli_epi32(v, n); }
  // 32 bytes of quants of the group (b: where the second group's would be; not read).
  static I quants(const uint8_t* a, const uint8_t*) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  }
  // 8 fp16 scales of the group, as float32.
  static F halves(const uint8_t* a, const uint8_t*) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  }
  // 8 int8 quants of one position, as float32.
  static F bytes8(const uint8_t* a, const uint8_t*) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a))));
  }
};

#if defined(__AVX512F__)
#define RAYGEN_LANES_PAIRS 1

struct TwoGroups {
  using F = __m512;
  using I = __m512i;
  static constexpr bool kPair = true;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static I mask(int v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I shift(I v, int n) { return _mm512_srli_epi32(v, n); }
  static I quants(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  }
  static F halves(const uint8_t* a, const uint8_t* b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
  }
  static F bytes8(const uint8_t* a, const uint8_t* b) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)))));
  }
};
#endif

// The same for a tile of MR rows of x (2-8; 1 only as the last tile of a bigger step): each
// vector of 8 rows' weights is dequantized once (w = d q + m, one FMA, as the block
// kernel's tiles do) and used for every row of x, with A accumulators per row so that
// several FMAs are in flight: one waits 4 cycles for the one before it on its accumulator
// and two issue a cycle, so 8 keep the units busy. MR x A accumulators (8 at 2, 4 and 8
// rows, 10 at 5, 6-7 at 3, 6 and 7) and d, m, the mask, the quants and a weight share 16
// vector registers: five rows with two each took 0.86-0.92x the time of one each, six
// rows' twelve spill and lose (benchmarks/NOTES.md 82). With W = TwoGroups, groups `w` and
// `w2` at once in half the instructions (quantized weights only; lanes_product says when).
template <int64_t T, int MR, typename W = OneGroup>
inline void group_dot_rows(const float* x, int64_t K, int64_t nb, const uint8_t* w,
                           typename W::F (&y)[MR], const uint8_t* w2 = nullptr) {
  static_assert(!(W::kPair && is_float(T)), "float weights take one group at a time");
  constexpr int64_t bytes = lane_block_bytes(T);
  constexpr int64_t quants = T == kQ8_0 ? 256 : 128;
  constexpr int A = MR <= 2 ? 4 : MR <= 5 ? 2 : 1;
  typename W::F acc[MR][A];
  for (auto& row : acc)
    for (auto& a : row) a = W::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const uint8_t* blk2 = W::kPair ? w2 + b * bytes : blk;  // one group: its own, unread
    prefetch_block(blk + blocks_ahead<T>() * bytes, bytes);
    if constexpr (W::kPair) prefetch_block(blk2 + blocks_ahead<T>() * bytes, bytes);
    const float* xb = x + b * kBlock;
    const auto use = [&](int k, typename W::F wk) {
      for (int r = 0; r < MR; ++r)
        acc[r][k % A] = W::fmadd(W::set1(xb[r * K + k]), wk, acc[r][k % A]);
    };
    if constexpr (is_float(T)) {
#pragma GCC unroll 32
      for (int k = 0; k < 32; ++k) use(k, float_lanes<T>(blk, k));
      continue;
    } else {
      const auto d = W::halves(blk + quants, blk2 + quants);
      const auto m = T == kQ4_1 ? W::halves(blk + quants + 16, blk2 + quants + 16)
                                : W::mul(d, W::set1(-8.0f));  // Q4_0
      if constexpr (T == kQ8_0) {
#pragma GCC unroll 32
        for (int k = 0; k < 32; ++k)
          use(k, W::mul(W::bytes8(blk + 8 * k, blk2 + 8 * k), d));
      } else {
        const auto mask = W::mask(0xF);
        for (int g = 0; g < 4; ++g) {
          const auto v = W::quants(blk + 32 * g, blk2 + 32 * g);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            const auto q = j == 0 ? W::and_(v, mask)
                           : j == 7 ? W::shift(v, 28)
                                    : W::and_(W::shift(v, 4 * j), mask);
            use(8 * g + j, W::fmadd(W::to_float(q), d, m));
          }
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    y[r] = acc[r][0];
    for (int a = 1; a < A; ++a) y[r] = W::add(y[r], acc[r][a]);
  }
}

// The same for quantized weights by another arithmetic, AVX-512 builds' tiles of 2-7 rows:
// x . q per block and row, then d (x . q) + m sum(x) into the row's sum, as the one-row
// group_dot does. No weight is dequantized: a position costs its nibble's AND, one
// conversion and an FMA per row, where group_dot_rows adds a shift and the dequantizing
// FMA. The nibble j of a lane is taken in place (q 16^j, exact), so x comes scaled by
// 16^-j (`xs`, exact: a power of two); `xsum` holds x's sum per row and block. Each row
// holds a sum across blocks beside its block's accumulators: 2 x MR + 4 vectors, which
// fit AVX-512's 32 registers and not AVX2's 16. SmolLM2's 120 Q4_1 layer products took
// 0.82x the time at 2 rows, 0.94-0.96x at 3-6 and the Q8_0 LM head 0.89-0.98x; at 8 rows
// and more (pairs) they took 1.02-1.06x, so those keep group_dot_rows (benchmarks/NOTES.md
// 112). Rounded otherwise than the dequantized weights' product, as the one-row step is.
template <int64_t T, int MR, typename W = OneGroup>
inline void group_qdot_rows(const float* xs, const float* xsum, int64_t K, int64_t nb,
                             const uint8_t* w, typename W::F (&y)[MR],
                             const uint8_t* w2 = nullptr) {
  constexpr int64_t bytes = lane_block_bytes(T);
  constexpr int64_t quants = T == kQ8_0 ? 256 : 128;
  constexpr int A = MR <= 2 ? 4 : MR <= 5 ? 2 : 1;
  typename W::F total[MR];
  for (auto& t : total) t = W::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const uint8_t* blk2 = W::kPair ? w2 + b * bytes : blk;
    prefetch_block(blk + blocks_ahead<T>() * bytes, bytes);
    if constexpr (W::kPair) prefetch_block(blk2 + blocks_ahead<T>() * bytes, bytes);
    const float* xb = xs + b * kBlock;
    typename W::F acc[MR][A];
    for (auto& row : acc)
      for (auto& a : row) a = W::zero();
    const auto use = [&](int k, typename W::F qk) {
      for (int r = 0; r < MR; ++r)
        acc[r][k % A] = W::fmadd(W::set1(xb[r * K + k]), qk, acc[r][k % A]);
    };
    if constexpr (T == kQ8_0) {
#pragma GCC unroll 32
      for (int k = 0; k < 32; ++k) use(k, W::bytes8(blk + 8 * k, blk2 + 8 * k));
    } else {
      for (int g = 0; g < 4; ++g) {
        const auto v = W::quants(blk + 32 * g, blk2 + 32 * g);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const auto q = j == 7 ? W::shift(v, 28) : W::and_(v, W::mask(0xF << (4 * j)));
          use(8 * g + j, W::to_float(q));
        }
      }
    }
    const auto d = W::halves(blk + quants, blk2 + quants);
    for (int r = 0; r < MR; ++r) {
      auto p = acc[r][0];
      for (int a = 1; a < A; ++a) p = W::add(p, acc[r][a]);
      const float s = xsum[r * nb + b];
      if constexpr (T == kQ4_1) {
        const auto m = W::halves(blk + quants + 16, blk2 + quants + 16);
        total[r] = W::add(total[r], W::fmadd(d, p, W::mul(m, W::set1(s))));
      } else if constexpr (T == kQ4_0) {
        total[r] = W::add(total[r], W::mul(d, W::add(p, W::set1(-8.0f * s))));
      } else {
        total[r] = W::fmadd(d, p, total[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) y[r] = total[r];
}

// Rows r0 .. r0 + MR of out for the groups of one task.
template <int64_t T, int MR>
void lanes_tile(const float* x, int64_t K, const float* xsum, const uint8_t* w, int64_t N,
                const float* bias, float* out, int64_t g0, int64_t g1, bool pairs,
                const float* xs = nullptr, const float* xsums = nullptr) {
  const int64_t nb = K / kBlock, group_bytes = nb * lane_block_bytes(T);
  int64_t g = g0;
#if defined(RAYGEN_LANES_PAIRS)
  // Two groups at a time where they are two (their 16 outputs are side by side) and the
  // step asks for it (lanes_product).
  if constexpr (!is_float(T) && MR >= 2) {
    for (; pairs && g + 2 <= g1; g += 2) {
      __m512 y[MR];
      if (xs != nullptr)
        group_qdot_rows<T, MR, TwoGroups>(xs, xsums, K, nb, w + g * group_bytes, y,
                                           w + (g + 1) * group_bytes);
      else
        group_dot_rows<T, MR, TwoGroups>(x, K, nb, w + g * group_bytes, y,
                                         w + (g + 1) * group_bytes);
      const __m512 bv = bias ? _mm512_loadu_ps(bias + g * kLanes) : _mm512_setzero_ps();
      for (int r = 0; r < MR; ++r)
        _mm512_storeu_ps(out + r * N + g * kLanes, _mm512_add_ps(y[r], bv));
    }
  }
#endif
  for (; g < g1; ++g) {
    __m256 y[MR];
    if constexpr (MR == 1 && !is_float(T)) {
      if (xsum != nullptr)  // a step of one row
        y[0] = group_dot<T>(x, xsum, nb, w + g * group_bytes);
      else  // the last tile of a bigger step (57 = 7 x 8 + 1)
        group_dot_rows<T, 1>(x, K, nb, w + g * group_bytes, y);
    } else if constexpr (!is_float(T)) {
      if (xs != nullptr) group_qdot_rows<T, MR>(xs, xsums, K, nb, w + g * group_bytes, y);
      else group_dot_rows<T, MR>(x, K, nb, w + g * group_bytes, y);
    } else {
      group_dot_rows<T, MR>(x, K, nb, w + g * group_bytes, y);
    }
    const __m256 bv = bias ? _mm256_loadu_ps(bias + g * kLanes) : _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * N + g * kLanes, _mm256_add_ps(y[r], bv));
  }
}

// run(mr, r, g0, g1) for each task's groups g0 .. g1 (16 output rows) and each tile of mr
// rows of x from row r (a constant, up to 8, the tiles as even as they go: 12 = 6 + 6); a
// task's weights (16 rows, a few KB) stay in the caches from one tile to the next.
template <typename Run>
void over_tiles(int64_t M, int64_t N, const Run& run) {
  const int64_t tiles = (M + kMaxTileRows - 1) / kMaxTileRows, per_tile = (M + tiles - 1) / tiles;
  constexpr int64_t per_task = kTaskRows / kLanes;
  const int64_t groups = N / kLanes;
  for_each_claimed_in_ranges((groups + per_task - 1) / per_task, [&](int64_t task) {
    const int64_t g0 = task * per_task, g1 = std::min(groups, g0 + per_task);
    for (int64_t r = 0; r < M; r += per_tile)
      with_rows<kMaxTileRows>(static_cast<int>(std::min(per_tile, M - r)),
                              [&](auto mr) { run(mr, r, g0, g1); });
  });
}

template <int64_t T>
void lanes_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                   const float* bias, float* out) {
  const int64_t nb = K / kBlock;
  // Groups in pairs (AVX-512): Q8_0 at 2 rows and more (the LM head's blocks: 0.71-0.91x
  // the time at 2-16 rows), Q4 from 8 (0.83-0.96x at 8-16 rows; at 2-6, bound by two
  // streams of weights rather than by instructions, 1.07-1.12x: benchmarks/NOTES.md 111).
  const bool pairs = T == kQ8_0 || M >= 8;
  // Steps of 2-7 rows on AVX-512 builds: x . q per block (group_qdot_rows).
#if defined(RAYGEN_LANES_PAIRS)
  const bool xq = !is_float(T) && M > 1 && M < 8;
#else
  const bool xq = false;
#endif
  // x's sum per row and block (the min term: one row's step, and x . q's steps), and for
  // x . q x scaled by 16^-j at nibble j (Q4).
  const bool sums = !is_float(T) && (M == 1 || xq);
  std::vector<float> xs(xq ? M * K : 0), xsums(sums ? M * nb : 0);
  float scale[8];
  for (int j = 0; j < 8; ++j) scale[j] = T == kQ8_0 || j == 7 ? 1.0f : std::ldexp(1.0f, -4 * j);
  for (int64_t r = 0; sums && r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xr = x + r * K + b * kBlock;
      float sum = 0.0f;
      for (int k = 0; k < kBlock; ++k) sum += xr[k];
      xsums[r * nb + b] = sum;
      if (xq)
        for (int k = 0; k < kBlock; ++k) xs[r * K + b * kBlock + k] = xr[k] * scale[k % 8];
    }
  const float* one_row_sums = M == 1 && sums ? xsums.data() : nullptr;
  over_tiles(M, N, [&](auto mr, int64_t r, int64_t g0, int64_t g1) {
    lanes_tile<T, decltype(mr)::value>(x + r * K, K, one_row_sums, w, N, bias, out + r * N, g0,
                                       g1, pairs, xq ? xs.data() + r * K : nullptr,
                                       xq ? xsums.data() + r * nb : nullptr);
  });
}

#endif  // RAYGEN_QUANT_LANES

#if defined(RAYGEN_QUANT_LANES) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define RAYGEN_BF16_DOT 1

// bfloat16 weights by x rounded to bfloat16 (round to nearest even, as torch's
// .to(torch.bfloat16) and oneDNN's bfloat16 products round it), in the same layout:
// vdpbf16ps adds a lane's two products (row r's weights 2p and 2p + 1 by x's pair p) into
// its float32 sum, 16 multiplies an instruction and no conversion of the weights. Steps of
// kBf16DotRows rows or more take it (`linear_quant_lanes`); 2-3 rows read the weights at
// memory's rate either way and keep float32 x. SmolLM2's 120 layer products on a Zen 4
// EPYC: 0.82-0.87x the float32-x lanes' time at 4 rows, 0.72-0.77x at 6, 0.8-0.9x oneDNN's
// at 8; oneDNN ties or wins from 12 (benchmarks/NOTES.md 105). A group at a time, front to
// back as the lanes do (two groups side by side, sharing x's broadcasts: no faster), with
// A accumulators per row so that a few rows keep the unit busy.
template <int MR>
inline void bf16_dot_tile(const uint32_t* xp, int64_t pairs, const uint8_t* w, int64_t nb,
                          __m256 (&y)[MR]) {
  constexpr int64_t bytes = lane_block_bytes(kBF16);
  constexpr int A = MR <= 4 ? 4 : 2;
  __m256 acc[MR][A];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    prefetch_block(blk + blocks_ahead<kBF16>() * bytes, bytes);
    const uint32_t* xb = xp + b * (kBlock / 2);
#pragma GCC unroll 16
    for (int p = 0; p < kBlock / 2; ++p) {
      const __m256bh wp =
          (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * p));
      for (int r = 0; r < MR; ++r) {
        const __m256bh xv = (__m256bh)_mm256_set1_epi32(static_cast<int>(xb[r * pairs + p]));
        acc[r][p % A] = _mm256_dpbf16_ps(acc[r][p % A], xv, wp);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    y[r] = acc[r][0];
    for (int a = 1; a < A; ++a) y[r] = _mm256_add_ps(y[r], acc[r][a]);
  }
}

// Rows r0 .. r0 + MR of out for the groups of one task.
template <int MR>
void bf16_dot_rows(const uint32_t* xp, int64_t pairs, const uint8_t* w, int64_t nb, int64_t N,
                   const float* bias, float* out, int64_t g0, int64_t g1) {
  const int64_t group_bytes = nb * lane_block_bytes(kBF16);
  for (int64_t g = g0; g < g1; ++g) {
    __m256 y[MR];
    bf16_dot_tile<MR>(xp, pairs, w + g * group_bytes, nb, y);
    const __m256 bv = bias ? _mm256_loadu_ps(bias + g * kLanes) : _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * N + g * kLanes, _mm256_add_ps(y[r], bv));
  }
}

void bf16_dot_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                      const float* bias, float* out) {
  const int64_t pairs = K / 2, nb = K / kBlock;
  std::vector<uint32_t> xp(M * pairs);  // x's rows as bfloat16 pairs
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; k += 32) {
      const float* xr = x + r * K + k;
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr));
      _mm512_storeu_si512(xp.data() + r * pairs + k / 2, (__m512i)h);
    }
  over_tiles(M, N, [&](auto mr, int64_t r, int64_t g0, int64_t g1) {
    bf16_dot_rows<decltype(mr)::value>(xp.data() + r * pairs, pairs, w, nb, N, bias, out + r * N,
                                       g0, g1);
  });
}

#endif  // RAYGEN_BF16_DOT

void check_lanes_type(const char* name, int64_t type) {
  TORCH_CHECK(lane_block_bytes(type) > 0, name, ": rows in lanes for Q4_0 (0), Q4_1 (1), "
              "Q8_0 (2), BF16 (3) and F32 (4) only, not type ", type);
}

}  // namespace

int64_t bf16_dot_min_rows() {
#if defined(RAYGEN_BF16_DOT)
  return kBf16DotRows;
#else
  return 0;
#endif
}

bool quant_lanes_supported() {
#if defined(RAYGEN_QUANT_LANES)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_quant_lanes(at::Tensor weight, int64_t type, int64_t in_features) {
  check_lanes_type("pack_quant_lanes", type);
  const int64_t N = weight.size(0), nb = in_features / kBlock, src = source_block_bytes(type);
  TORCH_CHECK(in_features % kBlock == 0 && weight.dim() == 2 && weight.scalar_type() == at::kByte &&
                  weight.is_contiguous() && weight.size(1) == nb * src,
              "pack_quant_lanes: weight ", weight.sizes(), " is not rows of ", nb, " blocks");
  TORCH_CHECK(N % kLanes == 0, "pack_quant_lanes: ", N, " rows are not whole groups of ", kLanes);
  const int64_t dst = lane_block_bytes(type), quants = type == kQ8_0 ? 256 : 128;
  at::Tensor out = at::empty({N / kLanes, nb * dst}, weight.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kLanes, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* ob = o + (g * nb + b) * dst;
        for (int64_t r = 0; r < kLanes; ++r) {
          const uint8_t* blk = w + (g * kLanes + r) * nb * src + b * src;
          if (type == kF32) {  // position k of row r at 8 k + r
            for (int k = 0; k < 32; ++k) std::memcpy(ob + (8 * k + r) * 4, blk + k * 4, 4);
            continue;
          }
          if (type == kBF16) {  // positions 2p and 2p + 1 of row r side by side at 8 p + r
            for (int k = 0; k < 32; ++k)
              std::memcpy(ob + 32 * (k / 2) + 4 * r + 2 * (k % 2), blk + 2 * k, 2);
            continue;
          }
          std::memcpy(ob + quants + 2 * r, blk, 2);  // d
          if (type == kQ8_0) {
            for (int k = 0; k < 32; ++k) ob[8 * k + r] = blk[2 + k];
            continue;
          }
          const uint8_t* qs = blk + (type == kQ4_1 ? 4 : 2);
          if (type == kQ4_1) std::memcpy(ob + quants + 16 + 2 * r, blk + 2, 2);  // m
          // The file holds weight j in byte j's low nibble and weight j + 16 in its high one.
          for (int part = 0; part < 4; ++part) {
            uint32_t lane = 0;
            for (int j = 0; j < 8; ++j) {
              const int k = 8 * part + j;
              const uint32_t q = k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4;
              lane |= q << (4 * j);
            }
            std::memcpy(ob + 32 * part + 4 * r, &lane, 4);
          }
        }
      }
  });
  return out;
}

at::Tensor linear_quant_lanes(at::Tensor x, at::Tensor lanes, int64_t type, int64_t out_features,
                              std::optional<at::Tensor> bias) {
  TORCH_CHECK(quant_lanes_supported(), "linear_quant_lanes: built without AVX2 with FMA and F16C "
              "(or built for AVX-512, which keeps the block kernel's tiles)");
  check_lanes_type("linear_quant_lanes", type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "linear_quant_lanes: 2-d float32 x");
  const int64_t K = x.size(1), M = x.size(0);
  TORCH_CHECK(K % kBlock == 0 && out_features % kLanes == 0 && lanes.dim() == 2 &&
                  lanes.scalar_type() == at::kByte && lanes.is_contiguous() &&
                  lanes.size(0) == out_features / kLanes &&
                  lanes.size(1) == K / kBlock * lane_block_bytes(type),
              "linear_quant_lanes: lanes ", lanes.sizes(), " are not ", out_features, " rows of ",
              K / kBlock, " blocks");
  at::Tensor xc = x.contiguous();
  at::Tensor keep;
  const float* b = bias_data(bias, out_features, "linear_quant_lanes", keep);
  at::Tensor out = at::empty({M, out_features}, xc.options());
#if defined(RAYGEN_BF16_DOT)
  if (type == kBF16 && M >= kBf16DotRows) {
    bf16_dot_product(xc.data_ptr<float>(), M, K, lanes.data_ptr<uint8_t>(), out_features, b,
                     out.data_ptr<float>());
    return out;
  }
#endif
  if (M >= (type == kQ8_0 ? kAmxQ8MinRows : kAmxMinRows) &&
      amx_lanes_product(type, xc.data_ptr<float>(), M, K, lanes.data_ptr<uint8_t>(), out_features,
                        b, out.data_ptr<float>()))
    return out;
#if defined(RAYGEN_QUANT_LANES)
  const auto run = [&](auto t) {
    if (M > 0)
      lanes_product<decltype(t)::value>(xc.data_ptr<float>(), M, K, lanes.data_ptr<uint8_t>(),
                                        out_features, b, out.data_ptr<float>());
  };
  switch (type) {
    case kQ4_0: run(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: run(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: run(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kBF16: run(std::integral_constant<int64_t, kBF16>{}); break;
    default: run(std::integral_constant<int64_t, kF32>{}); break;
  }
#endif
  return out;
}
