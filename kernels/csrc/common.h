// Shared helpers for Duet's CPU kernels: ISA selection, per-ISA target attributes, vector exp and
// horizontal sums.
//
// One binary runs on any x86-64 CPU: nothing is compiled with -march. Each kernel has a scalar
// version, an AVX2+FMA version and an AVX-512 version; the latter two are ordinary functions marked
// with a function-level target attribute (DUET_AVX2 / DUET_AVX512), so the compiler may emit those
// instructions only inside them, and the dispatcher calls one only when the CPU reports the ISA
// (__builtin_cpu_supports, checked once). Helpers called from such a function carry the same (or a
// smaller) target so that they inline.
//
// Kernel files include no torch header: they work on raw pointers and strides (fast to compile);
// bindings.cpp checks tensors and calls them.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#define DUET_AVX2 __attribute__((target("avx2,fma")))
#define DUET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define DUET_INLINE inline __attribute__((always_inline))

namespace duet {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best ISA this CPU supports (checked once).
Isa best_isa();
// The ISA kernels dispatch to: best_isa() unless lowered by set_isa (tests use it to run every path).
Isa active_isa();
// Request an ISA; clamped to best_isa(). Returns the ISA now active.
Isa set_isa(Isa isa);
const char* isa_name(Isa isa);
// Whether kernels may use the AVX-512 dot-product extensions a CPU may or may not have on top of
// AVX-512 (AVX512-BF16's vdpbf16ps, AVX512-VNNI's vpdpbusd): true by default, so each kernel takes
// them exactly when __builtin_cpu_supports reports them. Tests turn it off to run the plain
// AVX-512 fallback that an AVX-512 CPU without those extensions takes. Returns the new value.
bool dot_extensions_enabled();
// What the CPU itself reports (checked once, whatever set_dot_extensions says).
bool cpu_has_avx512bf16();
bool cpu_has_vnni();
bool set_dot_extensions(bool on);

// Run a loop with OpenMP only when it is worth a fork/join: `work` is a rough count of floats
// touched, `min_work` the amount below which one thread is faster.
inline int pick_threads(int max_threads, int64_t work, int64_t min_work, int64_t items) {
  if (max_threads <= 1 || work < min_work || items < 2) return 1;
  return static_cast<int>(items < max_threads ? items : max_threads);
}

// body(i) for i in [0, n): a plain loop when nt == 1 (no OpenMP call at all: even a region with a
// false if() clause pays the runtime's entry cost, comparable to a small kernel), else an OpenMP loop over nt threads, statically split.
template <typename F>
inline void parallel_for(int nt, int64_t n, F&& body) {
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) body(i);
}

// ---- AVX2 helpers ----------------------------------------------------------------------------

DUET_AVX2 DUET_INLINE float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Mask selecting the first n (0..8) lanes, for _mm256_maskload_ps / _mm256_maskstore_ps.
DUET_AVX2 DUET_INLINE __m256i tail_mask256(int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}

// exp(x) for fp32 lanes (Cephes expf polynomial, ~1-2 ulp on [-87, 88]). Inputs are clamped to
// [-87.3, 88.3] so the 2^n exponent trick stays in range: exp of very negative x returns ~1e-38
// instead of 0 or a denormal, which no caller can tell apart (softmax weights, sigmoid).
DUET_AVX2 DUET_INLINE __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// ---- AVX-512 helpers -------------------------------------------------------------------------

// Mask selecting the first n (0..16) lanes.
DUET_AVX512 DUET_INLINE __mmask16 tail_mask512(int n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFF : ((1u << n) - 1u));
}

// exp(x) for fp32 lanes: same polynomial as exp256, scaled by 2^n with vscalefps, which handles
// overflow (inf) and gradual underflow (denormals, then 0) itself. x is clamped to [-104, 89]
// (beyond both, expf is already 0 or inf) so that r stays finite.
DUET_AVX512 DUET_INLINE __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Sixteen vectors in, one vector out: lane i = sum of the 16 lanes of v[i] (a transpose-and-add
// tree: 15 adds and 30 shuffles for 16 sums instead of 16 separate reductions).
DUET_AVX512 DUET_INLINE __m512 hsum16x16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lane holds [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L holds lane-L sums of v[4i..4i+3]
    __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Fold the four 128-bit lanes: w0 = [u0 L0+L1, u0 L2+L3, u1 L0+L1, u1 L2+L3], likewise w1.
  __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// ---- bfloat16 ----------------------------------------------------------------------------------
// Kernels that take bf16 tensors store them as uint16_t bit patterns (torch's c10::BFloat16 layout:
// the upper half of an fp32), compute in fp32 and round back with torch's own rule (round to
// nearest even, NaN -> 0x7FC0), in plain integer code, so results do not depend on whether the CPU
// has AVX512-BF16. `to_f32` / `from_f32` are the scalar forms; templates over the element type
// (float or bf16_t) use them for both.
using bf16_t = uint16_t;

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t bf16_bits(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
template <typename T>
inline T from_f32(float f);
template <>
inline float from_f32<float>(float f) { return f; }
template <>
inline bf16_t from_f32<bf16_t>(float f) { return bf16_bits(f); }
// f rounded to T and back (the identity for float): how torch rounds an intermediate result.
template <typename T>
inline float round_as(float f) { return to_f32(from_f32<T>(f)); }

// 16 lanes of T <-> fp32 (AVX-512); masked forms read / write only the first lanes of m.
DUET_AVX512 DUET_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
DUET_AVX512 DUET_INLINE __m512 load16(const bf16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
DUET_AVX512 DUET_INLINE __m512 load16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
DUET_AVX512 DUET_INLINE __m512 load16(__mmask16 m, const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// fp32 lanes -> bf16 bits in the low 16 bits of each int32 lane (torch's rounding).
DUET_AVX512 DUET_INLINE __m512i bf16_round_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
DUET_AVX512 DUET_INLINE void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
DUET_AVX512 DUET_INLINE void store16(bf16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_round_bits(v)));
}
DUET_AVX512 DUET_INLINE void store16(__mmask16 m, float* p, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
DUET_AVX512 DUET_INLINE void store16(__mmask16 m, bf16_t* p, __m512 v) {
  _mm512_mask_cvtepi32_storeu_epi16(p, m, bf16_round_bits(v));
}
// v rounded to T and back, 16 lanes (round_as for vectors).
template <typename T>
DUET_AVX512 DUET_INLINE __m512 round16(__m512 v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round_bits(v), 16));
  }
}

}  // namespace duet
