// Merge N partial attention outputs over disjoint key sets (ring attention, split-KV), fp32:
//   M = max_p lse_p;  w_p = exp(lse_p - M);  out = sum_p w_p o_p / sum_p w_p;  lse = M + log sum_p w_p
// per (token, head) row of D floats. Exact: each partial o_p is softmax-normalised over its own keys
// and exp(lse_p) is its softmax denominator, so the weights restore the global softmax. A partial
// with lse = -inf (it saw no key) gets weight 0; a row where every lse is -inf becomes zeros with
// lse -inf.
#include <omp.h>

#include <algorithm>
#include <limits>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

constexpr int64_t kMinParallelWork = 1 << 16;  // floats written; below this one thread wins
constexpr int64_t kMaxInline = 16;             // partials whose weights live on the stack

using AxpyFn = void (*)(float* o, const float* x, float w, int64_t D, bool first);

// o = w * x (first) or o += w * x.
void axpy_scalar(float* o, const float* x, float w, int64_t D, bool first) {
  for (int64_t d = 0; d < D; ++d) o[d] = first ? w * x[d] : o[d] + w * x[d];
}

DUET_AVX512 void axpy_avx512(float* o, const float* x, float w, int64_t D, bool first) {
  const __m512 vw = _mm512_set1_ps(w);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(std::min<int64_t>(D - d, 16)));
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + d);
    const __m512 r = first ? _mm512_mul_ps(vw, xv) : _mm512_fmadd_ps(vw, xv, _mm512_maskz_loadu_ps(m, o + d));
    _mm512_mask_storeu_ps(o + d, m, r);
  }
}

DUET_AVX2 void axpy_avx2(float* o, const float* x, float w, int64_t D, bool first) {
  const __m256 vw = _mm256_set1_ps(w);
  for (int64_t d = 0; d < D; d += 8) {
    const __m256i m = tail_mask256(static_cast<int>(std::min<int64_t>(D - d, 8)));
    const __m256 xv = _mm256_maskload_ps(x + d, m);
    const __m256 r = first ? _mm256_mul_ps(vw, xv) : _mm256_fmadd_ps(vw, xv, _mm256_maskload_ps(o + d, m));
    _mm256_maskstore_ps(o + d, m, r);
  }
}

}  // namespace

void merge_attn_states_f32(const float* const* outs, const float* const* lses, int64_t N, float* out, float* lse_out,
                           int64_t T, int64_t H, int64_t D, int max_threads) {
  const Isa isa = active_isa();
  const AxpyFn axpy = isa == Isa::kAvx512 ? axpy_avx512 : isa == Isa::kAvx2 ? axpy_avx2 : axpy_scalar;
  const int64_t rows = T * H;
  const int nt = pick_threads(max_threads, rows * D * (N + 1), kMinParallelWork, rows);
  parallel_for(nt, rows, [&](int64_t r) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    float M = kNegInf;
    for (int64_t p = 0; p < N; ++p) M = std::max(M, lses[p][r]);
    float* o = out + r * D;
    if (M == kNegInf) {
      std::fill_n(o, D, 0.f);
      if (lse_out) lse_out[r] = kNegInf;
      return;
    }
    float wbuf[kMaxInline];
    float W = 0.f;
    for (int64_t p = 0; p < N; ++p) {
      const float w = std::exp(lses[p][r] - M);
      if (p < kMaxInline) wbuf[p] = w;
      W += w;
    }
    const float inv = 1.0f / W;  // W >= 1: the largest partial has weight exactly 1
    bool first = true;  // partials of weight 0 are skipped (their rows may hold anything)
    for (int64_t p = 0; p < N; ++p) {
      const float w = (p < kMaxInline ? wbuf[p] : std::exp(lses[p][r] - M)) * inv;
      if (w == 0.f) continue;
      axpy(o, outs[p] + r * D, w, D, first);
      first = false;
    }
    if (lse_out) lse_out[r] = M + std::log(W);
  });
}

}  // namespace duet
