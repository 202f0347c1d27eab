// Quantized linear layers with int8 activations: y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]) for
// two weight formats (kernels/quant_formats.py):
//   int8  w = sw[n] * q[n, k], q in -127..127, one fp32 scale per output row   (kernels/int8_linear.py)
//   q4    w = d[n, b] * q + m[n, b], q in 0..15, per block b of 32 along k      (kernels/quant_linear.py)
// x is quantized on the fly per token and block of 32 (as llama.cpp's Q8 activations):
// sx[t, b] = max|x| / 127, xq = round_half_even(x / sx) in -127..127, so every block's inner product
// dot_b = sum_{k in b} xq[t, k] * q[n, k] is an exact integer.
//
// The float math, one fixed sequence per output element (every path and every T, so results are
// batch invariant: a token's row of y does not depend on which tokens share the call, which
// speculative verification and continuous batching rely on; and all ISA paths agree bit for bit):
//   int8  acc = 0; for b: acc = fma(float(dot_b), sx[t, b], acc);                      y = fma(acc, sw[n], bias[n])
//   q4    acc = 0; for b: acc = fma(float(dot_b) * sx[t, b], d[n, b], acc);
//                         acc = fma(m[n, b], xs[t, b], acc);   (xs = sx * sum_k xq)    y = acc + bias[n]
// (no bias: + 0). float(dot_b) is exact (|dot_b| <= 32 * 127 * 127 < 2^24).
//
// Paths:
//   AVX-512 VNNI  Row tiles of 16 rows are repacked (into a per-thread scratch, once per call and
//                 token block) so that one zmm holds 4 consecutive k of each of the 16 rows:
//                 vpdpbusd then adds 4 products into each row's int32 lane, 64 multiply-adds per
//                 instruction, and the per-block float step above runs on 16 rows at once (once
//                 per 8 vpdpbusd) instead of once per row. The repack is a 16 x 16 transpose of
//                 4-byte groups (q4: after splitting the nibbles) and costs about as much as 4
//                 tokens' dot products on a tile, so it pays for itself from T = 1 on -- but at
//                 batch 1 it is most of the call's time. The weights may therefore come with their
//                 tiles made once, at load: int8 (make_int8_tiles) exactly the scratch's layout; q4
//                 (make_q4_tiles) the same bytes in tile order, nibble pairs kept (block 2c's codes
//                 are chunk c's low nibbles, block 2c + 1's its high ones, split with one and /
//                 shift per load) and d, m as fp16 [nb][16]. The kernel then streams them with no
//                 repack, bit-identical. vpdpbusd multiplies unsigned
//                 by signed bytes: q4 codes are unsigned already; int8 codes are biased to
//                 q + 128 while packing and the bias is taken off exactly in int32:
//                 dot_b = raw_b - 128 * sum_{k in b} xq[t, k].
//                 Two tiles (32 rows) x up to 4 tokens share each weight load and x broadcast.
//   AVX2          Per row and block, exact dot_b with vpmaddubsw / vpmaddwd (int8: |q| x sign-
//                 adjusted x, so no pair of products saturates int16), then the float step in
//                 scalar code. Also used by AVX-512 CPUs without VNNI.
//   scalar        Plain loops.
// Rows are split over OpenMP threads in tiles of 16; x is walked in token blocks of at most
// ~256 KB of xq so that it stays in L2 while the weights stream through.
//
// Axes: T tokens, N output rows, K input features, Kp padded K (a multiple of 64), B = Kp / 32 blocks.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "kernels.h"

#define DUET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define DUET_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

namespace duet {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kChunk = 64;
constexpr int64_t kTile = 16;                    // rows per packed tile (zmm lanes)
constexpr int kTokens = 4;                       // tokens per pass over a tile pair
constexpr int64_t kTokenBlockBytes = 256 << 10;  // xq bytes per token block
constexpr int64_t kMinParallelWork = 1 << 16;    // weights x tokens; below this one thread wins


enum class QPath { kScalar, kAvx2, kVnni };

QPath active_path() {
  const Isa isa = active_isa();
  if (isa == Isa::kAvx512 && cpu_has_vnni() && dot_extensions_enabled()) return QPath::kVnni;
  if (isa == Isa::kAvx512 || isa == Isa::kAvx2) return QPath::kAvx2;  // F16C comes with every AVX2 CPU
  return QPath::kScalar;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ------------------------------------------------------------------ activation quantization
// Per-token quantized activations (scratch, reused per calling thread).
struct QActs {
  int64_t Kp = 0, nb = 0;
  std::vector<int8_t> q;      // [T, Kp]
  std::vector<float> sx;      // [T, nb] block scales
  std::vector<int32_t> qsum;  // [T, nb] sum of the block's codes
  std::vector<float> xs;      // [T, nb] sx * qsum (the q4 min term)
  const int8_t* qt(int64_t t) const { return q.data() + t * Kp; }
};

// One block of 32: sx = amax / 127, xq = round_half_even(x * (1 / sx)). The same float ops as the
// torch reference (quantize_activations_ref), so both give identical xq and sx.
void quantize_block(const float* x, int64_t n, int8_t* q, float* sx, int32_t* qsum) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = amax / 127.f, inv = amax > 0.f ? 1.f / s : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int v = i < n ? static_cast<int>(std::nearbyint(x[i] * inv)) : 0;
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *sx = s;
  *qsum = sum;
}

DUET_AVX512 void quantize_block_avx512(const float* x, int64_t n, int8_t* q, float* sx, int32_t* qsum) {
  const __mmask16 m0 = tail_mask512(static_cast<int>(n < 16 ? n : 16));
  const __mmask16 m1 = tail_mask512(static_cast<int>(n > 16 ? n - 16 : 0));
  const __m512 a = _mm512_maskz_loadu_ps(m0, x), b = _mm512_maskz_loadu_ps(m1, x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float s = amax / 127.f, inv = amax > 0.f ? 1.f / s : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sx = s;
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

void quantize_acts(QActs& a, const float* x, int64_t x_stride, int64_t T, int64_t K, int64_t Kp, bool avx512,
                   int nt) {
  a.Kp = Kp;
  a.nb = Kp / kBlock;
  a.q.resize(T * Kp);
  a.sx.resize(T * a.nb);
  a.qsum.resize(T * a.nb);
  a.xs.resize(T * a.nb);
  parallel_for(T >= 4 ? nt : 1, T, [&](int64_t t) {
    const float* xt = x + t * x_stride;
    for (int64_t b = 0; b < a.nb; ++b) {
      const int64_t k0 = b * kBlock, n = K - k0 < 0 ? 0 : (K - k0 < kBlock ? K - k0 : kBlock);
      int8_t* q = a.q.data() + t * Kp + k0;
      float* sx = a.sx.data() + t * a.nb + b;
      int32_t* qsum = a.qsum.data() + t * a.nb + b;
      if (avx512) {
        quantize_block_avx512(xt + k0, n, q, sx, qsum);
      } else {
        quantize_block(xt + k0, n, q, sx, qsum);
      }
      a.xs[t * a.nb + b] = *sx * static_cast<float>(*qsum);
    }
  });
}

// ------------------------------------------------------------------ weights and the float step
enum class WKind { kInt8, kQ4 };

struct QWeights {
  const int8_t* w8;   // int8: [N, Kp]
  const float* sw;    // int8: [N]
  const uint8_t* w4;  // q4: packed nibbles [N, Kp / 2]
  const uint16_t* d;  // q4: fp16 [N, nb]
  const uint16_t* m;  // q4: fp16 [N, nb]
  const uint8_t* tiles;  // the same weights in tile order (make_q4_tiles / make_int8_tiles) or null
  const float* bias;  // [N] or null
  float* y;
  int64_t y_stride, N;
};

inline uint8_t q4_at(const uint8_t* row, int64_t k) {
  const int64_t c = k / kChunk, e = k % kChunk;
  const uint8_t byte = row[c * 32 + (e % 32)];
  return e < 32 ? (byte & 0x0F) : (byte >> 4);
}

// The float step of one element (see the top of the file), from its exact block dots.
template <WKind KIND>
inline float finish_element(const QWeights& W, const QActs& a, const int32_t* dots, int64_t t, int64_t n) {
  const float* sx = a.sx.data() + t * a.nb;
  float acc = 0.f;
  if (KIND == WKind::kInt8) {
    for (int64_t b = 0; b < a.nb; ++b) acc = std::fma(static_cast<float>(dots[b]), sx[b], acc);
    return std::fma(acc, W.sw[n], W.bias ? W.bias[n] : 0.f);
  }
  const float* xs = a.xs.data() + t * a.nb;
  for (int64_t b = 0; b < a.nb; ++b) {
    acc = std::fma(static_cast<float>(dots[b]) * sx[b], half_to_float(W.d[n * a.nb + b]), acc);
    acc = std::fma(half_to_float(W.m[n * a.nb + b]), xs[b], acc);
  }
  return acc + (W.bias ? W.bias[n] : 0.f);
}

// ------------------------------------------------------------------ scalar
template <WKind KIND>
void rows_scalar(const QWeights& W, const QActs& a, int64_t n0, int64_t n1, int64_t t0, int64_t t1) {
  std::vector<int32_t> dots(a.nb);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* xq = a.qt(t);
      for (int64_t b = 0; b < a.nb; ++b) {
        int32_t s = 0;
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
          s += (KIND == WKind::kInt8 ? W.w8[n * a.Kp + k] : q4_at(W.w4 + n * a.Kp / 2, k)) * xq[k];
        dots[b] = s;
      }
      W.y[t * W.y_stride + n] = finish_element<KIND>(W, a, dots.data(), t, n);
    }
  }
}

// ------------------------------------------------------------------ AVX2
DUET_AVX2 DUET_INLINE int32_t hsum_epi32_256(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <WKind KIND>
DUET_AVX2_F16C void rows_avx2(const QWeights& W, const QActs& a, int64_t n0, int64_t n1, int64_t t0, int64_t t1) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  std::vector<int32_t> dots(a.nb);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* xq = a.qt(t);
      for (int64_t c = 0; c < a.Kp / kChunk; ++c) {
        __m256i wb[2];
        if (KIND == WKind::kInt8) {
          for (int h = 0; h < 2; ++h)
            wb[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.w8 + n * a.Kp + c * kChunk + h * 32));
        } else {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.w4 + n * a.Kp / 2 + c * 32));
          wb[0] = _mm256_and_si256(v, low4);
          wb[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        for (int h = 0; h < 2; ++h) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * kChunk + h * 32));
          __m256i wu = wb[h];
          if (KIND == WKind::kInt8) {  // |w| x (x with w's sign): u8 x s8 pairs stay within int16
            xv = _mm256_sign_epi8(xv, wu);
            wu = _mm256_abs_epi8(wu);
          }
          dots[2 * c + h] = hsum_epi32_256(_mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones));
        }
      }
      W.y[t * W.y_stride + n] = finish_element<KIND>(W, a, dots.data(), t, n);
    }
  }
}

// ------------------------------------------------------------------ AVX-512 VNNI
// Scratch of one thread: two packed tiles. Tile layout: for each k4 step s of the row (Kp / 4 of
// them; block b holds steps 8b..8b+7) 64 bytes = 4 consecutive codes (u8) of each of the 16 rows.
// q4 tiles also carry d and m as fp32 [nb][16].
struct Packed {
  std::vector<uint8_t> codes;  // [2][Kp / 4][64]
  std::vector<float> d, m;     // [2][nb][16]
};

// In place: r[i] lane j <-> r[j] lane i (4-byte lanes).
DUET_VNNI DUET_INLINE void transpose16x16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes over u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512i a0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), a1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i a2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i a3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(a0, a2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(a0, a2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(a1, a3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(a1, a3, 0xDD);
  }
}

// Packs rows [n0, n0 + nr) (nr <= 16; missing rows are zero codes) into `codes` (and d, m).
// `next`: the first row of the following tile, whose cache lines are prefetched meanwhile.
template <WKind KIND>
DUET_VNNI void pack_tile(const QWeights& W, int64_t Kp, int64_t n0, int64_t nr, uint8_t* codes, float* d, float* m,
                         bool prefetch_next) {
  const int64_t nc = Kp / kChunk, nb = Kp / kBlock;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int64_t row_bytes = KIND == WKind::kInt8 ? Kp : Kp / 2;
  const uint8_t* base = KIND == WKind::kInt8 ? reinterpret_cast<const uint8_t*>(W.w8) : W.w4;
  const bool pf = prefetch_next && n0 + kTile < W.N;
  for (int64_t c = 0; c < nc; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
      if (i >= nr) {
        r[i] = _mm512_setzero_si512();
        continue;
      }
      const uint8_t* row = base + (n0 + i) * row_bytes;
      if (KIND == WKind::kInt8) {
        r[i] = _mm512_loadu_si512(row + c * kChunk);
      } else {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
      }
      if (pf && (KIND == WKind::kInt8 || (c & 1) == 0) && n0 + kTile + i < W.N)
        _mm_prefetch(reinterpret_cast<const char*>(row + kTile * row_bytes + c * (KIND == WKind::kInt8 ? 64 : 32)),
                     _MM_HINT_T0);
    }
    transpose16x16(r);
    for (int j = 0; j < 16; ++j) {
      const __m512i v = KIND == WKind::kInt8 ? _mm512_xor_si512(r[j], bias) : r[j];  // int8: q + 128
      _mm512_storeu_si512(codes + (c * 16 + j) * 64, v);
    }
  }
  if (KIND == WKind::kQ4) {  // d, m [rows, nb] fp16 -> [nb][16 rows] fp32: 16 blocks at a time, transposed
    for (int which = 0; which < 2; ++which) {
      const uint16_t* src = which == 0 ? W.d : W.m;
      float* dst = which == 0 ? d : m;
      for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 bm = tail_mask512(static_cast<int>(n));
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < nr ? _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, src + (n0 + i) * nb + b0)))
                        : _mm512_setzero_si512();
        transpose16x16(r);  // r[j]: block b0 + j of the 16 rows
        for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(dst + (b0 + j) * kTile, r[j]);
      }
    }
  }
}

// R packed tiles (rows n0 .. n0 + 16R) x TT tokens [t0, t0 + TT): the whole K, then the stores.
// TILED: the tiles are W.tiles' (make_int8_tiles: p's layout; make_q4_tiles: nibble pairs, fp16 d
// and m), not p's.
template <WKind KIND, int R, int TT, bool TILED>
DUET_VNNI void compute_tiles(const QWeights& W, const QActs& a, const Packed& p, int64_t n0, int64_t t0) {
  const int64_t nb = a.nb, tile_bytes = a.Kp / 4 * 64;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* tiled[R];  // TILED: each tile's bytes
  if (TILED)
    for (int r = 0; r < R; ++r)
      tiled[r] = W.tiles + (n0 / kTile + r) * (KIND == WKind::kQ4 ? q4_tile_bytes(a.Kp) : int8_tile_bytes(a.Kp));
  __m512 accf[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) accf[r][t] = _mm512_setzero_ps();
  const int8_t* xq[TT];
  for (int t = 0; t < TT; ++t) xq[t] = a.qt(t0 + t);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acci[R][TT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TT; ++t) acci[r][t] = _mm512_setzero_si512();
    const uint8_t* wb = p.codes.data() + b * 8 * 64;
    for (int s = 0; s < 8; ++s) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) {
        if (TILED && KIND == WKind::kInt8) {
          wv[r] = _mm512_load_si512(tiled[r] + (b * 8 + s) * 64);
        } else if (TILED) {  // block b's codes: the low nibbles of chunk b / 2 (even b), else the high ones
          const __m512i v = _mm512_load_si512(tiled[r] + ((b >> 1) * 8 + s) * 64);
          wv[r] = _mm512_and_si512(b & 1 ? _mm512_srli_epi16(v, 4) : v, low4);
        } else {
          wv[r] = _mm512_loadu_si512(wb + r * tile_bytes + s * 64);
        }
      }
      for (int t = 0; t < TT; ++t) {
        int32_t x4;
        std::memcpy(&x4, xq[t] + b * kBlock + 4 * s, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        for (int r = 0; r < R; ++r) acci[r][t] = _mm512_dpbusd_epi32(acci[r][t], wv[r], xv);
      }
    }
    for (int t = 0; t < TT; ++t) {
      const int64_t tb = (t0 + t) * nb + b;
      const __m512 sx = _mm512_set1_ps(a.sx[tb]);
      if (KIND == WKind::kInt8) {
        const __m512i corr = _mm512_set1_epi32(128 * a.qsum[tb]);
        for (int r = 0; r < R; ++r)
          accf[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acci[r][t], corr)), sx, accf[r][t]);
      } else {
        const __m512 xs = _mm512_set1_ps(a.xs[tb]);
        for (int r = 0; r < R; ++r) {
          __m512 dv, mv;
          if (TILED) {
            const uint16_t* dm = reinterpret_cast<const uint16_t*>(tiled[r] + a.Kp * 8) + b * 2 * kTile;
            dv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dm)));
            mv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dm + kTile)));
          } else {
            dv = _mm512_loadu_ps(p.d.data() + (r * nb + b) * kTile);
            mv = _mm512_loadu_ps(p.m.data() + (r * nb + b) * kTile);
          }
          accf[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acci[r][t]), sx), dv, accf[r][t]);
          accf[r][t] = _mm512_fmadd_ps(mv, xs, accf[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t rn = n0 + r * kTile, rows = W.N - rn < kTile ? W.N - rn : kTile;
    const __mmask16 mask = tail_mask512(static_cast<int>(rows));
    const __m512 bias = W.bias ? _mm512_maskz_loadu_ps(mask, W.bias + rn) : _mm512_setzero_ps();
    const __m512 sw = KIND == WKind::kInt8 ? _mm512_maskz_loadu_ps(mask, W.sw + rn) : _mm512_setzero_ps();
    for (int t = 0; t < TT; ++t) {
      const __m512 y = KIND == WKind::kInt8 ? _mm512_fmadd_ps(accf[r][t], sw, bias) : _mm512_add_ps(accf[r][t], bias);
      _mm512_mask_storeu_ps(W.y + (t0 + t) * W.y_stride + rn, mask, y);
    }
  }
}

template <WKind KIND, int R, bool TILED>
DUET_VNNI void tokens_vnni(const QWeights& W, const QActs& a, const Packed& p, int64_t n0, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + kTokens <= t1; t += kTokens) compute_tiles<KIND, R, kTokens, TILED>(W, a, p, n0, t);
  switch (t1 - t) {
    case 1: compute_tiles<KIND, R, 1, TILED>(W, a, p, n0, t); break;
    case 2: compute_tiles<KIND, R, 2, TILED>(W, a, p, n0, t); break;
    case 3: compute_tiles<KIND, R, 3, TILED>(W, a, p, n0, t); break;
    default: break;
  }
}

thread_local Packed t_packed;

// Rows [n0, n1) (n0 a multiple of 16), tokens [t0, t1): tiles in pairs.
template <WKind KIND>
DUET_VNNI void rows_vnni(const QWeights& W, const QActs& a, int64_t n0, int64_t n1, int64_t t0, int64_t t1) {
  Packed& p = t_packed;
  const int64_t tile_bytes = a.Kp / 4 * 64, nb = a.nb;
  if (static_cast<int64_t>(p.codes.size()) < 2 * tile_bytes + 64) p.codes.resize(2 * tile_bytes + 64);
  if (static_cast<int64_t>(p.d.size()) < 2 * nb * kTile + 16) {
    p.d.resize(2 * nb * kTile + 16);
    p.m.resize(2 * nb * kTile + 16);
  }
  for (int64_t n = n0; n < n1; n += 2 * kTile) {
    const int R = n + kTile < n1 ? 2 : 1;
    if (W.tiles != nullptr) {  // packed once, at load: nothing to repack
      if (R == 2) {
        tokens_vnni<KIND, 2, true>(W, a, p, n, t0, t1);
      } else {
        tokens_vnni<KIND, 1, true>(W, a, p, n, t0, t1);
      }
      continue;
    }
    for (int r = 0; r < R; ++r) {
      const int64_t rn = n + r * kTile;
      pack_tile<KIND>(W, a.Kp, rn, std::min<int64_t>(kTile, W.N - rn), p.codes.data() + r * tile_bytes,
                      p.d.data() + r * nb * kTile, p.m.data() + r * nb * kTile, true);
    }
    if (R == 2) {
      tokens_vnni<KIND, 2, false>(W, a, p, n, t0, t1);
    } else {
      tokens_vnni<KIND, 1, false>(W, a, p, n, t0, t1);
    }
  }
}

// ------------------------------------------------------------------ driver
thread_local QActs t_acts;

template <WKind KIND>
void run(const QWeights& W, const float* x, int64_t x_stride, int64_t T, int64_t K, int64_t Kp, int max_threads) {
  if (T <= 0 || W.N <= 0) return;
  const QPath path = active_path();
  QActs& a = t_acts;
  quantize_acts(a, x, x_stride, T, K, Kp, path == QPath::kVnni, max_threads);
  using RowsFn = void (*)(const QWeights&, const QActs&, int64_t, int64_t, int64_t, int64_t);
  const RowsFn rows = path == QPath::kVnni ? rows_vnni<KIND> : path == QPath::kAvx2 ? rows_avx2<KIND> : rows_scalar<KIND>;
  const int64_t tiles = (W.N + kTile - 1) / kTile;
  const int64_t bytes_per_weight = KIND == WKind::kInt8 ? 8 : 4;  // work weighted like the int8 weight bytes
  const int nt = pick_threads(max_threads, W.N * Kp * bytes_per_weight / 8 * std::min<int64_t>(T, 8),
                              kMinParallelWork, tiles / 2 > 0 ? tiles / 2 : 1);
  const int64_t tb = std::max<int64_t>(kTokens, kTokenBlockBytes / Kp / kTokens * kTokens);
  auto span = [&](int64_t p0, int64_t p1) {  // tile pairs [p0, p1)
    const int64_t n0 = p0 * 2 * kTile, n1 = std::min(W.N, p1 * 2 * kTile);
    if (n0 >= n1) return;
    for (int64_t t0 = 0; t0 < T; t0 += tb) rows(W, a, n0, n1, t0, std::min(T, t0 + tb));
  };
  const int64_t pairs = (tiles + 1) / 2;
  if (nt == 1) return span(0, pairs);
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num(), n_threads = omp_get_num_threads();
    span(pairs * i / n_threads, pairs * (i + 1) / n_threads);
  }
}

}  // namespace

void quantize_activations_q8(const float* x, int64_t x_stride, int64_t T, int64_t K, int64_t Kp, int8_t* q_out,
                             float* sx_out) {
  quantize_acts(t_acts, x, x_stride, T, K, Kp, active_path() == QPath::kVnni, 1);
  std::memcpy(q_out, t_acts.q.data(), T * Kp);
  std::memcpy(sx_out, t_acts.sx.data(), T * (Kp / kBlock) * sizeof(float));
}

void q4_linear_f32(const float* x, int64_t x_stride, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                   const float* bias, float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K, int64_t Kp,
                   int max_threads, const uint8_t* tiles) {
  // the tiles serve the VNNI path only; every other path reads w, d and m
  const QWeights W{nullptr, nullptr, w, d, m, active_path() == QPath::kVnni ? tiles : nullptr, bias, y, y_stride, N};
  run<WKind::kQ4>(W, x, x_stride, T, K, Kp, max_threads);
}

int64_t q4_tile_bytes(int64_t Kp) { return Kp * 8 + Kp / kBlock * 2 * kTile * 2; }

void make_q4_tiles(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t N, int64_t Kp, uint8_t* out) {
  const int64_t nc = Kp / kChunk, nb = Kp / kBlock, row_bytes = Kp / 2, tb = q4_tile_bytes(Kp);
  for (int64_t tile = 0; tile * kTile < N; ++tile) {
    uint8_t* codes = out + tile * tb;
    uint16_t* dm = reinterpret_cast<uint16_t*>(codes + Kp * 8);
    for (int64_t i = 0; i < kTile; ++i) {
      const int64_t n = tile * kTile + i;
      const bool real = n < N;
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t j = 0; j < 8; ++j)  // 4 bytes: codes 64c + 4j.. (low nibbles) and 64c + 32 + 4j.. (high)
          for (int64_t e = 0; e < 4; ++e)
            codes[(c * 8 + j) * 64 + i * 4 + e] = real ? w[n * row_bytes + c * 32 + 4 * j + e] : 0;
      for (int64_t b = 0; b < nb; ++b) {
        dm[(2 * b) * kTile + i] = real ? d[n * nb + b] : 0;
        dm[(2 * b + 1) * kTile + i] = real ? m[n * nb + b] : 0;
      }
    }
  }
}

int64_t int8_tile_bytes(int64_t Kp) { return Kp * kTile; }

void make_int8_tiles(const int8_t* w, int64_t N, int64_t Kp, uint8_t* out) {
  const int64_t steps = Kp / 4, tb = int8_tile_bytes(Kp);
  for (int64_t tile = 0; tile * kTile < N; ++tile) {
    uint8_t* codes = out + tile * tb;
    for (int64_t i = 0; i < kTile; ++i) {
      const int64_t n = tile * kTile + i;
      for (int64_t s = 0; s < steps; ++s)  // codes 4s..4s+3 of row i, biased to q + 128 (vpdpbusd's unsigned side)
        for (int64_t e = 0; e < 4; ++e)
          codes[s * 64 + i * 4 + e] = n < N ? static_cast<uint8_t>(w[n * Kp + 4 * s + e] + 128) : 128;
    }
  }
}

void int8_linear_f32(const float* x, int64_t x_stride, const int8_t* w, const float* scale, const float* bias,
                     float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K, int64_t Kp, int max_threads,
                     const uint8_t* tiles) {
  const QWeights W{w, scale, nullptr, nullptr, nullptr, active_path() == QPath::kVnni ? tiles : nullptr, bias, y,
                   y_stride, N};
  run<WKind::kInt8>(W, x, x_stride, T, K, Kp, max_threads);
}

const char* quant_path_name() {
  switch (active_path()) {
    case QPath::kVnni: return "avx512_vnni";
    case QPath::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace duet
