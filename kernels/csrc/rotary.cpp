// RoPE on q and k in place, then k and v written into the paged cache, fp32, in one pass.
//
// Rotate-half layout (HF Llama/Qwen2): for a head vector x = [x1 | x2] (halves of D/2) and the
// token's cos/sin rows c, s (D/2 each):
//   x <- [x1 * c - x2 * s | x2 * c + x1 * s]
// computed as separate multiplies and a subtract/add, like the torch reference (no FMA), so results
// match it bit for bit. Then k_cache[slot[t], g] = k[t, g] and v_cache[slot[t], g] = v[t, g];
// a negative slot (padding) is skipped.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

constexpr int64_t kMinParallelWork = 1 << 16;

using RotFn = void (*)(float* x, const float* c, const float* s, int64_t half);

void rot_scalar(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
    x[i] = a - b;
    x[half + i] = e + f;
  }
}

DUET_AVX2 void rot_avx2(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 8) {
    const __m256i m = tail_mask256(static_cast<int>(std::min<int64_t>(half - i, 8)));
    const __m256 x1 = _mm256_maskload_ps(x + i, m), x2 = _mm256_maskload_ps(x + half + i, m);
    const __m256 cv = _mm256_maskload_ps(c + i, m), sv = _mm256_maskload_ps(s + i, m);
    _mm256_maskstore_ps(x + i, m, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    _mm256_maskstore_ps(x + half + i, m, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
}

DUET_AVX512 void rot_avx512(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(std::min<int64_t>(half - i, 16)));
    const __m512 x1 = _mm512_maskz_loadu_ps(m, x + i), x2 = _mm512_maskz_loadu_ps(m, x + half + i);
    const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)));
    _mm512_mask_storeu_ps(x + half + i, m, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)));
  }
}

inline int64_t slot_at(const RotaryCacheArgs& a, int64_t t) {
  return a.slot_is64 ? static_cast<const int64_t*>(a.slot_mapping)[t]
                     : static_cast<const int32_t*>(a.slot_mapping)[t];
}

}  // namespace

std::string rotary_cache_validate(const RotaryCacheArgs& a) {
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t slot = slot_at(a, t);
    if (slot >= a.S)
      return "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot) + " is outside the cache (" +
             std::to_string(a.S) + " slots)";
  }
  return "";
}

void rotary_and_cache_write_f32(const RotaryCacheArgs& a, int max_threads) {
  const Isa isa = active_isa();
  const RotFn rot = isa == Isa::kAvx512 ? rot_avx512 : isa == Isa::kAvx2 ? rot_avx2 : rot_scalar;
  const int64_t half = a.D / 2;
  const int nt = pick_threads(max_threads, a.T * (a.H + 2 * a.G) * a.D, kMinParallelWork, a.T);
  parallel_for(nt, a.T, [&](int64_t t) {
    const float* c = a.cos + t * a.cos_st;
    const float* s = a.sin + t * a.sin_st;
    for (int64_t h = 0; h < a.H; ++h) rot(a.q + t * a.q_st + h * a.q_sh, c, s, half);
    const int64_t slot = slot_at(a, t);
    for (int64_t g = 0; g < a.G; ++g) {
      float* k = a.k + t * a.k_st + g * a.k_sh;
      rot(k, c, s, half);
      if (slot < 0) continue;
      std::memcpy(a.k_cache + slot * a.kc_ss + g * a.kc_sg, k, a.D * sizeof(float));
      std::memcpy(a.v_cache + slot * a.vc_ss + g * a.vc_sg, a.v + t * a.v_st + g * a.v_sh, a.D * sizeof(float));
    }
  });
}

}  // namespace duet
