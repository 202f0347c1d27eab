// 4-bit quantized linear layer: y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]) with w stored in
// blocks of 32 along k, each with an fp16 scale d and min m: w = d * q + m, q in 0..15 (GGUF Q4_1's
// block math, our own packing). Weight-only int8 lives in int8_linear.cpp.
//
// Like llama.cpp's Q8 path, x is quantized on the fly per block of 32 (sx = max|x| / 127,
// xq = round(x / sx) in -127..127), so the inner products are exact integer dot products:
//   y = sum_b (d[n, b] * sx[b] * dot(xq_b, q_b) + m[n, b] * sx[b] * sum(xq_b))
// AVX-512 VNNI does 64 of those products per vpdpbusd (u8 x s8 -> int32 lanes of 4 products); the
// unsigned operand is the weight (nibbles 0..15).
//
// Layout (see kernels/quant_formats.py): K is padded to Kp, a multiple of 64 (a "chunk" = two
// blocks); padded weights and activations are zero. q4 packs a chunk into 32 bytes: byte j holds
// element j (low nibble) and element j + 32 (high nibble), so one 32-byte load + shift + mask gives
// one zmm whose low half is block 2c and high half block 2c + 1; int32 lanes 0-7 are block 2c,
// 8-15 block 2c + 1. d and m are fp16 bit patterns (uint16) [N, Kp / 32].
//
// Paths: AVX-512 with VNNI; AVX2 (maddubs, also used by AVX-512 CPUs without VNNI); scalar. Rows
// are split over OpenMP threads; each thread walks blocks of 16 rows x up to 8 tokens, so a row's
// weights come from DRAM once per call and the tokens' activations stay in L1/L2.
#include <omp.h>

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
constexpr int64_t kRowTile = 16;
constexpr int kMaxTokens = 8;  // tokens per pass over a row tile
constexpr int64_t kMinParallelWork = 1 << 16;

bool cpu_has_vnni() {
  static const bool v = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return v;
}

enum class QPath { kScalar, kAvx2, kVnni };

QPath active_path() {
  const Isa isa = active_isa();
  if (isa == Isa::kAvx512 && cpu_has_vnni()) return QPath::kVnni;
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

// Per-token quantized activations (scratch, reused per calling thread).
struct QActs {
  int64_t Kp = 0, nb = 0, nc = 0;
  std::vector<int8_t> q;          // [T, Kp]
  std::vector<float> sx;          // [T, nb] block scales
  std::vector<float> xs;          // [T, nb] sx * sum(xq of the block): the q4 min term
  std::vector<float> sxexp;       // [T, nc, 16] lanes 0-7 sx[2c], 8-15 sx[2c + 1] (VNNI lanes)
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

void quantize_acts(QActs& a, const float* x, int64_t x_stride, int64_t T, int64_t K, int64_t Kp, QPath path,
                   int nt) {
  a.Kp = Kp;
  a.nb = Kp / kBlock;
  a.nc = Kp / kChunk;
  a.q.resize(T * Kp);
  a.sx.resize(T * a.nb);
  a.xs.resize(T * a.nb);
  if (path == QPath::kVnni) a.sxexp.resize(T * a.nc * 16);
  parallel_for(T >= 4 ? nt : 1, T, [&](int64_t t) {
    const float* xt = x + t * x_stride;
    for (int64_t b = 0; b < a.nb; ++b) {
      const int64_t k0 = b * kBlock, n = K - k0 < 0 ? 0 : (K - k0 < kBlock ? K - k0 : kBlock);
      int8_t* q = a.q.data() + t * Kp + k0;
      float* sx = a.sx.data() + t * a.nb + b;
      int32_t qsum;
      if (path == QPath::kVnni) {
        quantize_block_avx512(xt + k0, n, q, sx, &qsum);
      } else {
        quantize_block(xt + k0, n, q, sx, &qsum);
      }
      a.xs[t * a.nb + b] = *sx * static_cast<float>(qsum);
      if (path == QPath::kVnni)
        for (int i = 0; i < 8; ++i) a.sxexp[(t * a.nc + b / 2) * 16 + (b % 2) * 8 + i] = *sx;
    }
  });
}

struct QProblem {
  const void* w;      // packed q4 [N, Kp / 2]
  const uint16_t* d;  // fp16 [N, nb]
  const uint16_t* m;  // fp16 [N, nb]
  const float* bias;
  float* y;
  int64_t y_stride;
};

// Rows per VNNI block: enough independent accumulator chains to hide the FMA latency (one chain per
// row x token), at most 8 accumulators so weights, activations and scales stay in registers.
template <int TT>
constexpr int vnni_rows() { return TT <= 2 ? 4 : TT <= 4 ? 2 : 1; }

// Writes the 16 row sums of a tile (sums[t * 16 + r] = lane partials of row r0 + r, token t):
// one transposed reduction per token, then bias, masked to the tile's rows.
DUET_VNNI DUET_INLINE void store_tile(const QProblem& p, int TT, const __m512* sums, int64_t r0, int64_t rows,
                                      int64_t t0) {
  const __mmask16 m = tail_mask512(static_cast<int>(rows));
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + r0) : _mm512_setzero_ps();
  for (int t = 0; t < TT; ++t)
    _mm512_mask_storeu_ps(p.y + (t0 + t) * p.y_stride + r0, m, _mm512_add_ps(hsum16x16(sums + t * 16), bias));
}

// ---------------------------------------------------------------- q4, blocks of 32 with d and m
inline uint8_t q4_at(const uint8_t* row, int64_t k) {
  const int64_t c = k / kChunk, e = k % kChunk;
  const uint8_t byte = row[c * 32 + (e % 32)];
  return e < 32 ? (byte & 0x0F) : (byte >> 4);
}

template <int TT>
void q4_scalar(const QProblem& p, const QActs& a, int64_t n0, int64_t n1, int64_t t0) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = static_cast<const uint8_t*>(p.w) + n * a.Kp / 2;
    for (int t = 0; t < TT; ++t) {
      const int8_t* xq = a.qt(t0 + t);
      const float* sx = a.sx.data() + (t0 + t) * a.nb;
      const float* xs = a.xs.data() + (t0 + t) * a.nb;
      float acc = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        int32_t s = 0;
        for (int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i) s += q4_at(w, i) * xq[i];
        acc += half_to_float(p.d[n * a.nb + b]) * sx[b] * static_cast<float>(s) + half_to_float(p.m[n * a.nb + b]) * xs[b];
      }
      p.y[(t0 + t) * p.y_stride + n] = acc + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

template <int TT>
DUET_AVX2_F16C void q4_avx2(const QProblem& p, const QActs& a, int64_t n0, int64_t n1, int64_t t0) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  std::vector<float> dm(2 * a.nb);  // this row's d, then m, as fp32
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = static_cast<const uint8_t*>(p.w) + n * a.Kp / 2;
    for (int64_t b = 0; b < a.nb; ++b) {
      dm[b] = half_to_float(p.d[n * a.nb + b]);
      dm[a.nb + b] = half_to_float(p.m[n * a.nb + b]);
    }
    __m256 acc[TT];
    float macc[TT];
    for (int t = 0; t < TT; ++t) {
      acc[t] = _mm256_setzero_ps();
      const float* xs = a.xs.data() + (t0 + t) * a.nb;
      float s = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) s += dm[a.nb + b] * xs[b];
      macc[t] = s;
    }
    for (int64_t c = 0; c < a.nc; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
      const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int t = 0; t < TT; ++t) {
        const int8_t* xq = a.qt(t0 + t) + c * kChunk;
        const float* sx = a.sx.data() + (t0 + t) * a.nb + 2 * c;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
        const __m256i s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones);
        const __m256i s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(dm[2 * c] * sx[0]), acc[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(dm[2 * c + 1] * sx[1]), acc[t]);
      }
    }
    for (int t = 0; t < TT; ++t)
      p.y[(t0 + t) * p.y_stride + n] = hsum256(acc[t]) + macc[t] + (p.bias ? p.bias[n] : 0.f);
  }
}

// lanes 0-7 <- element 2i of a 16-float vector, lanes 8-15 <- element 2i + 1
alignas(64) const int32_t kPairIdx[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},         {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},         {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},         {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

template <int TT, int R>
DUET_VNNI DUET_INLINE void q4_vnni_block(const QProblem& p, const QActs& a, int64_t n, int64_t t0, __m512* sums) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + n * a.Kp / 2;
  const uint16_t* d = p.d + n * a.nb;
  const uint16_t* m = p.m + n * a.nb;
  for (int64_t c0 = 0; c0 < a.nc; c0 += 8) {  // 8 chunks = 16 blocks share one load of d and m
    const int64_t b0 = 2 * c0, nblk = a.nb - b0 < 16 ? a.nb - b0 : 16;
    const __mmask16 bm = tail_mask512(static_cast<int>(nblk));
    __m512 dv[R];
    for (int r = 0; r < R; ++r) {
      dv[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, d + r * a.nb + b0));
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, m + r * a.nb + b0));
      for (int t = 0; t < TT; ++t)  // min term: m[b] * sx[b] * sum(xq_b), lane b
        acc[r][t] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(bm, a.xs.data() + (t0 + t) * a.nb + b0), acc[r][t]);
    }
    const int64_t c1 = c0 + 8 < a.nc ? c0 + 8 : a.nc;
    for (int64_t c = c0; c < c1; ++c) {
      const __m512i idx = _mm512_load_si512(kPairIdx[c - c0]);
      __m512i q[R];
      __m512 dexp[R];
      for (int r = 0; r < R; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * a.Kp / 2 + c * 32));
        q[r] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
        dexp[r] = _mm512_permutexvar_ps(idx, dv[r]);
      }
      for (int t = 0; t < TT; ++t) {
        const int64_t tt = t0 + t;
        const __m512i xq = _mm512_loadu_si512(a.qt(tt) + c * kChunk);
        const __m512 sx = _mm512_loadu_ps(a.sxexp.data() + (tt * a.nc + c) * 16);
        for (int r = 0; r < R; ++r) {
          const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r], xq);
          acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), sx), dexp[r], acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) sums[t * 16 + r] = acc[r][t];
}

template <int TT>
DUET_VNNI void q4_vnni(const QProblem& p, const QActs& a, int64_t n0, int64_t n1, int64_t t0) {
  constexpr int R = vnni_rows<TT>();
  __m512 sums[TT * 16];
  for (int i = 0; i < TT * 16; ++i) sums[i] = _mm512_setzero_ps();
  int64_t n = n0;
  for (; n + R <= n1; n += R) q4_vnni_block<TT, R>(p, a, n, t0, sums + (n - n0));
  for (; n < n1; ++n) q4_vnni_block<TT, 1>(p, a, n, t0, sums + (n - n0));
  store_tile(p, TT, sums, n0, n1 - n0, t0);
}

// ---------------------------------------------------------------- driver
using TileFn = void (*)(const QProblem&, const QActs&, int64_t, int64_t, int64_t);

#define DUET_TILE_TABLE(NAME)                                                                        \
  const TileFn NAME##_table[kMaxTokens] = {NAME<1>, NAME<2>, NAME<3>, NAME<4>, NAME<5>, NAME<6>, NAME<7>, \
                                           NAME<8>};
DUET_TILE_TABLE(q4_scalar)
DUET_TILE_TABLE(q4_avx2)
DUET_TILE_TABLE(q4_vnni)

void run(const QProblem& p, const QActs& a, const TileFn* table, int64_t T, int64_t N, int nt) {
  auto rows = [&](int64_t n_begin, int64_t n_end) {
    for (int64_t r = n_begin; r < n_end; r += kRowTile) {
      const int64_t r1 = r + kRowTile < n_end ? r + kRowTile : n_end;
      for (int64_t t0 = 0; t0 < T; t0 += kMaxTokens) {
        const int64_t tt = T - t0 < kMaxTokens ? T - t0 : kMaxTokens;
        table[tt - 1](p, a, r, r1, t0);
      }
    }
  };
  if (nt == 1) return rows(0, N);
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num(), n_threads = omp_get_num_threads();
    const int64_t tiles = (N + kRowTile - 1) / kRowTile;
    const int64_t b0 = tiles * i / n_threads, b1 = tiles * (i + 1) / n_threads;
    const int64_t n_begin = b0 * kRowTile, n_end = b1 * kRowTile < N ? b1 * kRowTile : N;
    if (n_begin < n_end) rows(n_begin, n_end);
  }
}

thread_local QActs t_acts;

}  // namespace

void quantize_activations_q8(const float* x, int64_t x_stride, int64_t T, int64_t K, int64_t Kp, int8_t* q_out,
                             float* sx_out) {
  const QPath path = active_path();
  quantize_acts(t_acts, x, x_stride, T, K, Kp, path, 1);
  std::memcpy(q_out, t_acts.q.data(), T * Kp);
  std::memcpy(sx_out, t_acts.sx.data(), T * (Kp / kBlock) * sizeof(float));
}

void q4_linear_f32(const float* x, int64_t x_stride, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                   const float* bias, float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K, int64_t Kp,
                   int max_threads) {
  const QPath path = active_path();
  const int nt = pick_threads(max_threads, N * Kp / 8, kMinParallelWork, N / kRowTile);
  quantize_acts(t_acts, x, x_stride, T, K, Kp, path, max_threads);
  const QProblem p{w, d, m, bias, y, y_stride};
  const TileFn* table = path == QPath::kVnni ? q4_vnni_table : path == QPath::kAvx2 ? q4_avx2_table : q4_scalar_table;
  run(p, t_acts, table, T, N, nt);
}

const char* quant_path_name() {
  switch (active_path()) {
    case QPath::kVnni: return "avx512_vnni";
    case QPath::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace duet
