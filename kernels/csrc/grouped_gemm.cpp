// Grouped expert GEMM for MoE, fp32 (math and dispatch rationale: kernels/grouped_gemm.py):
//   y[o[e]:o[e+1]] = x[o[e]:o[e+1]] @ w[e]^T   for every expert e, rows of x sorted by expert.
// Small groups (<= max_gemv_rows rows, the decode case: bound by reading w[e]) run the SIMD/OpenMP
// GEMV of gemv.cpp, which streams w[e] once with all threads; larger groups call MKL's GEMM through
// at::mm_out straight into y's rows, with no Python between experts. Empty groups are skipped.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include "kernels.h"

namespace duet {

at::Tensor grouped_gemm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& offsets,
                        int64_t max_gemv_rows) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat, "w must be a float32 CPU tensor");
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K], got ", x_in.sizes());
  TORCH_CHECK(w.dim() == 3 && w.stride(2) == 1, "w must be [E, N, K] with a contiguous last dim, got ", w.sizes());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1);
  TORCH_CHECK(w.size(2) == K, "w is ", w.sizes(), " but x has K = ", K);
  TORCH_CHECK(offsets.device().is_cpu() && offsets.dim() == 1 && offsets.size(0) == E + 1,
              "offsets must be a CPU tensor [E + 1 = ", E + 1, "], got ", offsets.sizes());
  const at::Tensor off = offsets.to(at::kLong).contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[E] == M, "offsets must start at 0 and end at M = ", M, ", got ", o[0], " .. ", o[E]);
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(o[e] <= o[e + 1], "offsets must be non-decreasing, got ", o[e], " > ", o[e + 1], " at expert ", e);
  at::Tensor y = at::detail::empty_cpu({M, N}, at::kFloat);
  const int threads = at::get_num_threads();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t lo = o[e], rows = o[e + 1] - o[e];
    if (rows == 0) continue;
    if (rows <= max_gemv_rows) {
      const float* we = w.data_ptr<float>() + e * w.stride(0);
      gemv_f32(x.data_ptr<float>() + lo * x.stride(0), x.stride(0), we, w.stride(1), nullptr,
               y.data_ptr<float>() + lo * N, N, rows, N, K, threads);
    } else {
      at::Tensor dst = y.narrow(0, lo, rows);
      at::mm_out(dst, x.narrow(0, lo, rows), w.select(0, e).t());
    }
  }
  return y;
}

}  // namespace duet
