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
// Tiling only decides which of those independent chains run side by side. Widening is exact, so
// converting a weight tile to fp32 once (below) or on the fly gives the same bits.
//
// Tiling (AVX-512): OpenMP splits the rows in 16-row tiles (a weight row is read from DRAM once per
// call). A tile's tokens go up to 8 at a time through a register block of R rows x TT tokens
// (R x TT accumulators, R = 8 / 4 / 2 as TT grows). With T <= 8 the int8 rows are widened on the
// fly (batch-1 decode is bound by reading weights, 1 byte each); with more tokens the tile is
// widened once into a per-thread fp32 buffer (16 x Kp floats, L1/L2) that every token pass reuses,
// so the inner loop is pure loads + FMAs. The AVX2 path widens on the fly, row by row.
#include <omp.h>

#include <cstdint>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

constexpr int64_t kRowTile = 16;    // rows per tile = vectors per hsum16x16
constexpr int kMaxTokens = 8;       // tokens per pass over a tile
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
void tile_scalar(const Problem& p, int64_t n0, int64_t n1, int64_t T) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * p.Kp;
    for (int64_t t = 0; t < T; ++t) {
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
// Weights of one block: int8 rows widened per chunk, or a tile already widened to fp32.
struct I8Rows {
  const int8_t* w;
  int64_t stride;
};
struct F32Rows {
  const float* w;
  int64_t stride;
};

DUET_AVX512 DUET_INLINE __m512 load_w(const I8Rows& s, int r, int64_t k) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.w + r * s.stride + k))));
}
DUET_AVX512 DUET_INLINE __m512 load_w(const F32Rows& s, int r, int64_t k) { return _mm512_load_ps(s.w + r * s.stride + k); }

// R rows x TT tokens, one 16-lane chain each over k; lane partials go to sums[t * 16 + r].
template <int TT, int R, typename Rows>
DUET_AVX512 DUET_INLINE void block_avx512(const Problem& p, const Rows& rows, int64_t t0, __m512* sums) {
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* x = p.x + t0 * p.x_stride;
  int64_t k = 0;
  for (; k + 16 <= p.K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_w(rows, r, k);
    for (int t = 0; t < TT; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * p.x_stride + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(xv, wv[r], acc[r][t]);
    }
  }
  if (k < p.K) {
    const __mmask16 m = tail_mask512(static_cast<int>(p.K - k));
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_w(rows, r, k);  // k + 16 <= Kp: in bounds, zero past K
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

// One pass of TT tokens over the tile of rows [n0, n1) (at most 16), weights from `rows`.
template <int TT, typename Rows>
DUET_AVX512 void pass_avx512(const Problem& p, const Rows& rows, int64_t n0, int64_t n1, int64_t t0) {
  constexpr int R = TT <= 2 ? 8 : TT <= 6 ? 4 : 2;  // 32 zmm: R x TT accumulators + R weights + x
  __m512 sums[TT * 16];
  for (int i = 0; i < TT * 16; ++i) sums[i] = _mm512_setzero_ps();
  int64_t r = 0;
  const int64_t n = n1 - n0;
  for (; r + R <= n; r += R) block_avx512<TT, R>(p, Rows{rows.w + r * rows.stride, rows.stride}, t0, sums + r);
  for (; r < n; ++r) block_avx512<TT, 1>(p, Rows{rows.w + r * rows.stride, rows.stride}, t0, sums + r);
  store_tile(p, TT, sums, n0, n, t0);
}

template <typename Rows>
void pass_any(const Problem& p, const Rows& rows, int64_t n0, int64_t n1, int64_t t0, int TT) {
  switch (TT) {
    case 1: return pass_avx512<1>(p, rows, n0, n1, t0);
    case 2: return pass_avx512<2>(p, rows, n0, n1, t0);
    case 3: return pass_avx512<3>(p, rows, n0, n1, t0);
    case 4: return pass_avx512<4>(p, rows, n0, n1, t0);
    case 5: return pass_avx512<5>(p, rows, n0, n1, t0);
    case 6: return pass_avx512<6>(p, rows, n0, n1, t0);
    case 7: return pass_avx512<7>(p, rows, n0, n1, t0);
    default: return pass_avx512<8>(p, rows, n0, n1, t0);
  }
}

// Widens rows [n0, n1) of w (only the chunks up to K, which is all the passes read) into buf.
DUET_AVX512 void widen_tile(const Problem& p, int64_t n0, int64_t n1, float* buf, int64_t stride) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = 0; k < p.K; k += 16)
      _mm512_store_ps(buf + (n - n0) * stride + k,
                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                          reinterpret_cast<const __m128i*>(p.w + n * p.Kp + k)))));
}

// Per-thread fp32 tile, 64-byte aligned (over-allocated by one cache line).
thread_local std::vector<float> t_tile;

float* tile_buffer(int64_t floats) {
  if (static_cast<int64_t>(t_tile.size()) < floats + 16) t_tile.resize(floats + 16);
  const uintptr_t a = reinterpret_cast<uintptr_t>(t_tile.data());
  return reinterpret_cast<float*>((a + 63) & ~static_cast<uintptr_t>(63));
}

void tile_avx512(const Problem& p, int64_t n0, int64_t n1, int64_t T) {
  if (T <= kMaxTokens) return pass_any(p, I8Rows{p.w + n0 * p.Kp, p.Kp}, n0, n1, 0, static_cast<int>(T));
  const int64_t stride = (p.K + 15) / 16 * 16;
  float* buf = tile_buffer(kRowTile * stride);
  widen_tile(p, n0, n1, buf, stride);
  const F32Rows rows{buf, stride};
  for (int64_t t0 = 0; t0 < T; t0 += kMaxTokens)
    pass_any(p, rows, n0, n1, t0, static_cast<int>(T - t0 < kMaxTokens ? T - t0 : kMaxTokens));
}

// ---------------------------------------------------------------------------------- driver
void tile_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t T) {
  for (int64_t t0 = 0; t0 < T; t0 += kMaxTokens) {
    switch (T - t0 < kMaxTokens ? T - t0 : kMaxTokens) {
      case 1: rows_avx2<1>(p, n0, n1, t0); break;
      case 2: rows_avx2<2>(p, n0, n1, t0); break;
      case 3: rows_avx2<3>(p, n0, n1, t0); break;
      case 4: rows_avx2<4>(p, n0, n1, t0); break;
      case 5: rows_avx2<5>(p, n0, n1, t0); break;
      case 6: rows_avx2<6>(p, n0, n1, t0); break;
      case 7: rows_avx2<7>(p, n0, n1, t0); break;
      default: rows_avx2<8>(p, n0, n1, t0); break;
    }
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t, int64_t);

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
  auto rows = [&](int64_t b0, int64_t b1) {  // tiles [b0, b1)
    for (int64_t b = b0; b < b1; ++b) tile(p, b * kRowTile, (b + 1) * kRowTile < N ? (b + 1) * kRowTile : N, T);
  };
  if (nt == 1) return rows(0, tiles);
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num(), n_threads = omp_get_num_threads();
    rows(tiles * i / n_threads, tiles * (i + 1) / n_threads);
  }
}

}  // namespace duet
