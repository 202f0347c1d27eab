// Skinny matrix product for decode: y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]), fp32, up to 8
// rows of x per pass over W (more rows: several passes).
//
// At small T the product is memory bound: every weight is used only T times, so the kernel's job is
// to stream W from DRAM once at full bandwidth. Each thread takes a contiguous range of W's rows
// (OpenMP static split) and walks it R rows at a time (R = 8 for T <= 2, 4 for T <= 4, else 2),
// keeping T x R <= 16 accumulators in registers: each 16-float chunk of a weight row is loaded once
// and FMA'd into all T outputs. The row block ahead is prefetched to L2. K need not be a multiple of
// 16 (masked last chunk) and N need not be a multiple of R (leftover rows go one at a time).
//
// gemv_bf16: the same product for bf16 x, w (and bias), fp32 accumulation, y rounded to bf16 once
// (as torch's bf16 F.linear). Weights are 2 bytes, so batch-1 decode streams half of fp32's bytes.
// AVX512-BF16 CPUs use vdpbf16ps (32 products per instruction, pairs summed before the add: its
// own rounding, so its results differ from the other paths in the last bits); other AVX-512
// CPUs widen bf16 to fp32 (exact) and FMA; anything else runs the scalar loop.
#include <omp.h>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

constexpr int64_t kMinParallelWork = 1 << 16;  // weight floats; below this one thread wins
constexpr int64_t kMaxRowsPerPass = 8;          // rows of x sharing one pass over W

struct GemvProblem {
  const float* x;
  int64_t x_stride;
  const float* w;
  int64_t w_stride;
  const float* bias;
  float* y;
  int64_t y_stride;
  int64_t K;
};

// Writes y[t, n0 + r] for r < R from the lane sums s[t * R + r].
inline void store_block(const GemvProblem& p, int TT, int R, int64_t n0, const float* s) {
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) p.y[t * p.y_stride + n0 + r] = s[t * R + r] + (p.bias ? p.bias[n0 + r] : 0.f);
}

template <int TT, int R>
void block_scalar(const GemvProblem& p, int64_t n0) {
  float s[TT * R] = {};
  for (int r = 0; r < R; ++r) {
    const float* w = p.w + (n0 + r) * p.w_stride;
    for (int t = 0; t < TT; ++t) {
      const float* x = p.x + t * p.x_stride;
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc += x[k] * w[k];
      s[t * R + r] = acc;
    }
  }
  store_block(p, TT, R, n0, s);
}

template <int TT, int R>
DUET_AVX2 void block_avx2(const GemvProblem& p, int64_t n0) {
  __m256 acc[TT][R];
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  const float* w = p.w + n0 * p.w_stride;
  int64_t k = 0;
  for (; k + 8 <= p.K; k += 8) {
    __m256 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_ps(p.x + t * p.x_stride + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * p.w_stride + k);
      for (int t = 0; t < TT; ++t) acc[t][r] = _mm256_fmadd_ps(xv[t], wv, acc[t][r]);
    }
  }
  if (k < p.K) {
    const __m256i m = tail_mask256(static_cast<int>(p.K - k));
    __m256 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = _mm256_maskload_ps(p.x + t * p.x_stride + k, m);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_maskload_ps(w + r * p.w_stride + k, m);
      for (int t = 0; t < TT; ++t) acc[t][r] = _mm256_fmadd_ps(xv[t], wv, acc[t][r]);
    }
  }
  float s[TT * R];
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) s[t * R + r] = hsum256(acc[t][r]);
  store_block(p, TT, R, n0, s);
}

template <int TT, int R>
DUET_AVX512 void block_avx512(const GemvProblem& p, int64_t n0, const float* next) {
  static_assert(TT * R <= 16, "one hsum16x16 per block");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const float* w = p.w + n0 * p.w_stride;
  int64_t k = 0;
  for (; k + 16 <= p.K; k += 16) {
    __m512 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_ps(p.x + t * p.x_stride + k);
    for (int r = 0; r < R; ++r) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + r * p.w_stride + k), _MM_HINT_T1);
      const __m512 wv = _mm512_loadu_ps(w + r * p.w_stride + k);
      for (int t = 0; t < TT; ++t) acc[t * R + r] = _mm512_fmadd_ps(xv[t], wv, acc[t * R + r]);
    }
  }
  if (k < p.K) {
    const __mmask16 m = tail_mask512(static_cast<int>(p.K - k));
    __m512 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_ps(m, p.x + t * p.x_stride + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(m, w + r * p.w_stride + k);
      for (int t = 0; t < TT; ++t) acc[t * R + r] = _mm512_fmadd_ps(xv[t], wv, acc[t * R + r]);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, hsum16x16(acc));
  store_block(p, TT, R, n0, s);
}

// Rows [n_begin, n_end) of y for TT rows of x, on the active ISA.
template <int TT>
void rows(const GemvProblem& p, int64_t n_begin, int64_t n_end, Isa isa) {
  constexpr int R = TT <= 2 ? 8 : TT <= 4 ? 4 : 2;
  int64_t n = n_begin;
  if (isa == Isa::kAvx512) {
    for (; n + R <= n_end; n += R)
      block_avx512<TT, R>(p, n, n + 2 * R <= n_end ? p.w + (n + R) * p.w_stride : nullptr);
    for (; n < n_end; ++n) block_avx512<TT, 1>(p, n, nullptr);
  } else if (isa == Isa::kAvx2) {
    constexpr int R2 = TT <= 2 ? 4 : TT <= 4 ? 2 : 1;  // 16 ymm registers: T x R2 <= 8 accumulators
    for (; n + R2 <= n_end; n += R2) block_avx2<TT, R2>(p, n);
    for (; n < n_end; ++n) block_avx2<TT, 1>(p, n);
  } else {
    for (; n + R <= n_end; n += R) block_scalar<TT, R>(p, n);
    for (; n < n_end; ++n) block_scalar<TT, 1>(p, n);
  }
}

void rows_any(const GemvProblem& p, int TT, int64_t n_begin, int64_t n_end, Isa isa) {
  switch (TT) {
    case 1: return rows<1>(p, n_begin, n_end, isa);
    case 2: return rows<2>(p, n_begin, n_end, isa);
    case 3: return rows<3>(p, n_begin, n_end, isa);
    case 4: return rows<4>(p, n_begin, n_end, isa);
    case 5: return rows<5>(p, n_begin, n_end, isa);
    case 6: return rows<6>(p, n_begin, n_end, isa);
    case 7: return rows<7>(p, n_begin, n_end, isa);
    default: return rows<8>(p, n_begin, n_end, isa);
  }
}

// ---------------------------------------------------------------------------------------- bf16
#define DUET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))


struct GemvBf16 {
  const bf16_t* x;
  int64_t x_stride;
  const bf16_t* w;
  int64_t w_stride;
  const bf16_t* bias;
  bf16_t* y;
  int64_t y_stride;
  int64_t K;
};

// y[t, n0 + r] for the block's TT x R sums s[t * R + r].
inline void store_bf16_block(const GemvBf16& p, int TT, int R, int64_t n0, const float* s) {
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r)
      p.y[t * p.y_stride + n0 + r] = from_f32<bf16_t>(s[t * R + r] + (p.bias ? to_f32(p.bias[n0 + r]) : 0.f));
}

template <int TT, int R>
void bf16_block_scalar(const GemvBf16& p, int64_t n0) {
  float s[TT * R];
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc += to_f32(p.x[t * p.x_stride + k]) * to_f32(p.w[(n0 + r) * p.w_stride + k]);
      s[t * R + r] = acc;
    }
  store_bf16_block(p, TT, R, n0, s);
}

template <int TT, int R>
DUET_AVX512 void bf16_block_avx512(const GemvBf16& p, int64_t n0, const bf16_t* next) {
  static_assert(TT * R <= 16, "one hsum16x16 per block");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; k += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(p.K - k < 16 ? p.K - k : 16));
    __m512 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = load16(m, p.x + t * p.x_stride + k);
    for (int r = 0; r < R; ++r) {
      if (next && (k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(next + r * p.w_stride + k), _MM_HINT_T1);
      const __m512 wv = load16(m, p.w + (n0 + r) * p.w_stride + k);
      for (int t = 0; t < TT; ++t) acc[t * R + r] = _mm512_fmadd_ps(xv[t], wv, acc[t * R + r]);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, hsum16x16(acc));
  store_bf16_block(p, TT, R, n0, s);
}

template <int TT, int R>
DUET_AVX512BF16 void bf16_block_dp(const GemvBf16& p, int64_t n0, const bf16_t* next) {
  static_assert(TT * R <= 16, "one hsum16x16 per block");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; k += 32) {
    const __mmask32 m = p.K - k >= 32 ? ~__mmask32{0} : ((__mmask32{1} << (p.K - k)) - 1);
    __m512bh xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, p.x + t * p.x_stride + k);
    for (int r = 0; r < R; ++r) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + r * p.w_stride + k), _MM_HINT_T1);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, p.w + (n0 + r) * p.w_stride + k);
      for (int t = 0; t < TT; ++t) acc[t * R + r] = _mm512_dpbf16_ps(acc[t * R + r], xv[t], wv);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, hsum16x16(acc));
  store_bf16_block(p, TT, R, n0, s);
}

enum class Bf16Path { kScalar, kAvx512, kDp };

template <int TT>
void bf16_rows(const GemvBf16& p, int64_t n_begin, int64_t n_end, Bf16Path path) {
  constexpr int R = TT <= 2 ? 8 : TT <= 4 ? 4 : 2;
  int64_t n = n_begin;
  if (path == Bf16Path::kDp) {
    for (; n + R <= n_end; n += R)
      bf16_block_dp<TT, R>(p, n, n + 2 * R <= n_end ? p.w + (n + R) * p.w_stride : nullptr);
    for (; n < n_end; ++n) bf16_block_dp<TT, 1>(p, n, nullptr);
  } else if (path == Bf16Path::kAvx512) {
    for (; n + R <= n_end; n += R)
      bf16_block_avx512<TT, R>(p, n, n + 2 * R <= n_end ? p.w + (n + R) * p.w_stride : nullptr);
    for (; n < n_end; ++n) bf16_block_avx512<TT, 1>(p, n, nullptr);
  } else {
    for (; n + R <= n_end; n += R) bf16_block_scalar<TT, R>(p, n);
    for (; n < n_end; ++n) bf16_block_scalar<TT, 1>(p, n);
  }
}

void bf16_rows_any(const GemvBf16& p, int TT, int64_t n_begin, int64_t n_end, Bf16Path path) {
  switch (TT) {
    case 1: return bf16_rows<1>(p, n_begin, n_end, path);
    case 2: return bf16_rows<2>(p, n_begin, n_end, path);
    case 3: return bf16_rows<3>(p, n_begin, n_end, path);
    case 4: return bf16_rows<4>(p, n_begin, n_end, path);
    case 5: return bf16_rows<5>(p, n_begin, n_end, path);
    case 6: return bf16_rows<6>(p, n_begin, n_end, path);
    case 7: return bf16_rows<7>(p, n_begin, n_end, path);
    default: return bf16_rows<8>(p, n_begin, n_end, path);
  }
}

}  // namespace

bool gemv_bf16_native() { return active_isa() == Isa::kAvx512 && cpu_has_avx512bf16() && dot_extensions_enabled(); }

void gemv_bf16(const bf16_t* x, int64_t x_stride, const bf16_t* w, int64_t w_stride, const bf16_t* bias, bf16_t* y,
               int64_t y_stride, int64_t T, int64_t N, int64_t K, int max_threads) {
  const Bf16Path path = gemv_bf16_native() ? Bf16Path::kDp : active_isa() == Isa::kAvx512 ? Bf16Path::kAvx512
                                                                                         : Bf16Path::kScalar;
  const int nt = pick_threads(max_threads, N * K / 2, kMinParallelWork, N / 8);
  for (int64_t t0 = 0; t0 < T; t0 += kMaxRowsPerPass) {
    const int TT = static_cast<int>(T - t0 < kMaxRowsPerPass ? T - t0 : kMaxRowsPerPass);
    const GemvBf16 p{x + t0 * x_stride, x_stride, w, w_stride, bias, y + t0 * y_stride, y_stride, K};
    if (nt == 1) {
      bf16_rows_any(p, TT, 0, N, path);
      continue;
    }
#pragma omp parallel num_threads(nt)
    {
      const int i = omp_get_thread_num(), n_threads = omp_get_num_threads();
      const int64_t blocks = (N + 7) / 8;
      const int64_t b0 = blocks * i / n_threads, b1 = blocks * (i + 1) / n_threads;
      const int64_t n_begin = b0 * 8, n_end = b1 * 8 < N ? b1 * 8 : N;
      if (n_begin < n_end) bf16_rows_any(p, TT, n_begin, n_end, path);
    }
  }
}

void gemv_f32(const float* x, int64_t x_stride, const float* w, int64_t w_stride, const float* bias,
              float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K, int max_threads) {
  const Isa isa = active_isa();
  const int nt = pick_threads(max_threads, N * K, kMinParallelWork, N / 8);
  for (int64_t t0 = 0; t0 < T; t0 += kMaxRowsPerPass) {
    const int TT = static_cast<int>(T - t0 < kMaxRowsPerPass ? T - t0 : kMaxRowsPerPass);
    const GemvProblem p{x + t0 * x_stride, x_stride, w, w_stride, bias, y + t0 * y_stride, y_stride, K};
    if (nt == 1) {
      rows_any(p, TT, 0, N, isa);
      continue;
    }
#pragma omp parallel num_threads(nt)
    {
      // Contiguous share per thread, boundaries on multiples of 8 rows so blocks stay whole.
      const int i = omp_get_thread_num(), n_threads = omp_get_num_threads();
      const int64_t blocks = (N + 7) / 8;
      const int64_t b0 = blocks * i / n_threads, b1 = blocks * (i + 1) / n_threads;
      const int64_t n_begin = b0 * 8, n_end = b1 * 8 < N ? b1 * 8 : N;
      if (n_begin < n_end) rows_any(p, TT, n_begin, n_end, isa);
    }
  }
}

}  // namespace duet
