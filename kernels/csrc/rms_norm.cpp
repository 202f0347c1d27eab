// Fused (residual add +) RMSNorm, fp32, as HF Llama computes it:
//   r = x + residual;  out = (r * (1 / sqrt(mean(r^2) + eps))) * weight
// bf16 rows (rms_norm_bf16) round where torch's bf16 ops round: r = bf16(x + residual),
// y = bf16(r * inv) (the reference's .to(x.dtype)), out = bf16(weight * y); sums in fp32.
// One row is E floats (E = 576 for SmolLM2): at T = 1 the whole op is ~3 passes over 2.3 KB, so
// the point is a single call with no temporaries. Rows are independent; OpenMP splits them only
// for big T (a fork/join costs more than a row).
#include <omp.h>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

constexpr int64_t kMinParallelWork = 1 << 16;  // floats; below this one thread wins

// Each row function: writes r (if res_out) and returns nothing; sum of squares then scale.
void row_scalar(const float* x, const float* res, const float* w, float* out, float* res_out,
                int64_t E, float eps) {
  float ss = 0.f;
  for (int64_t e = 0; e < E; ++e) {
    float r = res ? x[e] + res[e] : x[e];
    if (res_out) res_out[e] = r;
    ss += r * r;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
  const float* src = res_out ? res_out : x;
  for (int64_t e = 0; e < E; ++e) out[e] = (src[e] * inv) * w[e];
}

DUET_AVX2 void row_avx2(const float* x, const float* res, const float* w, float* out, float* res_out,
                        int64_t E, float eps) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= E; e += 8) {
    __m256 r = _mm256_loadu_ps(x + e);
    if (res) {
      r = _mm256_add_ps(r, _mm256_loadu_ps(res + e));
      _mm256_storeu_ps(res_out + e, r);
    }
    if ((e / 8) & 1) acc1 = _mm256_fmadd_ps(r, r, acc1);
    else acc0 = _mm256_fmadd_ps(r, r, acc0);
  }
  float ss = hsum256(_mm256_add_ps(acc0, acc1));
  for (int64_t j = e; j < E; ++j) {
    float r = res ? x[j] + res[j] : x[j];
    if (res_out) res_out[j] = r;
    ss += r * r;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  const float* src = res_out ? res_out : x;
  for (e = 0; e + 8 <= E; e += 8)
    _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + e), vinv),
                                            _mm256_loadu_ps(w + e)));
  for (; e < E; ++e) out[e] = (src[e] * inv) * w[e];
}

DUET_AVX512 void row_avx512(const float* x, const float* res, const float* w, float* out,
                            float* res_out, int64_t E, float eps) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 32 <= E; e += 32) {  // two chains hide the FMA latency
    __m512 r0 = _mm512_loadu_ps(x + e), r1 = _mm512_loadu_ps(x + e + 16);
    if (res) {
      r0 = _mm512_add_ps(r0, _mm512_loadu_ps(res + e));
      r1 = _mm512_add_ps(r1, _mm512_loadu_ps(res + e + 16));
      _mm512_storeu_ps(res_out + e, r0);
      _mm512_storeu_ps(res_out + e + 16, r1);
    }
    acc0 = _mm512_fmadd_ps(r0, r0, acc0);
    acc1 = _mm512_fmadd_ps(r1, r1, acc1);
  }
  for (; e < E; e += 16) {  // last 1..31 floats, masked
    const __mmask16 m = tail_mask512(static_cast<int>(E - e));
    __m512 r = _mm512_maskz_loadu_ps(m, x + e);
    if (res) {
      r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, res + e));
      _mm512_mask_storeu_ps(res_out + e, m, r);
    }
    acc0 = _mm512_fmadd_ps(r, r, acc0);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  const float* src = res_out ? res_out : x;
  for (e = 0; e < E; e += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(E - e));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + e), vinv),
                             _mm512_maskz_loadu_ps(m, w + e));
    _mm512_mask_storeu_ps(out + e, m, y);
  }
}

// bf16: one pass for r and the sum of squares, one for the output (AVX-512, else scalar).
void row_bf16_scalar(const bf16_t* x, const bf16_t* res, const bf16_t* w, bf16_t* out, bf16_t* res_out, int64_t E,
                     float eps) {
  float ss = 0.f;
  for (int64_t e = 0; e < E; ++e) {
    const float r = res ? round_as<bf16_t>(to_f32(x[e]) + to_f32(res[e])) : to_f32(x[e]);
    if (res_out) res_out[e] = from_f32<bf16_t>(r);
    ss += r * r;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
  const bf16_t* src = res_out ? res_out : x;
  for (int64_t e = 0; e < E; ++e) out[e] = from_f32<bf16_t>(round_as<bf16_t>(to_f32(src[e]) * inv) * to_f32(w[e]));
}

DUET_AVX512 void row_bf16_avx512(const bf16_t* x, const bf16_t* res, const bf16_t* w, bf16_t* out, bf16_t* res_out,
                                 int64_t E, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(E - e < 16 ? E - e : 16));
    __m512 r = load16(m, x + e);
    if (res) {
      r = round16<bf16_t>(_mm512_add_ps(r, load16(m, res + e)));
      store16(m, res_out + e, r);
    }
    acc = _mm512_fmadd_ps(r, r, acc);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(E) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  const bf16_t* src = res_out ? res_out : x;
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(E - e < 16 ? E - e : 16));
    store16(m, out + e, _mm512_mul_ps(round16<bf16_t>(_mm512_mul_ps(load16(m, src + e), vinv)), load16(m, w + e)));
  }
}

}  // namespace

void rms_norm_bf16(const bf16_t* x, int64_t x_stride, const bf16_t* residual, int64_t res_stride, const bf16_t* weight,
                   bf16_t* out, bf16_t* res_out, int64_t T, int64_t E, float eps, int max_threads) {
  auto row = active_isa() == Isa::kAvx512 ? row_bf16_avx512 : row_bf16_scalar;
  const int nt = pick_threads(max_threads, T * E, kMinParallelWork, T);
  parallel_for(nt, T, [&](int64_t t) {
    row(x + t * x_stride, residual ? residual + t * res_stride : nullptr, weight, out + t * E,
        res_out ? res_out + t * E : nullptr, E, eps);
  });
}

void rms_norm_f32(const float* x, int64_t x_stride, const float* residual, int64_t res_stride,
                  const float* weight, float* out, float* res_out, int64_t T, int64_t E, float eps,
                  int max_threads) {
  const Isa isa = active_isa();
  auto row = isa == Isa::kAvx512 ? row_avx512 : isa == Isa::kAvx2 ? row_avx2 : row_scalar;
  const int nt = pick_threads(max_threads, T * E, kMinParallelWork, T);
  parallel_for(nt, T, [&](int64_t t) {
    row(x + t * x_stride, residual ? residual + t * res_stride : nullptr, weight, out + t * E,
        res_out ? res_out + t * E : nullptr, E, eps);
  });
}

}  // namespace duet
