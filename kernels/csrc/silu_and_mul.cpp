// SwiGLU gate on the fused [gate | up] projection, fp32:
//   out[t, i] = silu(x[t, i]) * x[t, I + i],  silu(g) = g / (1 + exp(-g))
// exp is the vector polynomial of common.h (~1-2 ulp), so results match torch's fp32 silu to a few
// ulp. bf16 rows (silu_and_mul_bf16) round like torch's bf16 ops: out = bf16(bf16(silu(gate)) * up).
// Rows split across OpenMP threads only when the tensor is big (T * I >= 64K).
#include <omp.h>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

constexpr int64_t kMinParallelWork = 1 << 16;

void row_scalar(const float* g, const float* u, float* out, int64_t I) {
  for (int64_t i = 0; i < I; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

DUET_AVX2 void row_avx2(const float* g, const float* u, float* out, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    __m256 x = _mm256_loadu_ps(g + i);
    __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  if (i < I) {
    const __m256i m = tail_mask256(static_cast<int>(I - i));
    __m256 x = _mm256_maskload_ps(g + i, m);
    __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(s, _mm256_maskload_ps(u + i, m)));
  }
}

DUET_AVX512 void row_avx512(const float* g, const float* u, float* out, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(I - i < 16 ? I - i : 16));
    __m512 x = _mm512_maskz_loadu_ps(m, g + i);
    __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
  }
}

void row_bf16_scalar(const bf16_t* g, const bf16_t* u, bf16_t* out, int64_t I) {
  for (int64_t i = 0; i < I; ++i) {
    const float x = to_f32(g[i]);
    out[i] = from_f32<bf16_t>(round_as<bf16_t>(x / (1.0f + std::exp(-x))) * to_f32(u[i]));
  }
}

DUET_AVX512 void row_bf16_avx512(const bf16_t* g, const bf16_t* u, bf16_t* out, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(I - i < 16 ? I - i : 16));
    const __m512 x = load16(m, g + i);
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    store16(m, out + i, _mm512_mul_ps(round16<bf16_t>(s), load16(m, u + i)));
  }
}

}  // namespace

void silu_and_mul_bf16(const bf16_t* x, int64_t x_stride, bf16_t* out, int64_t T, int64_t I, int max_threads) {
  auto row = active_isa() == Isa::kAvx512 ? row_bf16_avx512 : row_bf16_scalar;
  const int nt = pick_threads(max_threads, T * I, kMinParallelWork, T);
  parallel_for(nt, T, [&](int64_t t) { row(x + t * x_stride, x + t * x_stride + I, out + t * I, I); });
}

void silu_and_mul_f32(const float* x, int64_t x_stride, float* out, int64_t T, int64_t I, int max_threads) {
  const Isa isa = active_isa();
  auto row = isa == Isa::kAvx512 ? row_avx512 : isa == Isa::kAvx2 ? row_avx2 : row_scalar;
  const int nt = pick_threads(max_threads, T * I, kMinParallelWork, T);
  parallel_for(nt, T, [&](int64_t t) { row(x + t * x_stride, x + t * x_stride + I, out + t * I, I); });
}

}  // namespace duet
