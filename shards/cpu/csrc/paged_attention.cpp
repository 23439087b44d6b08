// Decode attention on CPU, read straight from the paged KV cache.
//
// One query token per row (a sequence, or a draft token, which attends as one more row of
// its request). Each (row, kv head) is scored by its G = H / KVH query heads against the
// row's tokens block by block through the block table, softmaxed, and V is summed the same
// way; the rows of one request run as one task per kv head. Nothing is gathered or padded:
// K and V are read once, in place. The torch backend (shards/model/attention.py) computes the same
// thing with a gather and SDPA; this replaces only its decode part.
//
// The cache holds float32, or float16 (`kv_cache_dtype=float16`: half the bytes a step
// reads), widened to float32 as it is read; q, the arithmetic and the output are float32.
#include "ops.h"

#include "bounds.h"
#include "claim.h"
#include "exp.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Asks for one head's rows of a block ahead of their use. A task reads its head's 4 cache
// lines of each token, 1 KB apart: the hardware prefetcher does not follow that pattern
// across blocks, and without this the kernel read 9.8 GB/s of the machine's 20.7
// (benchmarks/NOTES.md 44).
template <typename C>
inline void prefetch_block(const C* rows, int64_t block_size, int64_t token_stride,
                           int64_t head_dim) {
  for (int64_t s = 0; s < block_size; ++s)
    for (int64_t d = 0; d < head_dim; d += 64 / sizeof(C))
      __builtin_prefetch(rows + s * token_stride + d);
}

// A cache element as float32 (the scalar paths).
inline float widen(float x) { return x; }
inline float widen(c10::Half x) { return static_cast<float>(x); }

// x[t] = e^(x[t] - max x) for t < n; returns their sum. Vectorized where exp.h is (with
// the scalar std::exp the kernel took 1.15x the time at 16 sequences of 200 tokens,
// benchmarks/NOTES.md 72).
inline float exp_minus_max(float* x, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vmax = _mm256_set1_ps(max);
  for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float lane : lanes) max = std::max(max, lane);
  for (int64_t i = t; i < n; ++i) max = std::max(max, x[i]);
  const __m256 m = _mm256_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + t), m));
    _mm256_storeu_ps(x + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  _mm256_store_ps(lanes, vsum);
  for (float lane : lanes) sum += lane;
#else
  for (int64_t i = 0; i < n; ++i) max = std::max(max, x[i]);
#endif
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - max);
    sum += x[t];
  }
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RAYGEN_ATTENTION_AVX2 1

// 8 cache elements as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lane j: the sum of v[j]'s 8 lanes.
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a: v[0..3]'s low-half sums, then their high-half sums; b: the same for v[4..7].
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// out[j] = q . k_j * scale for the 8 keys at k + j * stride (D floats each, D % 8 == 0):
// 8 independent chains of FMAs and one transposing sum, where a dot product at a time
// waits on each FMA of its single chain and then sums its lanes.
template <int64_t D, typename C>
inline void scores8(const float* q, const C* k, int64_t stride, float scale, float* out) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j)
      acc[j] = _mm256_fmadd_ps(qv, load8(k + j * stride + i), acc[j]);
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
}
#endif

#if defined(__AVX512F__)
#define RAYGEN_ATTENTION_TILES 1

// The rows of a prompt chunk (prefill chunks of up to 512 tokens come as decode rows, one
// a token) by tiles of queries, on AVX-512 with 64-wide heads and a float32 cache: the
// run's keys of kv head h are copied once, transposed (kt[d][t], 16 tokens to a vector),
// every query (a row's query head) is scored 16 tokens at a time against them, and V is
// summed for QT queries at once, each token's V read once for all of them. Each query's
// arithmetic does not depend on the others in its tile: score t is q . k_t summed over d
// in order, the output sum_t p_t v_t in token order (a query shorter than its tile's
// longest adds zeros past its end, which changes no bit). SmolLM2's heads, 30 layers: 0.62x
// the row-at-a-time kernel's time for a 280-token prompt, 0.58x for 512, 0.72x for 32 rows
// after 300 cached; the copy costs more than it saves for short runs (1.07x at 32 rows
// with nothing cached, 1.33x for a row and 4 drafts), so runs of kTileRows rows or more
// take it: more than any request's drafts (speculate <= 16), which keep the kernel a row
// alone takes, the same bits (benchmarks/NOTES.md 113).
constexpr int QT = 6;  // queries per tile: 6 score vectors, or 24 sums of V beside V's 4
constexpr int64_t kTileRows = 32;

template <int NQ>
inline void score_tile(const float* const (&qs)[QT], const float* kt, int64_t tokens_padded,
                       int64_t chunks, float scale, float* const (&out)[QT]) {
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 acc[NQ];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const float* col = kt + c * 16;
#pragma GCC unroll 8
    for (int d = 0; d < 64; ++d) {
      const __m512 kv = _mm512_loadu_ps(col + d * tokens_padded);
      for (int i = 0; i < NQ; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i][d]), kv, acc[i]);
    }
    for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(out[i] + c * 16, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
  }
}

template <int NQ>
inline void value_tile(const float* const (&ps)[QT], const float* v_cache, const int64_t* slots,
                       int64_t tokens, float* const (&out)[QT], const float (&inv)[QT]) {
  __m512 acc[NQ][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t t = 0; t < tokens; ++t) {
    const float* v = v_cache + slots[t];
    if (t + 16 < tokens)  // a block ahead: the prefetcher does not follow the table
      for (int line = 0; line < 64; line += 16) __builtin_prefetch(v_cache + slots[t + 16] + line);
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16),
                 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
    for (int i = 0; i < NQ; ++i) {
      const __m512 p = _mm512_set1_ps(ps[i][t]);
      acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(p, v2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(p, v3, acc[i][3]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_ps(out[i] + 16 * j, _mm512_mul_ps(acc[i][j], _mm512_set1_ps(inv[i])));
}

template <typename Run>
inline void with_queries(int n, Run&& run) {
  switch (n) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    default: run(std::integral_constant<int, QT>{}); break;
  }
}

// Where kv head h of each of a row's first `tokens` tokens starts in the cache.
template <typename index_t>
void token_offsets(const index_t* table, int64_t tokens, int64_t block_size,
                   int64_t token_stride, int64_t h, std::vector<int64_t>& out) {
  out.resize(tokens);
  for (int64_t t = 0; t < tokens; ++t)
    out[t] = (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) *
                 token_stride + h * 64;
}

// Scratch of one thread for run_tiles.
struct TileScratch {
  std::vector<float> kt, scores;
  std::vector<int64_t> slots;
};

// Rows b0 .. b1 (one run) for kv head h.
template <typename index_t>
void run_tiles(const float* q, const float* k_cache, const float* v_cache, const index_t* table,
               const index_t* seq_lens, float* out, int64_t b0, int64_t b1, int64_t h,
               int64_t num_heads, int64_t groups, int64_t token_stride, int64_t block_size,
               float scale, TileScratch& s) {
  const int64_t tokens = static_cast<int64_t>(seq_lens[b1 - 1]);  // the run's longest
  const int64_t chunks = (tokens + 15) / 16, padded = chunks * 16;
  s.kt.assign(64 * padded, 0.0f);
  token_offsets(table, tokens, block_size, token_stride, h, s.slots);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* k = k_cache + s.slots[t];
    for (int d = 0; d < 64; ++d) s.kt[d * padded + t] = k[d];
  }
  const int64_t queries = (b1 - b0) * groups;
  s.scores.resize(QT * padded);
  for (int64_t first = 0; first < queries; first += QT) {
    const int n = static_cast<int>(std::min<int64_t>(QT, queries - first));
    const float* qs[QT] = {};
    float* sc[QT] = {};
    float* os[QT] = {};
    float inv[QT] = {};
    int64_t longest = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t b = b0 + (first + i) / groups, g = (first + i) % groups;
      qs[i] = q + (b * num_heads + h * groups + g) * 64;
      os[i] = out + (b * num_heads + h * groups + g) * 64;
      sc[i] = s.scores.data() + i * padded;
    }
    with_queries(n, [&](auto nq) {
      constexpr int NQ = decltype(nq)::value;
      // Only as many 16-token chunks as this tile's longest query reaches.
      const int64_t last_b = b0 + (first + n - 1) / groups;
      const int64_t tile_tokens = static_cast<int64_t>(seq_lens[last_b]);
      score_tile<NQ>(qs, s.kt.data(), padded, (tile_tokens + 15) / 16, scale, sc);
      for (int i = 0; i < NQ; ++i) {
        const int64_t b = b0 + (first + i) / groups;
        const int64_t len = static_cast<int64_t>(seq_lens[b]);
        inv[i] = 1.f / exp_minus_max(sc[i], len);
        std::fill(sc[i] + len, sc[i] + tile_tokens, 0.0f);
        longest = std::max(longest, len);
      }
      value_tile<NQ>(sc, v_cache, s.slots.data(), longest, os, inv);
    });
  }
}
#endif

// Runs of rows that read the same cache: a request's row and its drafts (each attending
// to one more token than the row before it, through the same block table). Returned as
// the first row of each run, then `batch`. A run is cut at `most` rows.
template <typename index_t>
std::vector<int64_t> same_cache_runs(const index_t* tables, const index_t* seq_lens,
                                     int64_t batch, int64_t block_size, int64_t max_blocks,
                                     int64_t most) {
  std::vector<int64_t> starts{0};
  for (int64_t b = 1; b < batch; ++b) {
    const index_t* prev = tables + (b - 1) * max_blocks;
    const index_t* cur = tables + b * max_blocks;
    const int64_t blocks = (static_cast<int64_t>(seq_lens[b]) + block_size - 1) / block_size;
    const bool follows = seq_lens[b] == seq_lens[b - 1] + 1 && b - starts.back() < most &&
                         std::equal(cur, cur + blocks, prev);
    if (!follows) starts.push_back(b);
  }
  starts.push_back(batch);
  return starts;
}

// D is the head size: a compile-time constant lets the compiler keep a row in registers
// and vectorize the dot products fully (0 = any size, read at run time). A task is one
// run of rows that read the same cache (same_cache_runs) and one kv head: its rows run
// back to back on one thread, so the head's blocks are read from memory once a step and
// from cache after, where a task per row read a request's blocks once for each of its
// drafts (benchmarks/NOTES.md 111). Each row's arithmetic is the same whatever run it is
// in, so a row gives the same bits with and without drafts beside it. (Reading whole
// token rows for all heads at once measured slower on long contexts.)
template <int64_t D, typename C, typename index_t>
void decode_kernel(const float* __restrict__ q, const C* __restrict__ k_cache,
                   const C* __restrict__ v_cache, const index_t* __restrict__ tables,
                   const index_t* __restrict__ seq_lens, float* __restrict__ out,
                   int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t dyn_head_dim,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t head_dim = D ? D : dyn_head_dim;
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between slots of one block
  const int64_t block_stride = block_size * token_stride;
  // Few runs (one request and its drafts): cut them so that every thread has two tasks.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> runs = same_cache_runs(tables, seq_lens, batch, block_size, max_blocks,
                                              batch);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  if (num_runs * num_kv_heads < 2 * threads && batch > num_runs) {
    const int64_t cuts = (2 * threads + num_runs * num_kv_heads - 1) / (num_runs * num_kv_heads);
    const int64_t most = std::max<int64_t>(1, (batch / num_runs + cuts - 1) / cuts);
    runs = same_cache_runs(tables, seq_lens, batch, block_size, max_blocks, most);
  }
  // Tasks (one run's kv head each) are claimed one at a time (claim.h), each thread with
  // its own scratch.
  const int64_t tasks = (static_cast<int64_t>(runs.size()) - 1) * num_kv_heads;
  for_each_claimed(tasks, [&] {
    return [&, scores = std::vector<float>(),
            acc = std::vector<float>(groups * head_dim)
#if defined(RAYGEN_ATTENTION_TILES)
            , scratch = TileScratch()
#endif
            ](int64_t task) mutable {
      const int64_t run = task / num_kv_heads, h = task % num_kv_heads;
#if defined(RAYGEN_ATTENTION_TILES)
      if constexpr (D == 64 && std::is_same_v<C, float>) {
        if (runs[run + 1] - runs[run] >= kTileRows) {
          run_tiles(q, k_cache, v_cache, tables + runs[run] * max_blocks, seq_lens, out, runs[run],
                    runs[run + 1], h, num_heads, groups, token_stride, block_size, scale, scratch);
          return;
        }
      }
#endif
      for (int64_t b = runs[run]; b < runs[run + 1]; ++b) {
        const int64_t len = static_cast<int64_t>(seq_lens[b]);
        const int64_t num_blocks = (len + block_size - 1) / block_size;
        const index_t* table = tables + b * max_blocks;
        const float* qb = q + (b * num_heads + h * groups) * head_dim;
        scores.resize(groups * len);
        // Scores, block by block: scores[g][t] = q_g . k_t * scale.
        for (int64_t blk = 0; blk < num_blocks; ++blk) {
          const C* kb = k_cache + static_cast<int64_t>(table[blk]) * block_stride + h * head_dim;
          const int64_t first = blk * block_size, n = std::min(block_size, len - first);
          if (blk + 1 < num_blocks)
            prefetch_block(k_cache + static_cast<int64_t>(table[blk + 1]) * block_stride +
                               h * head_dim, block_size, token_stride, head_dim);
          int64_t s = 0;
  #if defined(RAYGEN_ATTENTION_AVX2)
          if constexpr (D % 8 == 0 && D > 0)
            for (; s + 8 <= n; s += 8)
              for (int64_t g = 0; g < groups; ++g)
                scores8<D>(qb + g * head_dim, kb + s * token_stride, token_stride, scale,
                           scores.data() + g * len + first + s);
  #endif
          for (; s < n; ++s) {
            const C* k = kb + s * token_stride;
            for (int64_t g = 0; g < groups; ++g) {
              const float* qg = qb + g * head_dim;
              float dot = 0.f;
  #pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * widen(k[d]);
              scores[g * len + first + s] = dot * scale;
            }
          }
        }
#if defined(RAYGEN_ATTENTION_TILES)
        // V summed for all the kv head's query heads at once (value_tile), each token's V
        // read once for them: each head's sums as below, in the same order, the same bits;
        // 0.97-0.98x the attention's time at 1-5 rows, 0.89x for 8 requests with 4 drafts
        // each, where the reads do not bound it (benchmarks/NOTES.md 113).
        if constexpr (D == 64 && std::is_same_v<C, float>) {
          if (groups <= QT) {
            const float* ps[QT] = {};
            float* os[QT] = {};
            float inv[QT] = {};
            for (int64_t g = 0; g < groups; ++g) {
              float* sc = scores.data() + g * len;
              inv[g] = 1.f / exp_minus_max(sc, len);
              ps[g] = sc;
              os[g] = out + (b * num_heads + h * groups + g) * head_dim;
            }
            token_offsets(table, len, block_size, token_stride, h, scratch.slots);
            with_queries(static_cast<int>(groups), [&](auto nq) {
              value_tile<decltype(nq)::value>(ps, v_cache, scratch.slots.data(), len, os, inv);
            });
            continue;
          }
        }
#endif
        for (int64_t g = 0; g < groups; ++g) {
          // Softmax of this query head's scores (the 1 / sum is applied at the end).
          float* sc = scores.data() + g * len;
          const float sum = exp_minus_max(sc, len);
          float* o = out + (b * num_heads + h * groups + g) * head_dim;
          const float inv = 1.f / sum;
  #if defined(RAYGEN_ATTENTION_AVX2)
          if constexpr (D % 64 == 0 && D > 0) {
            // Weighted sum of V, 64 columns at a time in 8 registers (the sums in memory
            // waited on a store and a load per token).
            for (int64_t c = 0; c < D; c += 64) {
              __m256 a[8];
              for (auto& x : a) x = _mm256_setzero_ps();
              for (int64_t blk = 0; blk < num_blocks; ++blk) {
                const C* vb = v_cache + static_cast<int64_t>(table[blk]) * block_stride +
                              h * head_dim + c;
                const int64_t first = blk * block_size, n = std::min(block_size, len - first);
                if (g == 0 && c == 0 && blk + 1 < num_blocks)
                  prefetch_block(v_cache + static_cast<int64_t>(table[blk + 1]) * block_stride +
                                     h * head_dim, block_size, token_stride, head_dim);
                for (int64_t s = 0; s < n; ++s) {
                  const __m256 p = _mm256_set1_ps(sc[first + s]);
                  const C* v = vb + s * token_stride;
                  for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), a[i]);
                }
              }
              for (int i = 0; i < 8; ++i)
                _mm256_storeu_ps(o + c + 8 * i, _mm256_mul_ps(a[i], _mm256_set1_ps(inv)));
            }
            continue;
          }
  #endif
          // Weighted sum of V, block by block.
          float* a = acc.data() + g * head_dim;
          std::fill(a, a + head_dim, 0.f);
          for (int64_t blk = 0; blk < num_blocks; ++blk) {
            const C* vb = v_cache + static_cast<int64_t>(table[blk]) * block_stride + h * head_dim;
            const int64_t first = blk * block_size, n = std::min(block_size, len - first);
            if (g == 0 && blk + 1 < num_blocks)  // the next query heads find it in cache
              prefetch_block(v_cache + static_cast<int64_t>(table[blk + 1]) * block_stride +
                                 h * head_dim, block_size, token_stride, head_dim);
            for (int64_t s = 0; s < n; ++s) {
              const C* v = vb + s * token_stride;
              const float p = sc[first + s];
  #pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += p * widen(v[d]);
            }
          }
          for (int64_t d = 0; d < head_dim; ++d) o[d] = a[d] * inv;
        }
      }
    };
  });
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables:
// [B, max_blocks]; seq_lens: [B] (tokens in the cache, the new one included).
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode runs on CPU");
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "paged_decode takes a float32 q and float32 or float16 caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: q [B, H, D], caches [blocks, block_size, KVH, D]");
  TORCH_CHECK(block_tables.scalar_type() == seq_lens.scalar_type(),
              "block_tables and seq_lens must share a dtype");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "paged_decode: head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == batch && seq_lens.size(0) == batch,
              "paged_decode: one table row and one length per sequence");
  auto out = at::empty_like(q);
  if (batch == 0) return out;
  const int64_t max_blocks = block_tables.size(1);
  // Reads go through these: check them once rather than trust them per token.
  AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_decode", [&] {
    TORCH_CHECK(all_within<index_t>(seq_lens, 1, max_blocks * block_size + 1),
                "paged_decode: a sequence length is outside its block table");
    TORCH_CHECK(all_within<index_t>(block_tables, 0, k_cache.size(0)),
                "paged_decode: a block id is outside the cache");
    auto typed = [&](auto cache_type) {
      using C = decltype(cache_type);
      auto run = [&](auto kernel) {
        kernel(q.data_ptr<float>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
               block_tables.data_ptr<index_t>(), seq_lens.data_ptr<index_t>(),
               out.data_ptr<float>(), batch, num_heads, num_kv_heads, head_dim, block_size,
               max_blocks, static_cast<float>(scale));
      };
      if (head_dim == 64) run(decode_kernel<64, C, index_t>);
      else if (head_dim == 128) run(decode_kernel<128, C, index_t>);
      else run(decode_kernel<0, C, index_t>);
    };
    if (k_cache.scalar_type() == at::kHalf) typed(c10::Half{});
    else typed(float{});
  });
  return out;
}
