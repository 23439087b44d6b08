// Steps of several rows times GGUF blocks (Q4_0, Q4_1, Q8_0) in rows in lanes
// (quant_lanes.cpp's layout), on AMX tiles, with float32 x kept exact.
//
// A step of several rows multiplies each weight several times, so the vector products are
// bound by their FMAs (16 rows: ~190 GFLOP/s on two cores of an AMX Xeon), not by memory.
// AMX multiplies bfloat16 16 x 32 by 32 x 16 in one instruction, summing in float32, but x
// in bfloat16 would move every answer. Here the quants are the bfloat16 numbers (Q4's 0-15
// and Q8's -128-127 are exact) and x is cut into three bfloat16 parts whose sum is x
// exactly (hi, the float's upper half; mid, the rest's; lo, what is left, 8 bits at most):
// a part times a quant is exact in float32, so x . q per block is summed from exact
// products in float32, as the vector kernels sum it, in another order. Then, per block and
// output row, d (x . q) plus the min term (Q4_1's m, Q4_0's -8 d; none for Q8_0) times x's
// block sum, as the one-row kernel does.
//
// A tile is 16 output rows (two lanes groups) by 32 positions (one block): its bfloat16
// quants are laid out as the tile instruction reads them (position pairs side by side)
// once per block, and serve every 16 rows of x. Each row's result is the same whatever
// rows share its step. SmolLM2's 120 Q4_1 layer products: 0.77-0.89x the vector tiles'
// time at 5 rows, 0.69-0.73x at 16; 0.64x the float32 panels' at 64, 0.76x at 280 (a
// prefill of the grounded prompts 0.76x); its Q8_0 LM head 0.54x at 16 rows (NOTES.md
// 114). The tile unit alone would take a fifth of that: the rest is laying out quants and
// scaling each block's sums.
#include "ops.h"

#include "claim.h"
#include "quant.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define RAYGEN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>
#endif

namespace {

#if defined(RAYGEN_AMX)

constexpr int kTile = 16;  // output rows of a tile, and the most rows of x in one
constexpr int64_t kChunkRows = 64;  // rows of x multiplied at a time
constexpr int64_t kAhead = 2;  // blocks whose quants are laid out before their tile loads

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2: x's three parts for `rows` rows (one block); 3 and 7: the block's quants for
// two tiles of output rows; 4 and 5: their products with x, summed over the parts.
void configure_tiles(int rows) {
  TileConfig c;
  for (int t : {0, 1, 2, 4, 5}) c.rows[t] = rows, c.colsb[t] = 64;
  for (int t : {3, 7}) c.rows[t] = kTile, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// The block's quants of two lanes groups (16 output rows) as the tile instruction reads
// them: row p holds positions 2p and 2p + 1 of output row n at bfloat16 2n and 2n + 1. In
// the lanes layout, byte 4 r + b of part j (32 bytes) holds row r's positions 8 j + 2 b
// (low nibble) and 8 j + 2 b + 1 (high nibble): tile row 4 j + b.
struct Unpack {
  __m512i gather[4];  // tile row 4 j + b from part j of both groups: the bytes of b
  __m512i shifts;     // even bfloat16 slots keep the low nibble, odd ones take the high
  __m512i values;     // bfloat16 of (i & 15) for i < 32 (vpermw reads 5 bits)
  Unpack() {
    alignas(64) uint8_t idx[4][64] = {};
    for (int b = 0; b < 4; ++b)
      for (int n = 0; n < 16; ++n)
        for (int j = 0; j < 2; ++j) idx[b][4 * n + 2 * j] = 32 * (n / 8) + 4 * (n % 8) + b;
    for (int b = 0; b < 4; ++b) gather[b] = _mm512_load_si512(idx[b]);
    alignas(64) uint16_t s[32], v[32];
    for (int i = 0; i < 32; ++i) {
      s[i] = (i % 2) * 4;
      const float f = static_cast<float>(i & 15);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      v[i] = static_cast<uint16_t>(bits >> 16);
    }
    shifts = _mm512_load_si512(s);
    values = _mm512_load_si512(v);
  }
  void operator()(const uint8_t* q0, const uint8_t* q1, uint16_t* tile) const {
    for (int j = 0; j < 4; ++j) {
      const __m512i src = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + 32 * j))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1 + 32 * j)), 1);
      for (int b = 0; b < 4; ++b) {
        __m512i w = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, gather[b], src);
        w = _mm512_permutexvar_epi16(_mm512_srlv_epi16(w, shifts), values);
        _mm512_store_si512(tile + 32 * (4 * j + b), w);
      }
    }
  }
};

// The same for Q8_0 blocks (the LM head's): 8 rows' int8 quants of position k are bytes
// 8 k .. 8 k + 7 of a group's block, so tile row p's bytes (positions 2p and 2p + 1 of 16
// rows) are 16 bytes of each group, picked into bfloat16 order and converted (exactly:
// |q| <= 128).
struct UnpackQ8 {
  __m512i gather[2];  // two tile rows (4 j + 2 h and the next) from both groups' 64 bytes
  UnpackQ8() {
    alignas(64) uint8_t idx[2][64];
    for (int h = 0; h < 2; ++h)
      for (int o = 0; o < 64; ++o) {
        const int p = 2 * h + o / 32, n = o % 32 / 2, j = o % 2;
        idx[h][o] = static_cast<uint8_t>(64 * (n / 8) + 16 * p + 8 * j + n % 8);
      }
    for (int h = 0; h < 2; ++h) gather[h] = _mm512_load_si512(idx[h]);
  }
  void operator()(const uint8_t* q0, const uint8_t* q1, uint16_t* tile) const {
    for (int j = 0; j < 4; ++j) {
      const __m512i a = _mm512_loadu_si512(q0 + 64 * j), b = _mm512_loadu_si512(q1 + 64 * j);
      for (int h = 0; h < 2; ++h) {
        const __m512i bytes = _mm512_permutex2var_epi8(a, gather[h], b);
        __m512 f[4];
        for (int i = 0; i < 4; ++i)
          f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(bytes, i)));
        for (int row = 0; row < 2; ++row)
          _mm512_store_si512(tile + 32 * (4 * j + 2 * h + row),
                             (__m512i)_mm512_cvtne2ps_pbh(f[2 * row + 1], f[2 * row]));
      }
    }
  }
};

// x's rows as three bfloat16 parts (hi, mid, lo: x = hi + mid + lo exactly), block by block
// and part by part, each `padded` x 32 (rows past M zero: a tile of x is 64-byte rows one
// after the other); and x's sum per row and block.
void split_rows(const float* x, int64_t M, int64_t padded, int64_t K, uint16_t* parts,
                float* sums) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, padded, 16, [&](int64_t r0, int64_t r1) {
    const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = r < M ? _mm512_loadu_ps(x + r * K + k) : _mm512_setzero_ps();
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), upper));
        const __m512 rest = _mm512_sub_ps(v, hi);
        const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), upper));
        const __m512 lo = _mm512_sub_ps(rest, mid);
        const __m512 part[3] = {hi, mid, lo};
        for (int p = 0; p < 3; ++p)
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(parts + ((k / kBlock * 3 + p) * padded + r) * kBlock +
                                         k % kBlock),
              _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(part[p]), 16)));
        if (k % kBlock == 0) sums[r * nb + k / kBlock] = 0.0f;
        sums[r * nb + k / kBlock] += _mm512_reduce_add_ps(v);
      }
  });
}

// A block's d (fp16 at `at` in each of the two groups' blocks) for the tile's 16 rows.
inline __m512 scales(const uint8_t* q0, const uint8_t* q1, int at) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q0 + at))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + at)), 1));
}

template <int64_t T>
void amx_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                 const float* bias, float* out) {
  static_assert(T == kQ4_0 || T == kQ4_1 || T == kQ8_0);
  static const std::conditional_t<T == kQ8_0, UnpackQ8, Unpack> unpack;
  const int64_t nb = K / kBlock;
  // quant_lanes.cpp's lane_block_bytes, and where the block's d start in it
  constexpr int64_t bytes = T == kQ8_0 ? 272 : T == kQ4_1 ? 160 : 144;
  constexpr int at_d = T == kQ8_0 ? 256 : 128;
  const int64_t group_bytes = nb * bytes;
  // Tiles of x as even as they go (20 rows: 10 + 10), rows past M zero.
  const int64_t tiles = (M + kTile - 1) / kTile, h = (M + tiles - 1) / tiles, padded = tiles * h;
  // split_rows writes every element (rows past M as zeros): kept per calling thread and
  // grown, not allocated and zero-filled again by each of a step's 120 calls.
  // The tasks below run on other threads: they read these through plain pointers (a
  // thread_local named there would be that thread's own).
  thread_local std::vector<uint16_t> part_buffer;
  thread_local std::vector<float> sum_buffer;
  if (part_buffer.size() < static_cast<size_t>(3 * padded * K)) part_buffer.resize(3 * padded * K);
  if (sum_buffer.size() < static_cast<size_t>(padded * nb)) sum_buffer.resize(padded * nb);
  const uint16_t* parts = part_buffer.data();
  const float* sums = sum_buffer.data();
  split_rows(x, M, padded, K, part_buffer.data(), sum_buffer.data());
  // A task: two tiles of output rows (four lanes groups), whose products alternate on the
  // tile unit; N % 32 == 16 ends in a task of one (its second tile multiplies its first
  // one's quants again, and is not written). While block b's products are on the tile
  // unit, block b + kAhead's quants are laid out and block b - 1's products are scaled
  // into acc: the vector work waits for no tile.
  for_each_claimed_in_ranges((N + 2 * kTile - 1) / (2 * kTile), [&](int64_t task) {
    thread_local std::vector<float> acc, products;
    acc.assign(padded * 32, 0.0f);
    products.resize(2 * padded * 32);  // two blocks' x . q, rows x the task's 32 columns
    // Quants laid out kAhead blocks before the tile loop loads them: a tile load of what
    // vector stores have just written waits for them (80 against 40 ns a block in a loop
    // that loads right after storing, NOTES.md 114).
    alignas(64) uint16_t quants[kAhead + 1][1024];
    const bool two = (task + 1) * 2 * kTile <= N;
    const uint8_t* g = w + 4 * task * group_bytes;
    // Block b of the task's four lanes groups (a task of one tile reads its two twice).
    const auto blocks = [&](int64_t b, const uint8_t* (&q)[4]) {
      for (int i = 0; i < 4; ++i) q[i] = g + (two || i < 2 ? i : i - 2) * group_bytes + b * bytes;
    };
    const auto lay_out = [&](int64_t b) {
      const uint8_t* q[4];
      blocks(b, q);
      unpack(q[0], q[1], quants[b % (kAhead + 1)]);
      unpack(q[2], q[3], quants[b % (kAhead + 1)] + 512);
    };
    const auto sum_into_acc = [&](int64_t b) {
      const uint8_t* q[4];
      blocks(b, q);
      const __m512 d0 = scales(q[0], q[1], at_d), d1 = scales(q[2], q[3], at_d);
      const float* c = products.data() + (b & 1) * padded * 32;
      if constexpr (T == kQ8_0) {  // no min term
        for (int64_t r = 0; r < M; ++r) {
          float* a = acc.data() + 32 * r;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(d0, _mm512_loadu_ps(c + 32 * r), _mm512_loadu_ps(a)));
          _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(d1, _mm512_loadu_ps(c + 32 * r + 16),
                                                   _mm512_loadu_ps(a + 16)));
        }
        return;
      }
      __m512 m0, m1;
      if constexpr (T == kQ4_1) {
        m0 = scales(q[0], q[1], 144), m1 = scales(q[2], q[3], 144);
      } else {
        const __m512 eight = _mm512_set1_ps(-8.0f);
        m0 = _mm512_mul_ps(d0, eight), m1 = _mm512_mul_ps(d1, eight);
      }
      for (int64_t r = 0; r < M; ++r) {
        const __m512 xs = _mm512_set1_ps(sums[r * nb + b]);
        float* a = acc.data() + 32 * r;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(m0, xs, _mm512_fmadd_ps(
            d0, _mm512_loadu_ps(c + 32 * r), _mm512_loadu_ps(a))));
        _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(m1, xs, _mm512_fmadd_ps(
            d1, _mm512_loadu_ps(c + 32 * r + 16), _mm512_loadu_ps(a + 16))));
      }
    };
    configure_tiles(static_cast<int>(h));
    for (int64_t b = 0; b < std::min<int64_t>(kAhead, nb); ++b) lay_out(b);
    for (int64_t b = 0; b < nb; ++b) {
      _tile_loadd(3, quants[b % (kAhead + 1)], 64);
      _tile_loadd(7, quants[b % (kAhead + 1)] + 512, 64);
      const uint16_t* xb = parts + b * 3 * padded * kBlock;
      float* c = products.data() + (b & 1) * padded * 32;
      for (int64_t r = 0; r < padded; r += h) {
        _tile_zero(4);
        _tile_zero(5);
        // The small parts first: the sum grows from its smallest terms.
        _tile_loadd(0, xb + (2 * padded + r) * kBlock, 64);
        _tile_loadd(1, xb + (padded + r) * kBlock, 64);
        _tile_loadd(2, xb + r * kBlock, 64);
        _tile_dpbf16ps(4, 0, 3);
        _tile_dpbf16ps(5, 0, 7);
        _tile_dpbf16ps(4, 1, 3);
        _tile_dpbf16ps(5, 1, 7);
        _tile_dpbf16ps(4, 2, 3);
        _tile_dpbf16ps(5, 2, 7);
        _tile_stored(4, c + 32 * r, 128);
        _tile_stored(5, c + 32 * r + 16, 128);
      }
      if (b + kAhead < nb) lay_out(b + kAhead);
      if (b > 0) sum_into_acc(b - 1);
    }
    sum_into_acc(nb - 1);
    _tile_release();
    for (int t = 0; t < (two ? 2 : 1); ++t) {
      const int64_t n0 = (2 * task + t) * kTile;
      const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < M; ++r)
        _mm512_storeu_ps(out + r * N + n0,
                         _mm512_add_ps(_mm512_loadu_ps(acc.data() + 32 * r + 16 * t), bv));
    }
  });
}

#endif  // RAYGEN_AMX

}  // namespace

bool amx_usable() {
#if defined(RAYGEN_AMX)
  // Linux hands a process AMX's tile data only when asked (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); where it refuses, the vector kernels serve every step.
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

bool amx_lanes_product(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* w,
                       int64_t N, const float* bias, float* out) {
#if defined(RAYGEN_AMX)
  if ((type != kQ4_0 && type != kQ4_1 && type != kQ8_0) || N % kTile != 0 || !amx_usable())
    return false;
  // Rows in chunks of up to kChunkRows: each task reads all of its chunk's x parts, which
  // then stay in the caches (280 rows at once took 0.94x the float32 panels' time, in
  // chunks 0.76-0.82x; 512 rows 1.04x and 0.89x: benchmarks/NOTES.md 114).
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows, rows = (M + chunks - 1) / chunks;
  for (int64_t r = 0; r < M; r += rows) {
    const int64_t m = std::min(rows, M - r);
    if (type == kQ4_1) amx_product<kQ4_1>(x + r * K, m, K, w, N, bias, out + r * N);
    else if (type == kQ4_0) amx_product<kQ4_0>(x + r * K, m, K, w, N, bias, out + r * N);
    else amx_product<kQ8_0>(x + r * K, m, K, w, N, bias, out + r * N);
  }
  return true;
#else
  (void)type, (void)x, (void)M, (void)K, (void)w, (void)N, (void)bias, (void)out;
  return false;
#endif
}
