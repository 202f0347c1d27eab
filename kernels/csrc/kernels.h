// Raw-pointer entry points of Duet's CPU kernels (fp32). bindings.cpp checks tensors and calls these.
//
// Conventions: a "row stride" is the distance in elements between consecutive rows; the last
// (feature) dimension is always contiguous. `max_threads` is the OpenMP team size the caller allows
// (torch's at::get_num_threads()); each kernel decides whether the work is worth more than one.
#pragma once

#include <cstdint>
#include <string>

namespace duet {

using bf16_t = uint16_t;  // bfloat16 bit patterns (torch's layout); see common.h for the rounding

// out[t] = r[t] * rsqrt(mean(r[t]^2) + eps) * weight, r = x (+ residual); res_out[t] = r[t].
// residual and res_out are both null or both set. out / res_out are contiguous [T, E].
void rms_norm_f32(const float* x, int64_t x_stride, const float* residual, int64_t res_stride,
                  const float* weight, float* out, float* res_out, int64_t T, int64_t E, float eps,
                  int max_threads);

// bf16 rows: the same, rounding where torch's bf16 ops round (rms_norm.cpp).
void rms_norm_bf16(const bf16_t* x, int64_t x_stride, const bf16_t* residual, int64_t res_stride, const bf16_t* weight,
                   bf16_t* out, bf16_t* res_out, int64_t T, int64_t E, float eps, int max_threads);

// out[t, i] = silu(x[t, i]) * x[t, I + i]; out is contiguous [T, I].
void silu_and_mul_f32(const float* x, int64_t x_stride, float* out, int64_t T, int64_t I, int max_threads);
void silu_and_mul_bf16(const bf16_t* x, int64_t x_stride, bf16_t* out, int64_t T, int64_t I, int max_threads);

// y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]) for any T (up to 8 rows of x per pass over W).
// bias may be null.
void gemv_f32(const float* x, int64_t x_stride, const float* w, int64_t w_stride, const float* bias,
              float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K, int max_threads);
// The same for bf16 x, w, bias and y (fp32 accumulation, y rounded once). gemv_bf16_native: whether
// it uses the CPU's AVX512-BF16 dot products (else fp32 FMAs on widened values, or scalar code).
void gemv_bf16(const bf16_t* x, int64_t x_stride, const bf16_t* w, int64_t w_stride, const bf16_t* bias, bf16_t* y,
               int64_t y_stride, int64_t T, int64_t N, int64_t K, int max_threads);
bool gemv_bf16_native();

// Attention and rotary arguments: q, k, v, caches and out are float32, or bf16_t where bf16 is set.
// kv_bf16: the caches are bf16_t while the rest is float32 (a bf16 KV cache under fp32 activations:
// half the bytes that decode attention reads per token); with bf16 set the caches are bf16 anyway.
struct PagedDecodeArgs {
  const void* q;  // [B, H, D], strides q_sb, q_sh
  int64_t q_sb, q_sh;
  const void* k_cache;  // [S, G, D], strides k_ss, k_sg
  int64_t k_ss, k_sg;
  const void* v_cache;  // [S, G, D], strides v_ss, v_sg
  int64_t v_ss, v_sg;
  const void* block_tables;  // [B, max_blocks] int32 or int64 (bt_is64), row stride bt_sb
  bool bt_is64;
  int64_t bt_sb, max_blocks;
  const void* context_lens;  // [B] int32 or int64 (cl_is64), contiguous
  bool cl_is64;
  void* out;  // [B, H, D], strides o_sb, o_sh
  int64_t o_sb, o_sh;
  int64_t B, H, G, D, S, block_size;
  float scale;
  float* lse = nullptr;  // [B, H] log-sum-exp of the scores (-inf for an empty context), row stride lse_sb; optional
  int64_t lse_sb = 0;
  bool bf16 = false;
  bool kv_bf16 = false;
};

// Empty string if every sequence's context fits its block table and every block it uses lies in
// the cache; otherwise a message naming the sequence and the bad value.
std::string paged_decode_validate(const PagedDecodeArgs& a);
void paged_decode_attention(const PagedDecodeArgs& a, int max_threads);

struct RotaryCacheArgs {
  void* q;  // [T, H, D] rotated in place, strides q_st, q_sh
  int64_t q_st, q_sh;
  void* k;  // [T, G, D] rotated in place, strides k_st, k_sh
  int64_t k_st, k_sh;
  const void* v;  // [T, G, D], strides v_st, v_sh
  int64_t v_st, v_sh;
  const void* cos;  // [T, D/2], row stride cos_st
  const void* sin;  // [T, D/2], row stride sin_st
  int64_t cos_st, sin_st;
  void* k_cache;  // [S, G, D], strides kc_ss, kc_sg
  int64_t kc_ss, kc_sg;
  void* v_cache;  // [S, G, D], strides vc_ss, vc_sg
  int64_t vc_ss, vc_sg;
  const void* slot_mapping;  // [T] int32 or int64; a negative slot means "do not write"
  bool slot_is64;
  int64_t T, H, G, D, S;
  bool bf16 = false;
  bool kv_bf16 = false;
};

// Several new tokens per sequence over the paged cache (varlen_attention.cpp has the math).
struct VarlenAttnArgs {
  const void* q;  // [T, H, D], strides q_st, q_sh
  int64_t q_st, q_sh;
  const void* k_cache;  // [S, G, D], strides k_ss, k_sg
  int64_t k_ss, k_sg;
  const void* v_cache;  // [S, G, D], strides v_ss, v_sg
  int64_t v_ss, v_sg;
  const void* block_tables;  // [B, max_blocks] int32 or int64, row stride bt_sb
  bool bt_is64;
  int64_t bt_sb, max_blocks;
  const void* cu_seqlens;  // [B + 1] int32 or int64: sequence b owns query rows [cu[b], cu[b + 1])
  bool cu_is64;
  const void* context_lens;  // [B] int32 or int64: cached tokens including the new ones
  bool cl_is64;
  const void* tree_parents;  // [T] int32 or int64 or null (causal): parent among the sequence's new tokens, -1 = none
  bool tp_is64;
  void* out;  // [T, H, D], strides o_st, o_sh
  int64_t o_st, o_sh;
  float* lse;  // [T, H] or null, row stride lse_st
  int64_t lse_st;
  int64_t B, T, H, G, D, S, block_size;
  float scale;
  bool bf16 = false;
  bool kv_bf16 = false;
};

std::string varlen_attention_validate(const VarlenAttnArgs& a);
void varlen_paged_attention(const VarlenAttnArgs& a, int max_threads);

// out[t, h] = sum_p w_p o_p[t, h] / sum_p w_p, w_p = exp(lse_p[t, h] - max_p lse_p[t, h]);
// lse_out[t, h] = log sum_p exp(lse_p[t, h]). Partials with lse = -inf count for nothing; if all are
// -inf the row is zeros with lse -inf. outs[p] are contiguous [T, H, D], lses[p] contiguous [T, H].
void merge_attn_states_f32(const float* const* outs, const float* const* lses, int64_t N, float* out, float* lse_out,
                           int64_t T, int64_t H, int64_t D, int max_threads);

std::string rotary_cache_validate(const RotaryCacheArgs& a);
void rotary_and_cache_write(const RotaryCacheArgs& a, int max_threads);

// ---- [quant] quantized linear layers with int8 activations (kernels/csrc/quant_linear.cpp) ----
// x is fp32 [T, K] (row stride x_stride), quantized per token and block of 32 to int8 on the fly
// (sx = max|x| / 127, round half to even); weights are padded to Kp (a multiple of 64) columns. A
// row's result does not depend on T or on the other rows of x (one fixed float sequence per element).
// q4: w [N, Kp / 2] packed nibbles, d and m [N, Kp / 32] fp16 bit patterns: w = d * q + m per block of 32.
// tiles: the same weights in tile order (make_q4_tiles) or null; the AVX-512 VNNI path then streams
// them as they are instead of repacking w, d and m per call (bit-identical results).
void q4_linear_f32(const float* x, int64_t x_stride, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                   const float* bias, float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K, int64_t Kp,
                   int max_threads, const uint8_t* tiles = nullptr);
// The q4 weights in the VNNI path's tile order: per 16 rows (the last tile zero-padded), 8 * Kp bytes
// of codes (per chunk of 64 and 4-code group j: 64 bytes = row i's bytes 4j..4j+3 of the chunk, i.e.
// codes 4j.. in the low nibbles and 32 + 4j.. in the high ones), then per block d and m as fp16
// [2][16]. q4_tile_bytes(Kp) bytes per tile, 64-byte aligned when `out` is.
int64_t q4_tile_bytes(int64_t Kp);
void make_q4_tiles(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t N, int64_t Kp, uint8_t* out);
// int8: w int8 [N, Kp] (zero past K), w = scale[n] * q. tiles: as for q4 (make_int8_tiles) or null.
void int8_linear_f32(const float* x, int64_t x_stride, const int8_t* w, const float* scale, const float* bias,
                     float* y, int64_t y_stride, int64_t T, int64_t N, int64_t K, int64_t Kp, int max_threads,
                     const uint8_t* tiles = nullptr);
// The int8 weights in the VNNI path's tile order: per 16 rows (the last tile padded), 16 * Kp bytes:
// per group s of 4 codes, 64 bytes = codes 4s..4s+3 of each row, biased to q + 128.
int64_t int8_tile_bytes(int64_t Kp);
void make_int8_tiles(const int8_t* w, int64_t N, int64_t Kp, uint8_t* out);
// The activation quantization alone (tests compare it with the torch reference): q_out [T, Kp], sx_out [T, Kp / 32].
void quantize_activations_q8(const float* x, int64_t x_stride, int64_t T, int64_t K, int64_t Kp, int8_t* q_out,
                             float* sx_out);
// "avx512_vnni", "avx2" or "scalar": the path the quantized kernels take under the active ISA.
const char* quant_path_name();
// ---- end [quant] ----

}  // namespace duet
