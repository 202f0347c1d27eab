// Fused decoder stack for decode steps: every Llama-family layer of one step in one C++ call.
//
// A batch-1 decode step of a small model is ~120 short kernel calls. Driven from Python, each
// costs a module call, a wrapper, a pybind crossing and a tensor allocation, which together are a
// large share of the step once the weights are 4-bit (benchmarks/README.md). This file runs the same kernels, with the same arguments, in the same
// order, from one loop, so its output is bit-identical to the layer-by-layer path
// (tests/kernels/test_decoder_stack_kernel.py checks that for fp32, int8 and q4 weights).
//
// Per layer (x: normed input, r: residual stream, h: the layer's output delta):
//   x, r = rms_norm(h, r)                  (layer 0: x = rms_norm(h), r = h)
//   qkv = linear_qkv(x)                    [T, (H + 2G) D]
//   rotary_and_cache_write(q, k, v)        q, k rotated in place, k, v into the layer's cache
//   a = paged_decode_attention(q, cache)   [T, H, D]
//   x, r = rms_norm(linear_o(a), r)
//   h = linear_down(silu_and_mul(linear_gate_up(x)))
// and at the end rms_norm(h, r) with the final norm. Each linear is fp32 or bf16 (the GEMV kernel up
// to max_gemv_tokens rows, else at::linear, exactly like the `linear` binding), int8 or q4 (int8
// activations, quant_linear.cpp). The activations (h, r, q/k/v, the caches) are float32, or bf16 in
// a bf16 model (bf16 linears only): the same kernels as the layer path in the same dtype. Under
// float32 activations the caches may be bf16 (cache.dtype): k / v rounded as they are written.
//
// Scope: decode-only steps (one new token per sequence), one tensor-parallel rank, dense MLP. The
// caller (workers/models/llama.py) falls back to the module path for anything else.
//
// Axes: T tokens (= sequences), E hidden, H query heads, G kv heads, D head dim, I MLP width,
// S cache slots.
#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace duet {
// tiles (if any) are the int8_tiles / q4_tiles of an [N, *] weight: `bytes` per 16 rows. Also the
// int8_linear and q4_linear bindings' check (bindings.cpp).
void check_quant_tiles(const c10::optional<at::Tensor>& tiles, int64_t N, int64_t bytes) {
  if (!tiles.has_value()) return;
  const int64_t n_tiles = (N + 15) / 16;
  TORCH_CHECK(tiles->device().is_cpu() && tiles->scalar_type() == at::kByte && tiles->dim() == 2 &&
                  tiles->size(0) == n_tiles && tiles->size(1) == bytes && tiles->is_contiguous() &&
                  reinterpret_cast<uintptr_t>(tiles->data_ptr()) % 64 == 0,
              "tiles must be contiguous, 64-byte aligned uint8 [", n_tiles, ", ", bytes, "] (the tiles of this weight), got ",
              tiles->scalar_type(), " ", tiles->sizes());
}
}  // namespace duet

namespace {

using at::Tensor;

enum LinearKind : int { kFp32 = 0, kInt8 = 1, kQ4 = 2, kBf16 = 3 };

Tensor new_f32(at::IntArrayRef sizes) { return at::detail::empty_cpu(sizes, at::kFloat); }
Tensor new_of(at::IntArrayRef sizes, at::ScalarType dt) { return at::detail::empty_cpu(sizes, dt); }
const char* dtype_name(at::ScalarType dt) { return dt == at::kBFloat16 ? "bfloat16" : "float32"; }
duet::bf16_t* bf16_ptr(const Tensor& t) { return reinterpret_cast<duet::bf16_t*>(t.data_ptr<at::BFloat16>()); }

void check_vec(const Tensor& t, int64_t n, const char* what, at::ScalarType dt = at::kFloat) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dt && t.dim() == 1 && t.size(0) == n && t.is_contiguous(),
              what, " must be contiguous ", dt, " [", n, "], got ", t.scalar_type(), " ", t.sizes());
}
void check_f32_vec(const Tensor& t, int64_t n, const char* what) { check_vec(t, n, what); }

// One projection's weights: fp32 / bf16 w [N, K]; int8 w [N, Kp] + s [N]; q4 w [N, Kp / 2] + s, m [N, Kp / 32].
// int8 and q4 may also carry their tiles (the `int8_tiles` / `q4_tiles` bindings: the same weights in
// the VNNI path's order).
struct StackLinear {
  int kind;
  Tensor w, s, m;
  c10::optional<Tensor> bias, tiles;
  int64_t N, K, Kp;

  StackLinear(int kind_, Tensor w_, c10::optional<Tensor> s_, c10::optional<Tensor> m_, c10::optional<Tensor> bias_,
              int64_t K_, c10::optional<Tensor> tiles_)
      : kind(kind_), w(std::move(w_)), bias(std::move(bias_)), tiles(std::move(tiles_)), N(w.size(0)), K(K_), Kp(K_) {
    TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous 2-D CPU tensor");
    if (bias.has_value()) check_vec(*bias, N, "bias", kind == kBf16 ? at::kBFloat16 : at::kFloat);
    if (kind == kFp32) {
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(1) == K, "fp32 weight must be [N, K = ", K, "]");
    } else if (kind == kBf16) {
      TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) == K, "bf16 weight must be bfloat16 [N, K = ", K, "]");
    } else if (kind == kInt8) {
      TORCH_CHECK(w.scalar_type() == at::kChar && s_.has_value(), "int8 weight needs int8 codes and scales");
      Kp = w.size(1);
      s = *s_;
      check_f32_vec(s, N, "int8 scales");
    } else {
      TORCH_CHECK(kind == kQ4 && w.scalar_type() == at::kByte && s_.has_value() && m_.has_value(),
                  "linear kind must be 0 (fp32), 1 (int8), 2 (q4 with scales and mins) or 3 (bf16)");
      Kp = 2 * w.size(1);
      s = *s_;
      m = *m_;
      for (const Tensor* t : {&s, &m})
        TORCH_CHECK(t->scalar_type() == at::kShort && t->is_contiguous() && t->size(0) == N && t->size(1) == Kp / 32,
                    "q4 scales / mins must be contiguous int16 [", N, ", ", Kp / 32, "]");
    }
    TORCH_CHECK(!tiles.has_value() || kind == kQ4 || kind == kInt8, "only an int8 or q4 linear takes tiles");
    duet::check_quant_tiles(tiles, N, kind == kQ4 ? duet::q4_tile_bytes(Kp) : duet::int8_tile_bytes(Kp));
    TORCH_CHECK(kind == kFp32 || kind == kBf16 || (Kp % 64 == 0 && K <= Kp && K > Kp - 64), "quantized weight holds ", Kp,
                " columns; K = ", K, " needs ceil(K / 64) * 64");
  }

  // y = x w^T (+ bias); x [T, K] contiguous. The same kernel and arguments as the `linear`,
  // `int8_linear` and `q4_linear` bindings.
  Tensor operator()(const Tensor& x, int64_t max_gemv_tokens, int nt) const {
    const int64_t T = x.size(0);
    if ((kind == kFp32 || kind == kBf16) && T > max_gemv_tokens) return at::linear(x, w, bias);
    if (kind == kBf16) {
      Tensor y = new_of({T, N}, at::kBFloat16);
      duet::gemv_bf16(bf16_ptr(x), x.stride(0), bf16_ptr(w), w.stride(0), bias.has_value() ? bf16_ptr(*bias) : nullptr,
                      bf16_ptr(y), N, T, N, K, nt);
      return y;
    }
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    Tensor y = new_f32({T, N});
    if (kind == kFp32) {
      duet::gemv_f32(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.stride(0), b, y.data_ptr<float>(), N, T,
                     N, K, nt);
    } else if (kind == kInt8) {
      duet::int8_linear_f32(x.data_ptr<float>(), x.stride(0), w.data_ptr<int8_t>(), s.data_ptr<float>(), b,
                            y.data_ptr<float>(), N, T, N, K, Kp, nt, tiles.has_value() ? tiles->data_ptr<uint8_t>() : nullptr);
    } else {
      duet::q4_linear_f32(x.data_ptr<float>(), x.stride(0), w.data_ptr<uint8_t>(),
                          reinterpret_cast<const uint16_t*>(s.data_ptr<int16_t>()),
                          reinterpret_cast<const uint16_t*>(m.data_ptr<int16_t>()), b, y.data_ptr<float>(), N, T, N, K,
                          Kp, nt, tiles.has_value() ? tiles->data_ptr<uint8_t>() : nullptr);
    }
    return y;
  }
};

struct StackLayer {
  Tensor in_norm, post_norm;
  StackLinear qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(std::vector<StackLayer> layers, Tensor final_norm, double eps, int64_t H, int64_t G, int64_t D,
               double scale, int64_t max_gemv_tokens)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(static_cast<float>(eps)), H_(H), G_(G),
        D_(D), scale_(static_cast<float>(scale)), max_gemv_tokens_(max_gemv_tokens) {
    TORCH_CHECK(!layers_.empty(), "a decoder stack needs at least one layer");
    TORCH_CHECK(H > 0 && G > 0 && H % G == 0 && D % 2 == 0, "heads H = ", H, ", G = ", G, ", D = ", D, " are invalid");
    E_ = final_norm_.size(0);
    dt_ = final_norm_.scalar_type();  // the activations' dtype: the norms' (float32, or bf16 with bf16 linears)
    TORCH_CHECK(dt_ == at::kFloat || dt_ == at::kBFloat16, "norm weights must be float32 or bfloat16, got ", dt_);
    check_vec(final_norm_, E_, "final norm weight", dt_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      const std::string at = "layer " + std::to_string(i) + ": ";
      check_vec(l.in_norm, E_, (at + "input norm").c_str(), dt_);
      check_vec(l.post_norm, E_, (at + "post-attention norm").c_str(), dt_);
      for (const StackLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down})
        TORCH_CHECK((dt_ == at::kBFloat16) == (lin->kind == kBf16), at,
                    "a bf16 stack takes bf16 linears only, a float32 stack fp32, int8 or q4 ones");
      TORCH_CHECK(l.qkv.K == E_ && l.qkv.N == (H + 2 * G) * D, at, "qkv must be [(H + 2G) D, E]");
      TORCH_CHECK(l.o.K == H * D && l.o.N == E_, at, "o_proj must be [E, H D]");
      TORCH_CHECK(l.gate_up.K == E_ && l.gate_up.N % 2 == 0, at, "gate_up must be [2I, E]");
      TORCH_CHECK(l.down.K == l.gate_up.N / 2 && l.down.N == E_, at, "down must be [E, I]");
    }
  }

  // h [T, E] (the embeddings), cos / sin [T, D / 2], kv: one (k_cache, v_cache) [S, G, D] per layer,
  // slot_mapping [T], block_tables [T, max_blocks], context_lens [T] -> final hidden states [T, E].
  Tensor forward(const Tensor& h_in, const Tensor& cos, const Tensor& sin, const std::vector<std::tuple<Tensor, Tensor>>& kv,
                 const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& context_lens,
                 int64_t block_size) const {
    TORCH_CHECK(kv.size() == layers_.size(), "got ", kv.size(), " kv caches for ", layers_.size(), " layers");
    TORCH_CHECK(h_in.device().is_cpu() && h_in.scalar_type() == dt_ && h_in.dim() == 2 && h_in.size(1) == E_,
                "h must be ", dtype_name(dt_), " [T, E = ", E_, "], got ", h_in.scalar_type(), " ", h_in.sizes());
    const Tensor h0 = h_in.contiguous();
    const int64_t T = h0.size(0), QKV = (H_ + 2 * G_) * D_;
    const Tensor& kc0 = std::get<0>(kv[0]);
    // the caches' dtype: the activations', or bf16 under fp32 activations (a bf16 KV cache)
    const auto cdt = kc0.scalar_type();
    TORCH_CHECK(cdt == dt_ || (dt_ == at::kFloat && cdt == at::kBFloat16), "the kv caches must be ", dtype_name(dt_),
                dt_ == at::kFloat ? " or bfloat16" : "", ", got ", cdt);
    for (size_t i = 0; i < kv.size(); ++i) {
      const Tensor &k = std::get<0>(kv[i]), &v = std::get<1>(kv[i]);
      TORCH_CHECK(k.scalar_type() == cdt && v.scalar_type() == cdt && k.sizes() == kc0.sizes() &&
                      v.sizes() == kc0.sizes() && k.strides() == kc0.strides() && v.strides() == kc0.strides() &&
                      k.dim() == 3 && k.size(1) == G_ && k.size(2) == D_ && k.stride(2) == 1,
                  "layer ", i, ": k / v caches must all be ", dtype_name(cdt), " [S, G = ", G_, ", D = ", D_, "] alike");
    }
    for (const Tensor* t : {&slot_mapping, &context_lens, &block_tables})
      TORCH_CHECK(t->device().is_cpu() && (t->scalar_type() == at::kInt || t->scalar_type() == at::kLong),
                  "slot_mapping, block_tables and context_lens must be int32 or int64 CPU tensors");
    TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.is_contiguous() &&
                    context_lens.dim() == 1 && context_lens.size(0) == T && context_lens.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == T && block_tables.stride(1) == 1,
                "slot_mapping / context_lens must be contiguous [T = ", T, "] and block_tables [T, max_blocks]");
    for (const Tensor* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == dt_ && t->dim() == 2 && t->size(0) == T && t->size(1) == D_ / 2 &&
                      t->stride(1) == 1, "cos / sin must be ", dtype_name(dt_), " [T, D / 2]");
    const int nt = at::get_num_threads();
    const bool bf16 = dt_ == at::kBFloat16, kv_bf16 = !bf16 && cdt == at::kBFloat16;
    const int64_t es = bf16 ? 2 : 4;  // bytes per activation element
    Tensor attn = new_of({T, H_, D_}, dt_);
    Tensor h = h0, r, x;
    pybind11::gil_scoped_release no_gil;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      std::tie(x, r) = norm(h, i == 0 ? c10::optional<Tensor>() : c10::optional<Tensor>(r), l.in_norm, nt);
      if (i == 0) r = h;
      Tensor qkv = l.qkv(x, max_gemv_tokens_, nt);  // [T, (H + 2G) D]
      char* q = static_cast<char*>(qkv.data_ptr());
      const Tensor &kc = std::get<0>(kv[i]), &vc = std::get<1>(kv[i]);
      duet::RotaryCacheArgs ra{q, QKV, D_, q + H_ * D_ * es, QKV, D_, q + (H_ + G_) * D_ * es, QKV, D_,
                               cos.data_ptr(), sin.data_ptr(), cos.stride(0), sin.stride(0),
                               kc.data_ptr(), kc.stride(0), kc.stride(1),
                               vc.data_ptr(), vc.stride(0), vc.stride(1),
                               slot_mapping.data_ptr(), slot_mapping.scalar_type() == at::kLong,
                               T, H_, G_, D_, kc.size(0), bf16};
      ra.kv_bf16 = kv_bf16;
      duet::PagedDecodeArgs pa{q, QKV, D_, kc.data_ptr(), kc.stride(0), kc.stride(1),
                               vc.data_ptr(), vc.stride(0), vc.stride(1),
                               block_tables.data_ptr(), block_tables.scalar_type() == at::kLong,
                               block_tables.stride(0), block_tables.size(1),
                               context_lens.data_ptr(), context_lens.scalar_type() == at::kLong,
                               attn.data_ptr(), H_ * D_, D_, T, H_, G_, D_, kc.size(0), block_size, scale_};
      pa.bf16 = bf16;
      pa.kv_bf16 = kv_bf16;
      if (i == 0) {  // every layer shares the slots, tables and cache shape checked here
        std::string err = duet::rotary_cache_validate(ra);
        TORCH_CHECK(err.empty(), "rotary_and_cache_write: ", err);
        err = duet::paged_decode_validate(pa);
        TORCH_CHECK(err.empty(), "paged_decode_attention: ", err);
      }
      duet::rotary_and_cache_write(ra, nt);
      duet::paged_decode_attention(pa, nt);
      Tensor o = l.o(attn.view({T, H_ * D_}), max_gemv_tokens_, nt);  // [T, E]
      std::tie(x, r) = norm(o, r, l.post_norm, nt);
      Tensor gu = l.gate_up(x, max_gemv_tokens_, nt);  // [T, 2I]
      const int64_t I = gu.size(1) / 2;
      Tensor act = new_of({T, I}, dt_);
      if (bf16) {
        duet::silu_and_mul_bf16(bf16_ptr(gu), gu.stride(0), bf16_ptr(act), T, I, nt);
      } else {
        duet::silu_and_mul_f32(gu.data_ptr<float>(), gu.stride(0), act.data_ptr<float>(), T, I, nt);
      }
      h = l.down(act, max_gemv_tokens_, nt);  // [T, E]
    }
    return std::get<0>(norm(h, r, final_norm_, nt));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // rms_norm binding semantics: (normed, x + residual) with fresh outputs.
  std::tuple<Tensor, Tensor> norm(const Tensor& x, const c10::optional<Tensor>& residual, const Tensor& w, int nt) const {
    const int64_t T = x.size(0);
    Tensor out = new_of({T, E_}, dt_);
    Tensor res_out = residual.has_value() ? new_of({T, E_}, dt_) : Tensor();
    if (dt_ == at::kBFloat16) {
      duet::rms_norm_bf16(bf16_ptr(x), x.stride(0), residual ? bf16_ptr(*residual) : nullptr,
                          residual ? residual->stride(0) : 0, bf16_ptr(w), bf16_ptr(out),
                          residual ? bf16_ptr(res_out) : nullptr, T, E_, eps_, nt);
    } else {
      duet::rms_norm_f32(x.data_ptr<float>(), x.stride(0), residual ? residual->data_ptr<float>() : nullptr,
                         residual ? residual->stride(0) : 0, w.data_ptr<float>(), out.data_ptr<float>(),
                         residual ? res_out.data_ptr<float>() : nullptr, T, E_, eps_, nt);
    }
    return {out, res_out};
  }

  std::vector<StackLayer> layers_;
  Tensor final_norm_;
  float eps_;
  at::ScalarType dt_;
  int64_t E_, H_, G_, D_;
  float scale_;
  int64_t max_gemv_tokens_;
};

}  // namespace

namespace duet {

void bind_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init<int, Tensor, c10::optional<Tensor>, c10::optional<Tensor>, c10::optional<Tensor>, int64_t,
                    c10::optional<Tensor>>(),
           py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("K"),
           py::arg("tiles") = py::none(),
           "kind 0 fp32 (weight [N, K]), 1 int8 (codes [N, Kp], scales [N]), 2 q4 (codes [N, Kp/2], scales and "
           "mins [N, Kp/32]), 3 bf16 (weight [N, K]); tiles: an int8 / q4 weight's int8_tiles / q4_tiles, or None");
  py::class_<StackLayer>(m, "StackLayer")
      .def(py::init<Tensor, Tensor, StackLinear, StackLinear, StackLinear, StackLinear>(), py::arg("in_norm"),
           py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"));
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<StackLayer>, Tensor, double, int64_t, int64_t, int64_t, double, int64_t>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("max_gemv_tokens"))
      .def("forward", &DecoderStack::forward,
           "(h [T, E], cos, sin [T, D/2], kv: list of (k_cache, v_cache), slot_mapping [T], block_tables [T, nb], "
           "context_lens [T], block_size) -> final hidden [T, E]")
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
}

}  // namespace duet
