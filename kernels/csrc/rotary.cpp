// RoPE on q and k in place, then k and v written into the paged cache, fp32 or bf16, in one pass
// (kv_bf16: fp32 q/k/v, and k and v rounded to bf16 as they are written to a bf16 cache).
//
// Rotate-half layout (HF Llama/Qwen2): for a head vector x = [x1 | x2] (halves of D/2) and the
// token's cos/sin rows c, s (D/2 each):
//   x <- [x1 * c - x2 * s | x2 * c + x1 * s]
// computed as separate multiplies and a subtract/add, like the torch reference (no FMA), so results
// match it bit for bit (bf16: each product and the sum rounded to bf16, as torch's bf16 ops do,
// so again bit for bit). Then k_cache[slot[t], g] = k[t, g] and v_cache[slot[t], g] = v[t, g];
// a negative slot (padding) is skipped.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

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

void rot_bf16_scalar(bf16_t* x, const bf16_t* c, const bf16_t* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f32(x[i]), x2 = to_f32(x[half + i]), ci = to_f32(c[i]), si = to_f32(s[i]);
    const float a = round_as<bf16_t>(x1 * ci), b = round_as<bf16_t>(x2 * si);
    const float e = round_as<bf16_t>(x2 * ci), f = round_as<bf16_t>(x1 * si);
    x[i] = from_f32<bf16_t>(a - b);
    x[half + i] = from_f32<bf16_t>(e + f);
  }
}

DUET_AVX512 void rot_bf16_avx512(bf16_t* x, const bf16_t* c, const bf16_t* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(std::min<int64_t>(half - i, 16)));
    const __m512 x1 = load16(m, x + i), x2 = load16(m, x + half + i), cv = load16(m, c + i), sv = load16(m, s + i);
    const __m512 a = round16<bf16_t>(_mm512_mul_ps(x1, cv)), b = round16<bf16_t>(_mm512_mul_ps(x2, sv));
    const __m512 e = round16<bf16_t>(_mm512_mul_ps(x2, cv)), f = round16<bf16_t>(_mm512_mul_ps(x1, sv));
    store16(m, x + i, _mm512_sub_ps(a, b));
    store16(m, x + half + i, _mm512_add_ps(e, f));
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

namespace {

// Writes one head's row of n elements into the cache: a copy in the same type, or rounded to bf16
// (round to nearest even, as torch's .to(bfloat16)) from fp32 for a bf16 cache.
template <typename T, typename C>
inline void store_row(C* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = from_f32<C>(src[d]);
  }
}

template <typename T, typename C>  // activations' element type, the cache's
void rotary_cache(const RotaryCacheArgs& a, void (*rot)(T*, const T*, const T*, int64_t), int max_threads) {
  const int64_t half = a.D / 2;
  const int nt = pick_threads(max_threads, a.T * (a.H + 2 * a.G) * a.D, kMinParallelWork, a.T);
  T* q = static_cast<T*>(a.q);
  T* kk = static_cast<T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  C* k_cache = static_cast<C*>(a.k_cache);
  C* v_cache = static_cast<C*>(a.v_cache);
  parallel_for(nt, a.T, [&](int64_t t) {
    const T* c = static_cast<const T*>(a.cos) + t * a.cos_st;
    const T* s = static_cast<const T*>(a.sin) + t * a.sin_st;
    for (int64_t h = 0; h < a.H; ++h) rot(q + t * a.q_st + h * a.q_sh, c, s, half);
    const int64_t slot = slot_at(a, t);
    for (int64_t g = 0; g < a.G; ++g) {
      T* k = kk + t * a.k_st + g * a.k_sh;
      rot(k, c, s, half);
      if (slot < 0) continue;
      store_row(k_cache + slot * a.kc_ss + g * a.kc_sg, k, a.D);
      store_row(v_cache + slot * a.vc_ss + g * a.vc_sg, v + t * a.v_st + g * a.v_sh, a.D);
    }
  });
}

}  // namespace

void rotary_and_cache_write(const RotaryCacheArgs& a, int max_threads) {
  const Isa isa = active_isa();
  if (a.bf16) {
    rotary_cache<bf16_t, bf16_t>(a, isa == Isa::kAvx512 ? rot_bf16_avx512 : rot_bf16_scalar, max_threads);
    return;
  }
  const auto rot = isa == Isa::kAvx512 ? rot_avx512 : isa == Isa::kAvx2 ? rot_avx2 : rot_scalar;
  if (a.kv_bf16) {
    rotary_cache<float, bf16_t>(a, rot, max_threads);
  } else {
    rotary_cache<float, float>(a, rot, max_threads);
  }
}

}  // namespace duet
