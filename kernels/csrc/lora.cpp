// Batched LoRA at decode sizes, one call per projection (math, dispatch and precision: kernels/lora.py):
//   y[t, start_p : start_p + n_p] += scales[s] * (x[t] @ A_p[s]^T) @ Bt_p[s]      s = idx[t] >= 0, every part p
// Token by token: the rank-R intermediate h = scale * A_p[s] x[t] (R dot products over K, fp32) and
// then y's n_p columns += h @ Bt_p[s] (R axpys over contiguous rows of the transposed B), added into
// y once per element. Every token's update depends only on that token (no batch-shaped GEMM), so a
// row's result is the same whichever batch it runs in. x, y and the slots' weights are all float32
// or all bf16 (fp32 accumulation; a bf16 y is rounded once, after the add). AVX-512 or scalar.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

struct Part {
  const void* a;    // [S, R, K] (last dim contiguous)
  int64_t a_slot, a_row;
  const void* bt;   // [S, R, n] (last dim contiguous)
  int64_t b_slot, b_row;
  int64_t start, n;  // y's columns
};

template <typename T>
void token_scalar(const T* x, T* y, const Part* parts, int P, int64_t s, float scale, int64_t R, int64_t K,
                  float* xf, float* h) {
  for (int64_t k = 0; k < K; ++k) xf[k] = to_f32(x[k]);
  for (int p = 0; p < P; ++p) {
    const Part& q = parts[p];
    const T* a = static_cast<const T*>(q.a) + s * q.a_slot;
    const T* bt = static_cast<const T*>(q.bt) + s * q.b_slot;
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += to_f32(a[r * q.a_row + k]) * xf[k];
      h[r] = acc * scale;
    }
    T* yp = y + q.start;
    for (int64_t j = 0; j < q.n; ++j) {
      float acc = 0.0f;
      for (int64_t r = 0; r < R; ++r) acc += h[r] * to_f32(bt[r * q.b_row + j]);
      yp[j] = from_f32<T>(to_f32(yp[j]) + acc);
    }
  }
}

template <typename T>
DUET_AVX512 void token_avx512(const T* x, T* y, const Part* parts, int P, int64_t s, float scale, int64_t R,
                              int64_t K, float* xf, float* h) {
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask512(static_cast<int>(K - k < 16 ? K - k : 16));
    _mm512_mask_storeu_ps(xf + k, m, load16(m, x + k));
  }
  for (int p = 0; p < P; ++p) {
    const Part& q = parts[p];
    const T* a = static_cast<const T*>(q.a) + s * q.a_slot;
    const T* bt = static_cast<const T*>(q.bt) + s * q.b_slot;
    for (int64_t r = 0; r < R; ++r) {
      const T* ar = a + r * q.a_row;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = tail_mask512(static_cast<int>(K - k < 16 ? K - k : 16));
        acc = _mm512_fmadd_ps(load16(m, ar + k), _mm512_maskz_loadu_ps(m, xf + k), acc);
      }
      h[r] = _mm512_reduce_add_ps(acc) * scale;
    }
    T* yp = y + q.start;
    for (int64_t j = 0; j < q.n; j += 16) {
      const __mmask16 m = tail_mask512(static_cast<int>(q.n - j < 16 ? q.n - j : 16));
      __m512 acc = _mm512_setzero_ps();
      for (int64_t r = 0; r < R; ++r) acc = _mm512_fmadd_ps(_mm512_set1_ps(h[r]), load16(m, bt + r * q.b_row + j), acc);
      store16(m, yp + j, _mm512_add_ps(load16(m, yp + j), acc));
    }
  }
}

template <typename T>
void run(const at::Tensor& y, const at::Tensor& x, const std::vector<Part>& parts, const int64_t* idx,
         const float* scales, int64_t R) {
  const int64_t T_ = x.size(0), K = x.size(1);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const bool avx512 = active_isa() == Isa::kAvx512;
  int64_t work = 0;
  for (const Part& q : parts) work += R * (K + q.n);
  const int nt = pick_threads(at::get_num_threads(), work * T_, 1 << 18, T_);
  parallel_for(nt, T_, [&](int64_t t) {
    const int64_t s = idx[t];
    if (s < 0) return;
    std::vector<float> buf(K + R);
    auto token = avx512 ? token_avx512<T> : token_scalar<T>;
    token(xp + t * x.stride(0), yp + t * y.stride(0), parts.data(), static_cast<int>(parts.size()), s, scales[s], R,
          K, buf.data(), buf.data() + K);
  });
}

}  // namespace

void lora_rows(const at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a,
               const std::vector<at::Tensor>& bt, const std::vector<int64_t>& starts, const at::Tensor& scales,
               const at::Tensor& idx) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "lora_rows: x must be float32 or bfloat16, got ", dt);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "lora_rows: x must be a CPU [T, K] with a "
              "contiguous last dim, got ", x.sizes());
  TORCH_CHECK(y.scalar_type() == dt && y.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1,
              "lora_rows: y must be [T, N] of x's dtype with a contiguous last dim, got ", y.sizes(), " ", y.scalar_type());
  TORCH_CHECK(a.size() == bt.size() && a.size() == starts.size() && !a.empty(), "lora_rows: one a, bt and start per part");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1, "lora_rows: scales [S] float32");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.dim() == 1 && idx.size(0) == x.size(0),
              "lora_rows: idx [T] int64");
  const int64_t S = scales.size(0), R = a[0].size(1), K = x.size(1);
  std::vector<Part> parts;
  for (size_t p = 0; p < a.size(); ++p) {
    const at::Tensor& ap = a[p];
    const at::Tensor& bp = bt[p];
    TORCH_CHECK(ap.scalar_type() == dt && bp.scalar_type() == dt, "lora_rows: the slots' dtype must be x's (", dt, ")");
    TORCH_CHECK(ap.dim() == 3 && ap.size(0) == S && ap.size(1) == R && ap.size(2) == K && ap.stride(2) == 1,
                "lora_rows: a[", p, "] must be [S, R, K] = [", S, ", ", R, ", ", K, "], got ", ap.sizes());
    TORCH_CHECK(bp.dim() == 3 && bp.size(0) == S && bp.size(1) == R && bp.stride(2) == 1,
                "lora_rows: bt[", p, "] must be [S, R, n], got ", bp.sizes());
    const int64_t n = bp.size(2);
    TORCH_CHECK(starts[p] >= 0 && starts[p] + n <= y.size(1), "lora_rows: part ", p, " columns [", starts[p], ", ",
                starts[p] + n, ") outside y's ", y.size(1));
    parts.push_back({ap.data_ptr(), ap.stride(0), ap.stride(1), bp.data_ptr(), bp.stride(0), bp.stride(1), starts[p], n});
  }
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < idx.size(0); ++t)
    TORCH_CHECK(ip[t] < S, "lora_rows: adapter index ", ip[t], " >= ", S, " slots");
  if (dt == at::kFloat)
    run<float>(y, x, parts, ip, scales.data_ptr<float>(), R);
  else
    run<bf16_t>(y, x, parts, ip, scales.data_ptr<float>(), R);
}

}  // namespace duet
