// Per-ISA compute primitives of paged decode attention (included by paged_attention.cpp only).
//
// Each works on the hpg query heads that share one kv head and on a run of n <= kRun consecutive
// cache slots (K/V rows k_stride / v_stride floats apart):
//   scores: s[h * s_stride + i] = scale * <q_h, k_i>
//   accum:  acc[h * D + d] += sum_i p[h * p_stride + i] * v_i[d]
//   expsum: s[i] = exp(s[i] - m), returns the sum;  rowmax: max_i s[i]
// The AVX-512 versions keep a tile of heads' q rows / accumulators in registers when D is 16..128 in
// steps of 16, so each K/V chunk is loaded once per token for the whole tile.
// K/V element type C: float, or bf16_t for a bfloat16 cache (widened to fp32 as it is loaded; q, the
// scores and the accumulators are always fp32). The AVX2 versions are fp32 only: a bf16 cache on an
// AVX2 CPU runs the scalar ones.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common.h"

namespace duet {
namespace attn {

constexpr int64_t kRun = 16;  // tokens scored per primitive call (one hsum16x16)

template <typename C>
using ScoreFn = void (*)(const float* q, int64_t q_sh, int64_t hpg, const C* k, int64_t k_stride,
                         int64_t n, int64_t D, float scale, float* s, int64_t s_stride);
// acc[h * D + d] += sum_i p[h * p_stride + i] * v_i[d], h < hpg, i < n
template <typename C>
using AccumFn = void (*)(const float* p, int64_t p_stride, int64_t hpg, int64_t n, const C* v, int64_t v_stride,
                         int64_t D, float* acc);
// s[i] = exp(s[i] - m); returns the sum
using ExpSumFn = float (*)(float* s, int64_t n, float m);
using RowMaxFn = float (*)(const float* s, int64_t n);

template <typename C>
inline void scores_scalar(const float* q, int64_t q_sh, int64_t hpg, const C* k, int64_t k_stride, int64_t n,
                          int64_t D, float scale, float* s, int64_t s_stride) {
  for (int64_t h = 0; h < hpg; ++h)
    for (int64_t i = 0; i < n; ++i) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[h * q_sh + d] * to_f32(k[i * k_stride + d]);
      s[h * s_stride + i] = acc * scale;
    }
}

template <typename C>
inline void accum_scalar(const float* p, int64_t p_stride, int64_t hpg, int64_t n, const C* v, int64_t v_stride,
                         int64_t D, float* acc) {
  for (int64_t h = 0; h < hpg; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) acc[h * D + d] += p[h * p_stride + i] * to_f32(v[i * v_stride + d]);
}

inline float expsum_scalar(float* s, int64_t n, float m) {
  float l = 0.f;
  for (int64_t i = 0; i < n; ++i) l += (s[i] = std::exp(s[i] - m));
  return l;
}

DUET_AVX2 inline void scores_avx2(const float* q, int64_t q_sh, int64_t hpg, const float* k, int64_t k_stride,
                                  int64_t n, int64_t D, float scale, float* s, int64_t s_stride) {
  const int64_t D8 = D & ~int64_t{7};
  const __m256i m = tail_mask256(static_cast<int>(D - D8));
  for (int64_t h = 0; h < hpg; ++h) {
    const float* qh = q + h * q_sh;
    for (int64_t i = 0; i < n; ++i) {
      const float* ki = k + i * k_stride;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D8; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(ki + d), acc);
      if (D8 < D) acc = _mm256_fmadd_ps(_mm256_maskload_ps(qh + D8, m), _mm256_maskload_ps(ki + D8, m), acc);
      s[h * s_stride + i] = hsum256(acc) * scale;
    }
  }
}

DUET_AVX2 inline void accum1_avx2(const float* p, int64_t n, const float* v, int64_t v_stride, int64_t D, float* acc) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m256i m = tail_mask256(static_cast<int>(std::min<int64_t>(D - d, 8)));
    __m256 a0 = _mm256_maskload_ps(acc + d, m), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_maskload_ps(v + i * v_stride + d, m), a0);
      a1 = _mm256_fmadd_ps(_mm256_set1_ps(p[i + 1]), _mm256_maskload_ps(v + (i + 1) * v_stride + d, m), a1);
    }
    if (i < n) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_maskload_ps(v + i * v_stride + d, m), a0);
    _mm256_maskstore_ps(acc + d, m, _mm256_add_ps(a0, a1));
  }
}

DUET_AVX2 inline void accum_avx2(const float* p, int64_t p_stride, int64_t hpg, int64_t n, const float* v,
                                 int64_t v_stride, int64_t D, float* acc) {
  for (int64_t h = 0; h < hpg; ++h) accum1_avx2(p + h * p_stride, n, v, v_stride, D, acc + h * D);
}

DUET_AVX2 inline float expsum_avx2(float* s, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) {
    const __m256i mk = tail_mask256(static_cast<int>(n - i));
    __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(s + i, mk), vm));
    e = _mm256_and_ps(e, _mm256_castsi256_ps(mk));  // lanes past n contribute 0
    _mm256_maskstore_ps(s + i, mk, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum256(sum);
}

template <typename C>
DUET_AVX512 inline void scores_generic_avx512(const float* q, int64_t q_sh, int64_t hpg, const C* k, int64_t k_stride,
                                              int64_t n, int64_t D, float scale, float* s, int64_t s_stride) {
  const int64_t D16 = D & ~int64_t{15};
  const __mmask16 m = tail_mask512(static_cast<int>(D - D16));
  const __mmask16 mn = tail_mask512(static_cast<int>(n));
  for (int64_t h = 0; h < hpg; ++h) {
    const float* qh = q + h * q_sh;
    __m512 v[kRun];  // v[i] = lane-wise products of q_h and k_i; hsum16x16 turns them into scores
    for (int64_t i = 0; i < kRun; ++i) {
      __m512 acc = _mm512_setzero_ps();
      if (i < n) {
        const C* ki = k + i * k_stride;
        for (int64_t d = 0; d < D16; d += 16)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), load16(ki + d), acc);
        if (D16 < D)
          acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qh + D16), load16(m, ki + D16), acc);
      }
      v[i] = acc;
    }
    _mm512_mask_storeu_ps(s + h * s_stride, mn, _mm512_mul_ps(hsum16x16(v), _mm512_set1_ps(scale)));
  }
}

template <typename C>
DUET_AVX512 inline void accum1_avx512(const float* p, int64_t n, const C* v, int64_t v_stride, int64_t D,
                                      float* acc) {
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(std::min<int64_t>(D - d, 16)));
    __m512 a0 = _mm512_maskz_loadu_ps(m, acc + d), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), load16(m, v + i * v_stride + d), a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[i + 1]), load16(m, v + (i + 1) * v_stride + d), a1);
    }
    if (i < n) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), load16(m, v + i * v_stride + d), a0);
    _mm512_mask_storeu_ps(acc + d, m, _mm512_add_ps(a0, a1));
  }
}

DUET_AVX512 inline float expsum_avx512(float* s, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mk = tail_mask512(static_cast<int>(std::min<int64_t>(n - i, 16)));
    __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + i), vm)));
    _mm512_mask_storeu_ps(s + i, mk, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Register-tiled AVX-512 paths for D = 16 * ND (ND <= 8) and a tile of HT query heads of one group:
// the tile's q rows (scores) or output accumulators (accum) stay in registers, so each K/V chunk is
// loaded once per token and used by all HT heads. HT * ND <= 16 keeps everything in the 32 zmm.
template <typename C, int HT, int ND>
DUET_AVX512 inline void scores_tile(const float* q, int64_t q_sh, const C* k, int64_t k_stride, int64_t n,
                                    float scale, float* s, int64_t s_stride) {
  __m512 qv[HT][ND];
  for (int h = 0; h < HT; ++h)
    for (int c = 0; c < ND; ++c) qv[h][c] = _mm512_loadu_ps(q + h * q_sh + 16 * c);
  alignas(64) __m512 prod[HT][kRun];  // prod[h][i]: lane-wise partial dot products, summed by hsum16x16
  for (int64_t i = 0; i < kRun; ++i) {
    if (i < n) {
      __m512 kv[ND];
      for (int c = 0; c < ND; ++c) kv[c] = load16(k + i * k_stride + 16 * c);
      for (int h = 0; h < HT; ++h) {
        __m512 a0 = _mm512_mul_ps(qv[h][0], kv[0]), a1 = _mm512_setzero_ps();
        for (int c = 1; c < ND; ++c) {
          if (c & 1) a1 = _mm512_fmadd_ps(qv[h][c], kv[c], a1);
          else a0 = _mm512_fmadd_ps(qv[h][c], kv[c], a0);
        }
        prod[h][i] = _mm512_add_ps(a0, a1);
      }
    } else {
      for (int h = 0; h < HT; ++h) prod[h][i] = _mm512_setzero_ps();
    }
  }
  const __mmask16 mn = tail_mask512(static_cast<int>(n));
  for (int h = 0; h < HT; ++h)
    _mm512_mask_storeu_ps(s + h * s_stride, mn, _mm512_mul_ps(hsum16x16(prod[h]), _mm512_set1_ps(scale)));
}

template <typename C, int HT, int ND>
DUET_AVX512 inline void accum_tile(const float* p, int64_t p_stride, int64_t n, const C* v, int64_t v_stride,
                                   float* acc) {
  __m512 a[HT][ND];
  for (int h = 0; h < HT; ++h)
    for (int c = 0; c < ND; ++c) a[h][c] = _mm512_loadu_ps(acc + h * 16 * ND + 16 * c);
  for (int64_t i = 0; i < n; ++i) {
    __m512 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = load16(v + i * v_stride + 16 * c);
    for (int h = 0; h < HT; ++h) {
      const __m512 pb = _mm512_set1_ps(p[h * p_stride + i]);
      for (int c = 0; c < ND; ++c) a[h][c] = _mm512_fmadd_ps(pb, vv[c], a[h][c]);
    }
  }
  for (int h = 0; h < HT; ++h)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + h * 16 * ND + 16 * c, a[h][c]);
}

template <typename C>
using ScoreTileFn = void (*)(const float*, int64_t, const C*, int64_t, int64_t, float, float*, int64_t);
template <typename C>
using AccumTileFn = void (*)(const float*, int64_t, int64_t, const C*, int64_t, float*);

// Largest head tile for ND chunks: HT * ND <= 16, at most 4.
constexpr int max_tile(int nd) { return 16 / nd < 4 ? 16 / nd : 4; }

template <typename C, int ND>
struct TileTable {
  static ScoreTileFn<C> score(int ht) {
    constexpr ScoreTileFn<C> t[4] = {scores_tile<C, 1, ND>, scores_tile<C, (max_tile(ND) >= 2 ? 2 : 1), ND>,
                                     scores_tile<C, (max_tile(ND) >= 3 ? 3 : 1), ND>,
                                     scores_tile<C, (max_tile(ND) >= 4 ? 4 : 1), ND>};
    return t[ht - 1];
  }
  static AccumTileFn<C> accum(int ht) {
    constexpr AccumTileFn<C> t[4] = {accum_tile<C, 1, ND>, accum_tile<C, (max_tile(ND) >= 2 ? 2 : 1), ND>,
                                     accum_tile<C, (max_tile(ND) >= 3 ? 3 : 1), ND>,
                                     accum_tile<C, (max_tile(ND) >= 4 ? 4 : 1), ND>};
    return t[ht - 1];
  }
};

template <typename C>
struct Tiles {
  ScoreTileFn<C> score[4];
  AccumTileFn<C> accum[4];
  int max_ht;
};

template <typename C, int ND>
inline Tiles<C> make_tiles() {
  Tiles<C> t{};
  for (int h = 1; h <= 4; ++h) t.score[h - 1] = TileTable<C, ND>::score(h), t.accum[h - 1] = TileTable<C, ND>::accum(h);
  t.max_ht = max_tile(ND);
  return t;
}

// Tiles for head dim D, or null when D is not 16..128 in steps of 16 (then the generic path runs).
template <typename C>
inline const Tiles<C>* tiles_for(int64_t D) {
  static const Tiles<C> table[8] = {make_tiles<C, 1>(), make_tiles<C, 2>(), make_tiles<C, 3>(), make_tiles<C, 4>(),
                                    make_tiles<C, 5>(), make_tiles<C, 6>(), make_tiles<C, 7>(), make_tiles<C, 8>()};
  if (D % 16 != 0 || D < 16 || D > 128) return nullptr;
  return &table[D / 16 - 1];
}

// Split hpg heads into near-equal tiles of at most max_ht: calls f(first head, tile size).
template <typename F>
inline void for_each_tile(int64_t hpg, int max_ht, F&& f) {
  const int64_t n_tiles = (hpg + max_ht - 1) / max_ht;
  for (int64_t t = 0, h0 = 0; t < n_tiles; ++t) {
    const int64_t ht = (hpg - h0) / (n_tiles - t);
    f(h0, static_cast<int>(ht));
    h0 += ht;
  }
}

template <typename C>
DUET_AVX512 inline void scores_avx512(const float* q, int64_t q_sh, int64_t hpg, const C* k, int64_t k_stride, int64_t n,
                                      int64_t D, float scale, float* s, int64_t s_stride) {
  const Tiles<C>* tiles = tiles_for<C>(D);
  if (!tiles) return scores_generic_avx512(q, q_sh, hpg, k, k_stride, n, D, scale, s, s_stride);
  for_each_tile(hpg, tiles->max_ht, [&](int64_t h0, int ht) {
    tiles->score[ht - 1](q + h0 * q_sh, q_sh, k, k_stride, n, scale, s + h0 * s_stride, s_stride);
  });
}

template <typename C>
DUET_AVX512 inline void accum_avx512(const float* p, int64_t p_stride, int64_t hpg, int64_t n, const C* v,
                                     int64_t v_stride, int64_t D, float* acc) {
  const Tiles<C>* tiles = tiles_for<C>(D);
  if (!tiles) {
    for (int64_t h = 0; h < hpg; ++h) accum1_avx512(p + h * p_stride, n, v, v_stride, D, acc + h * D);
    return;
  }
  for_each_tile(hpg, tiles->max_ht, [&](int64_t h0, int ht) {
    tiles->accum[ht - 1](p + h0 * p_stride, p_stride, n, v, v_stride, acc + h0 * D);
  });
}

// The primitives for cache element type C on an ISA (AVX2 has fp32 ones only).
template <typename C>
struct Prims {
  ScoreFn<C> scores;
  AccumFn<C> accum;
  ExpSumFn expsum;
  RowMaxFn rowmax;
};

inline float rowmax_scalar(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
  return m;
}

DUET_AVX512 inline float rowmax_avx512(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mk = tail_mask512(static_cast<int>(std::min<int64_t>(n - i, 16)));
    m = _mm512_mask_max_ps(m, mk, m, _mm512_maskz_loadu_ps(mk, s + i));
  }
  return _mm512_reduce_max_ps(m);
}

template <typename C>
inline Prims<C> prims_for(Isa isa) {
  if (isa == Isa::kAvx512) return {scores_avx512<C>, accum_avx512<C>, expsum_avx512, rowmax_avx512};
  if constexpr (sizeof(C) == 4) {
    if (isa == Isa::kAvx2) return {scores_avx2, accum_avx2, expsum_avx2, rowmax_scalar};
  }
  return {scores_scalar<C>, accum_scalar<C>, expsum_scalar, rowmax_scalar};
}

}  // namespace attn
}  // namespace duet
