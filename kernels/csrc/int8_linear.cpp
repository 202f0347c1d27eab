// Weight-only int8 linear: y[t, n] = scale[n] * sum_k x[t, k] * w[n, k] (+ bias[n]), x and y fp32,
// w int8 [N, Kp] (K zero-padded to Kp, a multiple of 64; layout in kernels/quant_formats.py).
//
// The activations stay fp32: each int8 weight is widened to fp32 (exact) and FMA'd with x, so the
// only rounding is fp32 accumulation, as in an fp32 GEMV on the de-quantized weight.
//
// Batch invariance (speculative verification and continuous batching compare one sequence's
// tokens across batch compositions, so a token's logits must not depend on who shares the step):
// every output element has one fixed sequence of operations whatever T, the tiling or the thread:
//   AVX-512  one 16-lane accumulator, FMA'd over k in 16-wide chunks in order (the last chunk with
//            x masked to K), reduced by the same symmetric tree (hsum16x16: each vector's sum is
//            ((l0+l2)+(l1+l3)) per 128-bit lane, then (L0+L1)+(L2+L3), whatever its position),
//            then y = fma(sum, scale, bias).
//   AVX2     the same with 8 lanes (hsum256).
//   scalar   a plain ordered sum over k.
// Tiling only decides which of those independent chains run side by side (widening is exact).
//
// Tiling: OpenMP splits the rows in 16-row tiles; a thread walks its tiles once per block of
// tokens (all T unless x would overflow ~256 KB of L2, so a 512-token prefill takes a few blocks).
// In a tile, the tokens go up to 8 at a time through register blocks of R rows x TT tokens
// (R x TT accumulators, R = 8 / 4 / 2 as TT grows): the 16 int8 rows (~9 KB at K = 576) and 8
// tokens of x stay in L1, and each 16-weight chunk is widened once per pass and used TT times. A
// weight row thus comes from DRAM once per token block (batch-1 decode: once; it is bound by
// reading weights, 1 byte each) and the next rows are prefetched while a block computes.
// (Widening a tile to fp32 once and reusing it across passes was measured slower: the fp32 tile,
// 4x the bytes, pushed x out of L1.) The AVX2 path has the same structure with 8-lane chunks.
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

constexpr int64_t kRowTile = 16;    // rows per tile = vectors per hsum16x16
constexpr int kMaxTokens = 8;       // tokens per pass over a tile
constexpr int64_t kTokenBlockBytes = 256 << 10;  // x rows per walk over the tiles: at most this many bytes
constexpr int64_t kMinParallelWork = 1 << 16;  // weights x tokens; below this one thread wins

struct Problem {
  const float* x;
  int64_t x_stride;
  const int8_t* w;  // [N, Kp]
  int64_t Kp;
  const float* scale;
  const float* bias;
  float* y;
  int64_t y_stride;
  int64_t K;
};

// ------------------------------------------------------------------------------------ scalar
void tile_scalar(const Problem& p, int64_t n0, int64_t n1, int64_t t0, int64_t t1, int64_t) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * p.Kp;
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = p.x + t * p.x_stride;
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc += x[k] * static_cast<float>(w[k]);
      p.y[t * p.y_stride + n] = acc * p.scale[n] + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

// -------------------------------------------------------------------------------------- AVX2
DUET_AVX2 DUET_INLINE __m256 widen8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// R rows x TT tokens, one 8-lane chain each over k. Weights past K are zero (padding), x is masked.
template <int TT, int R>
DUET_AVX2 void block_avx2(const Problem& p, int64_t n, int64_t t0) {
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  const int8_t* w = p.w + n * p.Kp;
  const float* x = p.x + t0 * p.x_stride;
  int64_t k = 0;
  for (; k + 8 <= p.K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen8(w + r * p.Kp + k);
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * p.x_stride + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(xv, wv[r], acc[r][t]);
    }
  }
  if (k < p.K) {
    const __m256i m = tail_mask256(static_cast<int>(p.K - k));
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen8(w + r * p.Kp + k);  // k + 8 <= Kp: in bounds
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = _mm256_maskload_ps(x + t * p.x_stride + k, m);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(xv, wv[r], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t)
      p.y[(t0 + t) * p.y_stride + n + r] = hsum256(acc[r][t]) * p.scale[n + r] + (p.bias ? p.bias[n + r] : 0.f);
}

template <int TT>
void rows_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t t0) {
  constexpr int R = TT <= 2 ? 4 : TT <= 4 ? 2 : 1;  // 16 ymm: R x TT accumulators + R weights + x
  int64_t n = n0;
  for (; n + R <= n1; n += R) block_avx2<TT, R>(p, n, t0);
  for (; n < n1; ++n) block_avx2<TT, 1>(p, n, t0);
}

// ------------------------------------------------------------------------------------ AVX-512
DUET_AVX512 DUET_INLINE __m512 widen16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// R rows from w (row stride Kp) x TT tokens, one 16-lane chain each over k; lane partials go to
// sums[t * 16 + r]. `next` (may be null): the following R rows, prefetched a cache line per row as
// k crosses one, so they are on their way from DRAM while this block computes (the hardware
// prefetcher alone, facing R interleaved 16-byte streams, keeps too few lines in flight, and
// batch-1 decode then falls well short of the memory bandwidth).
template <int TT, int R>
DUET_AVX512 DUET_INLINE void block_avx512(const Problem& p, const int8_t* w, int64_t t0, __m512* sums,
                                          const int8_t* next) {
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* x = p.x + t0 * p.x_stride;
  int64_t k = 0;
  for (; k + 16 <= p.K; k += 16) {
    if (next && (k & 63) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * p.Kp + k), _MM_HINT_T0);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen16(w + r * p.Kp + k);
    for (int t = 0; t < TT; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * p.x_stride + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(xv, wv[r], acc[r][t]);
    }
  }
  if (k < p.K) {
    const __mmask16 m = tail_mask512(static_cast<int>(p.K - k));
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = widen16(w + r * p.Kp + k);  // k + 16 <= Kp: in bounds, zero past K
    for (int t = 0; t < TT; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * p.x_stride + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(xv, wv[r], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) sums[t * 16 + r] = acc[r][t];
}

// y rows [n0, n0 + rows) of tokens [t0, t0 + TT): reduce each token's 16 row chains, scale, bias.
DUET_AVX512 DUET_INLINE void store_tile(const Problem& p, int TT, const __m512* sums, int64_t n0, int64_t rows,
                                        int64_t t0) {
  const __mmask16 m = tail_mask512(static_cast<int>(rows));
  const __m512 scale = _mm512_maskz_loadu_ps(m, p.scale + n0);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + n0) : _mm512_setzero_ps();
  for (int t = 0; t < TT; ++t)
    _mm512_mask_storeu_ps(p.y + (t0 + t) * p.y_stride + n0, m, _mm512_fmadd_ps(hsum16x16(sums + t * 16), scale, bias));
}

// One pass of TT tokens [t0, t0 + TT) over the tile of rows [n0, n1) (at most 16).
template <int TT>
DUET_AVX512 void pass_avx512(const Problem& p, int64_t n0, int64_t n1, int64_t t0, int64_t N) {
  constexpr int R = TT <= 2 ? 8 : TT <= 6 ? 4 : 2;  // 32 zmm: R x TT accumulators + R weights + x
  __m512 sums[TT * 16];
  for (int i = 0; i < TT * 16; ++i) sums[i] = _mm512_setzero_ps();
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    block_avx512<TT, R>(p, p.w + n * p.Kp, t0, sums + (n - n0), n + 2 * R <= N ? p.w + (n + R) * p.Kp : nullptr);
  for (; n < n1; ++n) block_avx512<TT, 1>(p, p.w + n * p.Kp, t0, sums + (n - n0), nullptr);
  store_tile(p, TT, sums, n0, n1 - n0, t0);
}

void tile_avx512(const Problem& p, int64_t n0, int64_t n1, int64_t t0, int64_t t1, int64_t N) {
  for (int64_t t = t0; t < t1; t += kMaxTokens) {
    switch (t1 - t < kMaxTokens ? t1 - t : kMaxTokens) {
      case 1: pass_avx512<1>(p, n0, n1, t, N); break;
      case 2: pass_avx512<2>(p, n0, n1, t, N); break;
      case 3: pass_avx512<3>(p, n0, n1, t, N); break;
      case 4: pass_avx512<4>(p, n0, n1, t, N); break;
      case 5: pass_avx512<5>(p, n0, n1, t, N); break;
      case 6: pass_avx512<6>(p, n0, n1, t, N); break;
      case 7: pass_avx512<7>(p, n0, n1, t, N); break;
      default: pass_avx512<8>(p, n0, n1, t, N); break;
    }
  }
}

// ---------------------------------------------------------------------------------- driver
void tile_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t t0, int64_t t1, int64_t) {
  for (int64_t t = t0; t < t1; t += kMaxTokens) {
    switch (t1 - t < kMaxTokens ? t1 - t : kMaxTokens) {
      case 1: rows_avx2<1>(p, n0, n1, t); break;
      case 2: rows_avx2<2>(p, n0, n1, t); break;
      case 3: rows_avx2<3>(p, n0, n1, t); break;
      case 4: rows_avx2<4>(p, n0, n1, t); break;
      case 5: rows_avx2<5>(p, n0, n1, t); break;
      case 6: rows_avx2<6>(p, n0, n1, t); break;
      case 7: rows_avx2<7>(p, n0, n1, t); break;
      default: rows_avx2<8>(p, n0, n1, t); break;
    }
  }
}

// Rows [n0, n1) (one tile) x tokens [t0, t1); N bounds the prefetch.
using TileFn = void (*)(const Problem&, int64_t n0, int64_t n1, int64_t t0, int64_t t1, int64_t N);

}  // namespace

void int8_weight_only_linear_f32(const float* x, int64_t x_stride, const int8_t* w, const float* scale,
                                 const float* bias, float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K,
                                 int64_t Kp, int max_threads) {
  if (T <= 0 || N <= 0) return;
  const Isa isa = active_isa();
  const TileFn tile = isa == Isa::kAvx512 ? tile_avx512 : isa == Isa::kAvx2 ? tile_avx2 : tile_scalar;
  const Problem p{x, x_stride, w, Kp, scale, bias, y, y_stride, K};
  const int64_t tiles = (N + kRowTile - 1) / kRowTile;
  const int nt = pick_threads(max_threads, N * Kp * (T < kMaxTokens ? T : kMaxTokens), kMinParallelWork, tiles);
  const int64_t x_row_bytes = 4 * (K > 0 ? K : 1);
  const int64_t tb = std::max<int64_t>(kMaxTokens, kTokenBlockBytes / x_row_bytes / kMaxTokens * kMaxTokens);
  auto rows = [&](int64_t b0, int64_t b1) {  // tiles [b0, b1), one token block at a time
    for (int64_t t0 = 0; t0 < T; t0 += tb)
      for (int64_t b = b0; b < b1; ++b)
        tile(p, b * kRowTile, std::min(N, (b + 1) * kRowTile), t0, std::min(T, t0 + tb), N);
  };
  if (nt == 1) return rows(0, tiles);
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num(), n_threads = omp_get_num_threads();
    rows(tiles * i / n_threads, tiles * (i + 1) / n_threads);
  }
}

}  // namespace duet
