// What both block products share (quant_linear.cpp: x in float32; quant_linear_i8.cpp: x
// rounded to int8 blocks): the block types and sizes, the tiling of an output over threads,
// and the checks of a call.
#pragma once

#include "bias.h"
#include "claim.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define RAYGEN_QUANT_FLOAT 1
#include <immintrin.h>
#endif

namespace {

// kF32: float32 weights, laid out in rows in lanes only (quant_lanes.cpp); the block
// kernels refuse it (block_bytes 0).
enum QuantType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kBF16 = 3, kF32 = 4 };
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

#endif  // RAYGEN_QUANT_FLOAT

// Tiles of several weight rows (steps of up to 4 rows of x), float and int8 products on
// AVX2, ask for each block's weights kNextTiles tiles further on. One tile ahead (about
// 1.4 KB of SmolLM2's rows) left those steps waiting on memory: the 30 layers' Q4_1
// linears read from memory took 12.0-12.8 against 10.1-11.1 ms at one row with float
// products, 9.1-13.4 against 6.2-10.2 ms with int8 ones (benchmarks/NOTES.md 78, 79).
// Tiles of one weight row (5 or more rows of x) are bound by their arithmetic and ask one
// tile ahead. A prefetch past the weights' end is dropped, not a fault.
constexpr int64_t kNextTiles = 8;

template <int NR>
constexpr int64_t rows_ahead() {
  return NR > 1 ? kNextTiles * NR : NR;
}

template <int V>
using Int = std::integral_constant<int, V>;

// run(MR) with the step's row count as a constant: each tile shape compiles on its own,
// for the row counts up to the tile's MAXR only (over_tiles never asks for more). Tiles of
// 2 and 4 rows of x also compiled for up to 8 took each block-product file 31-38 s to
// build instead of 18-22 (benchmarks/NOTES.md 76).
template <int MAXR, typename Run>
void with_rows(int mr, Run&& run) {
  static_assert(MAXR >= 1 && MAXR <= 8, "tiles of 1 to 8 rows of x");
  switch (mr) {
    case 8: if constexpr (MAXR >= 8) return run(Int<8>{}); break;
    case 7: if constexpr (MAXR >= 7) return run(Int<7>{}); break;
    case 6: if constexpr (MAXR >= 6) return run(Int<6>{}); break;
    case 5: if constexpr (MAXR >= 5) return run(Int<5>{}); break;
    case 4: if constexpr (MAXR >= 4) return run(Int<4>{}); break;
    case 3: if constexpr (MAXR >= 3) return run(Int<3>{}); break;
    case 2: if constexpr (MAXR >= 2) return run(Int<2>{}); break;
    default: break;
  }
  run(Int<1>{});
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
          with_rows<MAXR>(static_cast<int>(std::min<int64_t>(per_tile, M - r)), [&](auto mr) {
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

// Steps of several rows times Q4_0/Q4_1/Q8_0 rows in lanes on AMX tiles, x kept exact
// (quant_amx.cpp): false where not built for AMX, not granted it (ops.h: amx_usable), or
// not one of those types with whole tiles of 16 output rows (the caller multiplies then).
bool amx_lanes_product(int64_t type, const float* x, int64_t M, int64_t K, const uint8_t* w,
                       int64_t N, const float* bias, float* out);
