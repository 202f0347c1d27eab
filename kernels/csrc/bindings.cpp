// Python bindings of Duet's CPU kernels: tensor checks, output allocation, then the raw-pointer
// kernels of kernels.h. Every op takes fp32 CPU tensors whose last dimension is contiguous; bad
// input raises RuntimeError (TORCH_CHECK) naming the argument. The Python wrappers in kernels/*.py
// decide when to call these and when to use the torch reference instead.
#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include "common.h"
#include "kernels.h"

// ---- MoE (grouped_gemm.cpp): checks and dispatch live beside the kernel.
namespace duet {
at::Tensor grouped_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets, int64_t max_gemv_rows);
}  // namespace duet
// ---- end MoE

// ---- batched LoRA at decode sizes (lora.cpp): checks beside the kernel.
namespace duet {
void lora_rows(const at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a,
               const std::vector<at::Tensor>& bt, const std::vector<int64_t>& starts, const at::Tensor& scales,
               const at::Tensor& idx);
}  // namespace duet

// ---- fused decoder stack (decoder_stack.cpp): its classes are bound beside the kernel.
namespace duet {
void bind_decoder_stack(pybind11::module& m);
void check_quant_tiles(const c10::optional<at::Tensor>& tiles, int64_t N, int64_t bytes);
}  // namespace duet
// ---- end decoder stack

namespace {

using at::Tensor;

void check_f32(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
}

// A new fp32 CPU tensor. at::detail::empty_cpu skips the dispatcher that at::empty goes through,
// which matters when the whole kernel is as short as the dispatch.
Tensor new_f32(at::IntArrayRef sizes) { return at::detail::empty_cpu(sizes, at::kFloat); }

// [..., E] -> [rows, E] with a contiguous last dim (a view when possible).
Tensor as_rows(const Tensor& t) {
  if (t.dim() == 2 && t.stride(1) == 1) return t;
  return t.reshape({-1, t.size(-1)}).contiguous();
}

void check_index(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must be int32 or int64, got ",
              t.scalar_type());
}

// float32 or bfloat16 (the dtypes the elementwise and linear kernels take); true for bf16.
bool check_f32_or_bf16(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16;
}

void check_same_dtype(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type(), " like x, got ",
              t.scalar_type());
}

// A KV cache tensor: q's dtype, or bfloat16 under a float32 q (a bf16 cache under fp32 activations);
// true for the latter (the kernels' kv_bf16).
bool check_cache_dtype(const Tensor& t, const Tensor& q, const char* name) {
  const bool mixed = q.scalar_type() == at::kFloat && t.scalar_type() == at::kBFloat16;
  TORCH_CHECK(mixed || t.scalar_type() == q.scalar_type(), name, " must be ", q.scalar_type(),
              q.scalar_type() == at::kFloat ? " or bfloat16" : "", " for a ", q.scalar_type(), " q, got ",
              t.scalar_type());
  return mixed;
}

duet::bf16_t* bf16_ptr(const Tensor& t) { return reinterpret_cast<duet::bf16_t*>(t.data_ptr<at::BFloat16>()); }

Tensor new_like_dtype(at::IntArrayRef sizes, const Tensor& like) {
  return at::detail::empty_cpu(sizes, like.scalar_type());
}

std::tuple<Tensor, c10::optional<Tensor>> rms_norm(const Tensor& x, const Tensor& weight, double eps,
                                                   const c10::optional<Tensor>& residual) {
  const bool bf16 = check_f32_or_bf16(x, "x");
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(x.dim() >= 1, "x must have a feature dimension");
  const int64_t E = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == E && weight.stride(0) == 1, "weight must be contiguous [",
              E, "], got ", weight.sizes());
  const Tensor x2 = as_rows(x);
  const int64_t T = x2.size(0);
  Tensor out = new_like_dtype(x.sizes(), x);
  Tensor r2, res_out;
  if (residual.has_value()) {
    check_same_dtype(*residual, x, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ",
                residual->sizes());
    r2 = as_rows(*residual);
    res_out = new_like_dtype(x.sizes(), x);
  }
  const bool has_res = residual.has_value();
  if (bf16) {
    duet::rms_norm_bf16(bf16_ptr(x2), x2.stride(0), has_res ? bf16_ptr(r2) : nullptr, has_res ? r2.stride(0) : 0,
                        bf16_ptr(weight), bf16_ptr(out), has_res ? bf16_ptr(res_out) : nullptr, T, E,
                        static_cast<float>(eps), at::get_num_threads());
  } else {
    duet::rms_norm_f32(x2.data_ptr<float>(), x2.stride(0), has_res ? r2.data_ptr<float>() : nullptr,
                       has_res ? r2.stride(0) : 0, weight.data_ptr<float>(), out.data_ptr<float>(),
                       has_res ? res_out.data_ptr<float>() : nullptr, T, E, static_cast<float>(eps),
                       at::get_num_threads());
  }
  if (!has_res) return {out, c10::nullopt};
  return {out, res_out};
}

Tensor silu_and_mul(const Tensor& x) {
  const bool bf16 = check_f32_or_bf16(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "x must be [..., 2I], got ", x.sizes());
  const Tensor x2 = as_rows(x);
  const int64_t I = x.size(-1) / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  Tensor out = new_like_dtype(sizes, x);
  if (bf16) {
    duet::silu_and_mul_bf16(bf16_ptr(x2), x2.stride(0), bf16_ptr(out), x2.size(0), I, at::get_num_threads());
  } else {
    duet::silu_and_mul_f32(x2.data_ptr<float>(), x2.stride(0), out.data_ptr<float>(), x2.size(0), I,
                           at::get_num_threads());
  }
  return out;
}

Tensor gemv(const Tensor& x_in, const Tensor& w, const c10::optional<Tensor>& bias) {
  const bool bf16 = check_f32_or_bf16(x_in, "x");
  check_same_dtype(w, x_in, "w");
  TORCH_CHECK(x_in.dim() == 2, "x must be [T, K], got ", x_in.sizes());
  const Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "w must be [N, K] with a contiguous last dim, got ", w.sizes());
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "w is ", w.sizes(), " but x has K = ", K);
  if (bias.has_value()) {
    check_same_dtype(*bias, x_in, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->stride(0) == 1, "bias must be contiguous [", N,
                "], got ", bias->sizes());
  }
  Tensor y = new_like_dtype({T, N}, x);
  {
    pybind11::gil_scoped_release no_gil;
    if (bf16) {
      duet::gemv_bf16(bf16_ptr(x), x.stride(0), bf16_ptr(w), w.stride(0), bias.has_value() ? bf16_ptr(*bias) : nullptr,
                      bf16_ptr(y), N, T, N, K, at::get_num_threads());
    } else {
      duet::gemv_f32(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.stride(0),
                     bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N, T, N, K,
                     at::get_num_threads());
    }
  }
  return y;
}

// y = x w^T (+ bias) for x [..., K]: the GEMV kernel when x has at most max_gemv_tokens rows and w
// has contiguous rows, else at::linear (MKL's fp32 GEMM / oneDNN's bf16 one win once the product is
// compute bound). Deciding here rather than in Python saves the Python attribute lookups on every
// call. float32 or bfloat16 (x, w and bias alike).
Tensor linear(const Tensor& x, const Tensor& w, const c10::optional<Tensor>& bias, int64_t max_gemv_tokens) {
  if (x.dim() != 2) {
    TORCH_CHECK(x.dim() >= 1, "x must be [..., K]");
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return linear(x.reshape({-1, x.size(-1)}), w, bias, max_gemv_tokens).view(sizes);
  }
  if (x.size(0) > max_gemv_tokens || w.dim() != 2 || w.stride(1) != 1) return at::linear(x, w, bias);
  return gemv(x, w, bias);
}

Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& block_tables, const Tensor& context_lens, int64_t block_size,
                              double scale, const c10::optional<Tensor>& out_opt,
                              const c10::optional<Tensor>& lse_opt) {
  const bool bf16 = check_f32_or_bf16(q, "q");
  const bool kv_bf16 = check_cache_dtype(k_cache, q, "k_cache");
  check_same_dtype(v_cache, k_cache, "v_cache");
  check_index(block_tables, "block_tables");
  check_index(context_lens, "context_lens");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with a contiguous last dim, got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.stride(2) == 1, "k_cache must be [S, G, D], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.stride(2) == 1, "v_cache must match k_cache ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), S = k_cache.size(0), G = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, "k_cache head dim ", k_cache.size(2), " != q head dim ", D);
  TORCH_CHECK(G > 0 && H % G == 0, "query heads H = ", H, " must be a multiple of kv heads G = ", G);
  TORCH_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.stride(1) == 1,
              "block_tables must be [B = ", B, ", max_blocks] with a contiguous last dim, got ", block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B && context_lens.is_contiguous(),
              "context_lens must be contiguous [B = ", B, "], got ", context_lens.sizes());
  Tensor out = out_opt.has_value() ? *out_opt : new_like_dtype({B, H, D}, q);
  if (out_opt.has_value()) {
    check_same_dtype(out, q, "out");
    TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "out must be [B, H, D] like q, got ", out.sizes());
  }
  duet::PagedDecodeArgs a{q.data_ptr(), q.stride(0), q.stride(1),
                          k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                          v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1),
                          block_tables.data_ptr(), block_tables.scalar_type() == at::kLong,
                          block_tables.stride(0), block_tables.size(1),
                          context_lens.data_ptr(), context_lens.scalar_type() == at::kLong,
                          out.data_ptr(), out.stride(0), out.stride(1),
                          B, H, G, D, S, block_size, static_cast<float>(scale)};
  a.kv_bf16 = kv_bf16;
  if (lse_opt.has_value()) {  // [B, H] log-sum-exp, written in place
    check_f32(*lse_opt, "lse");
    TORCH_CHECK(lse_opt->dim() == 2 && lse_opt->size(0) == B && lse_opt->size(1) == H && lse_opt->stride(1) == 1,
                "lse must be [B, H] = [", B, ", ", H, "] with a contiguous last dim, got ", lse_opt->sizes());
    a.lse = lse_opt->data_ptr<float>();
    a.lse_sb = lse_opt->stride(0);
  }
  a.bf16 = bf16;
  const std::string err = duet::paged_decode_validate(a);
  TORCH_CHECK(err.empty(), "paged_decode_attention: ", err);
  {
    pybind11::gil_scoped_release no_gil;
    duet::paged_decode_attention(a, at::get_num_threads());
  }
  return out;
}

std::tuple<Tensor, c10::optional<Tensor>> varlen_paged_attention(
    const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
    const Tensor& cu_seqlens_q, const Tensor& context_lens, int64_t block_size, double scale,
    const c10::optional<Tensor>& tree_parents, const c10::optional<Tensor>& out_opt, bool return_lse) {
  const bool bf16 = check_f32_or_bf16(q, "q");
  const bool kv_bf16 = check_cache_dtype(k_cache, q, "k_cache");
  check_same_dtype(v_cache, k_cache, "v_cache");
  check_index(block_tables, "block_tables");
  check_index(cu_seqlens_q, "cu_seqlens_q");
  check_index(context_lens, "context_lens");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with a contiguous last dim, got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.stride(2) == 1, "k_cache must be [S, G, D], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.stride(2) == 1, "v_cache must match k_cache ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k_cache.size(0), G = k_cache.size(1);
  const int64_t B = context_lens.numel();
  TORCH_CHECK(k_cache.size(2) == D, "k_cache head dim ", k_cache.size(2), " != q head dim ", D);
  TORCH_CHECK(G > 0 && H % G == 0, "query heads H = ", H, " must be a multiple of kv heads G = ", G);
  TORCH_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.is_contiguous(), "context_lens must be contiguous [B], got ",
              context_lens.sizes());
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == B + 1 && cu_seqlens_q.is_contiguous(),
              "cu_seqlens_q must be contiguous [B + 1 = ", B + 1, "], got ", cu_seqlens_q.sizes());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.stride(1) == 1,
              "block_tables must be [B = ", B, ", max_blocks] with a contiguous last dim, got ", block_tables.sizes());
  if (tree_parents.has_value()) {
    check_index(*tree_parents, "tree_parents");
    TORCH_CHECK(tree_parents->dim() == 1 && tree_parents->size(0) == T && tree_parents->is_contiguous(),
                "tree_parents must be contiguous [T = ", T, "], got ", tree_parents->sizes());
  }
  Tensor out = out_opt.has_value() ? *out_opt : new_like_dtype({T, H, D}, q);
  if (out_opt.has_value()) {
    check_same_dtype(out, q, "out");
    TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "out must be [T, H, D] like q, got ", out.sizes());
  }
  c10::optional<Tensor> lse;
  if (return_lse) lse = new_f32({T, H});
  duet::VarlenAttnArgs a{q.data_ptr(), q.stride(0), q.stride(1),
                         k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                         v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1),
                         block_tables.data_ptr(), block_tables.scalar_type() == at::kLong,
                         block_tables.stride(0), block_tables.size(1),
                         cu_seqlens_q.data_ptr(), cu_seqlens_q.scalar_type() == at::kLong,
                         context_lens.data_ptr(), context_lens.scalar_type() == at::kLong,
                         tree_parents.has_value() ? tree_parents->data_ptr() : nullptr,
                         tree_parents.has_value() && tree_parents->scalar_type() == at::kLong,
                         out.data_ptr(), out.stride(0), out.stride(1),
                         lse.has_value() ? lse->data_ptr<float>() : nullptr, H,
                         B, T, H, G, D, S, block_size, static_cast<float>(scale)};
  a.bf16 = bf16;
  a.kv_bf16 = kv_bf16;
  const std::string err = duet::varlen_attention_validate(a);
  TORCH_CHECK(err.empty(), "varlen_paged_attention: ", err);
  {
    pybind11::gil_scoped_release no_gil;
    duet::varlen_paged_attention(a, at::get_num_threads());
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor> merge_attn_states(const std::vector<Tensor>& outs_in, const std::vector<Tensor>& lses_in) {
  const int64_t N = static_cast<int64_t>(outs_in.size());
  TORCH_CHECK(N >= 1, "merge_attn_states needs at least one partial");
  TORCH_CHECK(static_cast<int64_t>(lses_in.size()) == N, "got ", N, " outputs but ", lses_in.size(), " lses");
  check_f32(outs_in[0], "outs[0]");
  TORCH_CHECK(outs_in[0].dim() == 3, "outs[0] must be [T, H, D], got ", outs_in[0].sizes());
  const int64_t T = outs_in[0].size(0), H = outs_in[0].size(1), D = outs_in[0].size(2);
  std::vector<Tensor> outs, lses;  // contiguous (views when they already are)
  std::vector<const float*> op, lp;
  for (int64_t p = 0; p < N; ++p) {
    const std::string po = "outs[" + std::to_string(p) + "]", pl = "lses[" + std::to_string(p) + "]";
    check_f32(outs_in[p], po.c_str());
    check_f32(lses_in[p], pl.c_str());
    TORCH_CHECK(outs_in[p].sizes() == outs_in[0].sizes(), po, " must be [T, H, D] = ", outs_in[0].sizes(), ", got ",
                outs_in[p].sizes());
    TORCH_CHECK(lses_in[p].dim() == 2 && lses_in[p].size(0) == T && lses_in[p].size(1) == H, pl,
                " must be [T, H] = [", T, ", ", H, "], got ", lses_in[p].sizes());
    outs.push_back(outs_in[p].contiguous());
    lses.push_back(lses_in[p].contiguous());
    op.push_back(outs.back().data_ptr<float>());
    lp.push_back(lses.back().data_ptr<float>());
  }
  Tensor out = new_f32({T, H, D}), lse = new_f32({T, H});
  duet::merge_attn_states_f32(op.data(), lp.data(), N, out.data_ptr<float>(), lse.data_ptr<float>(), T, H, D,
                              at::get_num_threads());
  return {out, lse};
}

void rotary_and_cache_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos, const Tensor& sin,
                            const Tensor& k_cache, const Tensor& v_cache, const Tensor& slot_mapping) {
  const bool bf16 = check_f32_or_bf16(q, "q");
  const bool kv_bf16 = check_cache_dtype(k_cache, q, "k_cache");
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    if (t == &v_cache) check_same_dtype(*t, k_cache, name);
    else if (t != &k_cache) check_same_dtype(*t, q, name);
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, name, " must be 3-D with a contiguous last dim, got ",
                t->sizes());
  }
  check_same_dtype(cos, q, "cos");
  check_same_dtype(sin, q, "sin");
  check_index(slot_mapping, "slot_mapping");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), G = k.size(1), S = k_cache.size(0);
  TORCH_CHECK(D % 2 == 0, "head dim must be even, got ", D);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && v.sizes() == k.sizes(), "k and v must be [T = ", T, ", G, D = ", D,
              "], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k_cache.size(1) == G && k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [S, G = ", G, ", D = ", D, "], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  for (auto [t, name] : {std::pair{&cos, "cos"}, {&sin, "sin"}})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D / 2 && t->stride(1) == 1, name,
                " must be [T = ", T, ", D/2 = ", D / 2, "] with a contiguous last dim, got ", t->sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous [T = ", T, "], got ", slot_mapping.sizes());
  duet::RotaryCacheArgs a{q.data_ptr(), q.stride(0), q.stride(1),
                          k.data_ptr(), k.stride(0), k.stride(1),
                          v.data_ptr(), v.stride(0), v.stride(1),
                          cos.data_ptr(), sin.data_ptr(), cos.stride(0), sin.stride(0),
                          k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                          v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1),
                          slot_mapping.data_ptr(), slot_mapping.scalar_type() == at::kLong,
                          T, H, G, D, S};
  a.bf16 = bf16;
  a.kv_bf16 = kv_bf16;
  const std::string err = duet::rotary_cache_validate(a);
  TORCH_CHECK(err.empty(), "rotary_and_cache_write: ", err);
  duet::rotary_and_cache_write(a, at::get_num_threads());
}

// ---- [quant] quantized linear, int8 activations-------------------------------------------------------------
void check_quant_x(const Tensor& x, int64_t K) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [T, K = ", K, "], got ", x.sizes());
}

// [..., K] -> [T, K] rows with a contiguous last dim (a view when possible); the output is viewed back.
Tensor quant_rows(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "x must be [..., K]");
  if (x.dim() == 2 && x.stride(1) == 1) return x;
  return x.reshape({-1, x.size(-1)}).contiguous();
}

Tensor quant_out(const Tensor& x, const Tensor& y) {
  if (x.dim() == 2) return y;
  auto sizes = x.sizes().vec();
  sizes.back() = y.size(1);
  return y.view(sizes);
}

void check_bias(const c10::optional<Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return;
  check_f32(*bias, "bias");
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->stride(0) == 1, "bias must be contiguous [", N,
              "], got ", bias->sizes());
}

Tensor q4_tiles(const Tensor& qweight, const Tensor& scales, const Tensor& mins) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 2 &&
                  qweight.is_contiguous() && qweight.size(1) % 32 == 0,
              "qweight must be contiguous uint8 [N, Kp / 2], got ", qweight.sizes());
  const int64_t N = qweight.size(0), Kp = 2 * qweight.size(1);
  for (auto [t, name] : {std::pair{&scales, "scales"}, {&mins, "mins"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kShort && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == Kp / 32 && t->is_contiguous(),
                name, " must be contiguous int16 (fp16 bits) [", N, ", ", Kp / 32, "], got ", t->sizes());
  Tensor out = at::empty({(N + 15) / 16, duet::q4_tile_bytes(Kp)}, at::kByte);
  duet::make_q4_tiles(qweight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
                      reinterpret_cast<const uint16_t*>(mins.data_ptr<int16_t>()), N, Kp, out.data_ptr<uint8_t>());
  return out;
}

Tensor q4_linear(const Tensor& x_in, const Tensor& qweight, const Tensor& scales, const Tensor& mins,
                 const c10::optional<Tensor>& bias, int64_t K, const c10::optional<Tensor>& tiles) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 2 &&
                  qweight.is_contiguous(), "qweight must be contiguous uint8 [N, Kp / 2], got ", qweight.sizes());
  const int64_t N = qweight.size(0), Kp = 2 * qweight.size(1), nb = Kp / 32;
  TORCH_CHECK(Kp % 64 == 0 && K <= Kp && K > Kp - 64, "qweight holds ", Kp, " columns; K = ", K,
              " needs ceil(K / 64) * 64");
  for (auto [t, name] : {std::pair{&scales, "scales"}, {&mins, "mins"}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kShort && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == nb && t->is_contiguous(),
                name, " must be contiguous int16 (fp16 bits) [", N, ", ", nb, "], got ", t->scalar_type(), " ",
                t->sizes());
  check_bias(bias, N);
  duet::check_quant_tiles(tiles, N, duet::q4_tile_bytes(Kp));
  const Tensor x = quant_rows(x_in);
  check_quant_x(x, K);
  Tensor y = new_f32({x.size(0), N});
  {
    pybind11::gil_scoped_release no_gil;
    duet::q4_linear_f32(x.data_ptr<float>(), x.stride(0), qweight.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
                        reinterpret_cast<const uint16_t*>(mins.data_ptr<int16_t>()),
                        bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N, x.size(0), N, K,
                        Kp, at::get_num_threads(), tiles.has_value() ? tiles->data_ptr<uint8_t>() : nullptr);
  }
  return quant_out(x_in, y);
}

std::tuple<Tensor, Tensor> quantize_activations(const Tensor& x_in, int64_t Kp) {
  const Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && Kp % 64 == 0 && x.size(1) <= Kp, "x must be [T, K <= Kp], Kp a multiple of 64");
  Tensor q = at::empty({x.size(0), Kp}, at::kChar), sx = new_f32({x.size(0), Kp / 32});
  duet::quantize_activations_q8(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), Kp, q.data_ptr<int8_t>(),
                                sx.data_ptr<float>());
  return {q, sx};
}

// int8 weights, int8 activations (quant_linear.cpp, like q4)
Tensor int8_tiles(const Tensor& qweight) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar && qweight.dim() == 2 &&
                  qweight.is_contiguous() && qweight.size(1) % 64 == 0,
              "qweight must be contiguous int8 [N, Kp], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t N = qweight.size(0), Kp = qweight.size(1);
  Tensor out = at::empty({(N + 15) / 16, duet::int8_tile_bytes(Kp)}, at::kByte);
  duet::make_int8_tiles(qweight.data_ptr<int8_t>(), N, Kp, out.data_ptr<uint8_t>());
  return out;
}

Tensor int8_linear(const Tensor& x_in, const Tensor& qweight, const Tensor& scales, const c10::optional<Tensor>& bias,
                   int64_t K, const c10::optional<Tensor>& tiles) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar && qweight.dim() == 2 &&
                  qweight.is_contiguous(), "qweight must be contiguous int8 [N, Kp], got ", qweight.scalar_type(), " ",
              qweight.sizes());
  const int64_t N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(Kp % 64 == 0 && K <= Kp && K > Kp - 64, "qweight has ", Kp, " columns; K = ", K,
              " needs ceil(K / 64) * 64");
  check_f32(scales, "scales");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous(), "scales must be contiguous [", N,
              "], got ", scales.sizes());
  check_bias(bias, N);
  duet::check_quant_tiles(tiles, N, duet::int8_tile_bytes(Kp));
  const Tensor x = quant_rows(x_in);
  check_quant_x(x, K);
  Tensor y = new_f32({x.size(0), N});
  {
    pybind11::gil_scoped_release no_gil;
    duet::int8_linear_f32(x.data_ptr<float>(), x.stride(0), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                          bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N, x.size(0), N,
                          K, Kp, at::get_num_threads(), tiles.has_value() ? tiles->data_ptr<uint8_t>() : nullptr);
  }
  return quant_out(x_in, y);
}
// ---- end [quant] ------------------------------------------------------------------------------------------

duet::Isa parse_isa(const std::string& name) {
  if (name == "avx512") return duet::Isa::kAvx512;
  if (name == "avx2") return duet::Isa::kAvx2;
  TORCH_CHECK(name == "scalar", "isa must be 'avx512', 'avx2' or 'scalar', got '", name, "'");
  return duet::Isa::kScalar;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Duet CPU kernels (fp32, some bf16); see kernels/*.py for the wrappers and references";
  m.def("rms_norm", &rms_norm, "(x, weight, eps, residual) -> (out, new_residual | None)");
  m.def("silu_and_mul", &silu_and_mul, "x [T, 2I] -> silu(x[:, :I]) * x[:, I:]");
  m.def("gemv", &gemv, "(x [T, K], w [N, K], bias [N] | None) -> [T, N]");
  m.def("linear", &linear, "(x [..., K], w [N, K], bias [N] | None, max_gemv_tokens) -> [..., N]");
  m.def("gemv_bf16_native", [] { return duet::gemv_bf16_native(); },
        "whether the bf16 GEMV uses the CPU's AVX512-BF16 dot products");
  m.def("paged_decode_attention", &paged_decode_attention,
        "(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out | None, lse | None) -> out [B, H, D]",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("out"),
        pybind11::arg("lse") = pybind11::none());
  m.def("varlen_paged_attention", &varlen_paged_attention,
        "(q [T, H, D], k_cache, v_cache, block_tables [B, nb], cu_seqlens_q [B + 1], context_lens [B], block_size, "
        "scale, tree_parents [T] | None, out | None, return_lse) -> (out [T, H, D], lse [T, H] | None)");
  m.def("merge_attn_states", &merge_attn_states,
        "(outs: list of [T, H, D], lses: list of [T, H]) -> (out [T, H, D], lse [T, H])");
  m.def("rotary_and_cache_write", &rotary_and_cache_write,
        "(q, k, v, cos, sin, k_cache, v_cache, slot_mapping): RoPE on q, k in place; k, v into the cache");
  m.def("lora_rows", &duet::lora_rows,
        "(y [T, N] (added to in place), x [T, K], a [[S, R, K]] per part, bt [[S, R, n]] per part, starts [P], "
        "scales [S] f32, idx [T] int64): y[t, start_p:] += scales[s] (x[t] A_p[s]^T) Bt_p[s], s = idx[t] >= 0");
  m.def("grouped_gemm", &duet::grouped_gemm,
        "(x [M, K] rows sorted by expert, w [E, N, K], offsets [E + 1], max_gemv_rows) -> y [M, N]");
  duet::bind_decoder_stack(m);
  // [quant]
  m.def("q4_linear", &q4_linear, pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("mins"), pybind11::arg("bias"), pybind11::arg("K"), pybind11::arg("tiles") = pybind11::none(),
        "(x [..., K], qweight uint8 [N, Kp/2], scales, mins int16 fp16-bits [N, Kp/32], bias [N] | None, K, "
        "tiles = q4_tiles(qweight, scales, mins) | None) -> [..., N]");
  m.def("q4_tiles", &q4_tiles,
        "(qweight uint8 [N, Kp/2], scales, mins int16 [N, Kp/32]) -> uint8 [ceil(N/16), tile bytes]: the weights in "
        "the AVX-512 VNNI path's tile order (q4_linear's `tiles`)");
  m.def("quantize_activations", &quantize_activations, "(x [T, K], Kp) -> (q int8 [T, Kp], sx [T, Kp/32])");
  m.def("quant_path", [] { return std::string(duet::quant_path_name()); });
  m.def("int8_linear", &int8_linear, pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("bias"), pybind11::arg("K"), pybind11::arg("tiles") = pybind11::none(),
        "(x [..., K] fp32, qweight int8 [N, Kp], scales [N], bias [N] | None, K, tiles = int8_tiles(qweight) | None) "
        "-> [..., N]: int8 x int8 per block of 32");
  m.def("int8_tiles", &int8_tiles,
        "(qweight int8 [N, Kp]) -> uint8 [ceil(N/16), 16 Kp]: the weights in the AVX-512 VNNI path's tile order "
        "(int8_linear's `tiles`)");
  m.def("best_isa", [] { return std::string(duet::isa_name(duet::best_isa())); });
  m.def("active_isa", [] { return std::string(duet::isa_name(duet::active_isa())); });
  m.def("set_isa", [](const std::string& name) { return std::string(duet::isa_name(duet::set_isa(parse_isa(name)))); },
        "Lower (or restore) the ISA the kernels use; clamped to what the CPU has. Returns the active ISA.");
  m.def("dot_extensions", [] { return duet::dot_extensions_enabled(); },
        "whether kernels may use AVX512-BF16 / AVX512-VNNI where the CPU has them (default true)");
  m.def("set_dot_extensions", [](bool on) { return duet::set_dot_extensions(on); },
        "Allow (true) or forbid (false) AVX512-BF16 / AVX512-VNNI: false runs the plain AVX-512 fallback that a "
        "CPU without them takes. Returns the new setting.");
  m.def("cpu_has", [](const std::string& feature) {
        TORCH_CHECK(feature == "avx512_bf16" || feature == "avx512_vnni", "feature must be avx512_bf16 or avx512_vnni");
        return feature == "avx512_bf16" ? duet::cpu_has_avx512bf16() : duet::cpu_has_vnni();
      }, "what the kernels' own CPU probe (__builtin_cpu_supports) reports for avx512_bf16 or avx512_vnni");
}
