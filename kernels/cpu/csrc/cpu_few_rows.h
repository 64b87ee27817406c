// Shared pieces of the few-row CPU kernels (cpu_few_rows.cpp, cpu_mla_decode.cpp,
// cpu_decode_block.cpp): the entry points each calls in another, 8-wide vectors, the register-tiled
// dot products every kernel is built on, and small helpers.
//
// Each output element of rows() is one dot product accumulated in a fixed order that does not
// depend on how many rows are computed with it, so a row gives the same bits alone or in a batch.
//
// Activations and sums are float32. Weights (and the MLA latent cache) are float32 or bfloat16:
// a bf16 value is the top half of the float32 with the same bits, so load8 widens 8 of them exactly
// by a 16-bit shift in registers and the float32 FMAs then run unchanged, in the same order. A bf16
// model streams half the bytes through the same loops (decode reads its weights: that is its cost).

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kda_decode.h"  // KdaDecode
#include "cpu_packed_experts.h"  // PackedExperts
#include "cpu_parallel.h"  // parallel_runs

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gated_act.h"

#if defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif


// The extension's entry points, defined across its translation units and called from each other.
// cpu_few_rows.cpp
torch::Tensor linear(torch::Tensor x, torch::Tensor w);
// Whether linear() multiplies `rows` rows by w through oneDNN (bf16 w, 6 rows or more, oneDNN's native
// bf16 product): on torch's OpenMP threads, not the kernels' team.
bool runs_onednn(const torch::Tensor& w, int64_t rows);
// x [M, K] @ w [N, K].T for bf16 w on AMX tiles (cpu_moe_amx.cpp), in x's dtype; where moe_amx_usable()
torch::Tensor linear_amx_bf16(torch::Tensor x, torch::Tensor w);
// cpu_onednn_packed.cpp: x [M, K] bf16 contiguous @ w [N, K] bf16 .T through oneDNN, w packed once
torch::Tensor onednn_linear_bf16(const torch::Tensor& x, const torch::Tensor& w);
int64_t onednn_packed_count();
// Whether oneDNN computes bf16 products natively on this CPU; without it (AVX2 only) at::linear in
// bf16 runs a slow fallback, so bf16 weights are widened to float32 instead (cpu_onednn_packed.cpp).
bool onednn_bf16_native();
// act: 0 SiLU, 1 SiTU with beta / linear_beta (<= 0: up unbounded), see gated_mul
torch::Tensor moe(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13, torch::Tensor w2,
                  torch::Tensor scratch, int64_t act = 0, double beta = 1.0, double linear_beta = 0.0);
std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor x, torch::Tensor w, torch::Tensor bias,
                                                   int64_t top_k, int64_t n_group, int64_t topk_group,
                                                   bool sigmoid, bool norm, double scaling);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
int64_t threads();
// cpu_moe_amx.cpp: the pair counts [lo, hi] at which moe() runs a bf16 expert on AMX tiles; returns
// the previous ones
std::tuple<int64_t, int64_t> moe_amx_rows(int64_t lo, int64_t hi);
// cpu_mla_decode.cpp
torch::Tensor mla_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                         torch::Tensor context_lens, int64_t block_size, int64_t r, double scale);
torch::Tensor mla_decode_absorbed(torch::Tensor q, torch::Tensor kv, torch::Tensor kv_norm_weight, double eps,
                                  torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, torch::Tensor slots,
                                  torch::Tensor w_uk, torch::Tensor w_uv, torch::Tensor cache,
                                  torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                  double scale);
// cpu_decode_block.cpp
torch::Tensor attention_block(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor cache,
                              torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                              torch::Tensor norm, double eps, torch::Tensor in_proj, int64_t q_width,
                              torch::Tensor q_norm, double q_eps, torch::Tensor q_b, int64_t heads,
                              torch::Tensor kv_norm, double kv_eps, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor w_uk, torch::Tensor w_uv, double scale, torch::Tensor o_proj,
                              torch::Tensor gate, bool residual);
torch::Tensor kda_block(torch::Tensor x, torch::Tensor slots, torch::Tensor conv_state, torch::Tensor rec_state,
                        torch::Tensor in_proj, int64_t heads, int64_t head_dim, torch::Tensor f_b, torch::Tensor g_b,
                        torch::Tensor conv_weight, torch::Tensor A_log, torch::Tensor dt_bias, double lower_bound,
                        torch::Tensor norm_weight, double eps, double scale, torch::Tensor o_proj);
torch::Tensor ffn_block(torch::Tensor x, torch::Tensor counts, torch::Tensor norm, double eps, torch::Tensor gate_up,
                        torch::Tensor down, torch::Tensor router_w, torch::Tensor bias, int64_t top_k,
                        int64_t n_group, int64_t topk_group, bool sigmoid, bool norm_topk, double scaling,
                        torch::Tensor w13, torch::Tensor w2, torch::Tensor scratch);
torch::Tensor packed_ffn_block(torch::Tensor x, torch::Tensor counts, torch::Tensor norm, double eps,
                               torch::Tensor gate_up, torch::Tensor down, torch::Tensor router_w, torch::Tensor bias,
                               int64_t top_k, int64_t n_group, int64_t topk_group, bool sigmoid, bool norm_topk,
                               double scaling, bool w4a8, torch::Tensor w13, torch::Tensor w2, int64_t inter,
                               bool mxfp4, int64_t path, int64_t act, double beta, double linear_beta);
torch::Tensor latent_moe_block(torch::Tensor x, torch::Tensor counts, torch::Tensor router_w, torch::Tensor bias,
                               int64_t top_k, int64_t n_group, int64_t topk_group, bool sigmoid, bool norm_topk,
                               double scaling, torch::Tensor down, torch::Tensor norm, double eps, torch::Tensor up,
                               torch::Tensor gate_up, torch::Tensor shared_down, bool w4a8, torch::Tensor w13,
                               torch::Tensor w2, int64_t inter, bool mxfp4, int64_t path, int64_t act, double beta,
                               double linear_beta);

namespace kimitui_cpu {

void use_packed_experts(PackedExperts floats, PackedExperts w4a8);  // cpu_decode_block.cpp
void use_kda_decode(KdaDecode kda_decode);  // cpu_decode_block.cpp

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t bf16;  // a bfloat16's bits (at::BFloat16's storage)

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 8 bfloat16 widened to float32: zero-extend each to 32 bits and shift it into the high half (exact).
// With AVX2 one vpmovzxwd to 256 bits and a shift (GCC 12 lowers the generic conversion below as
// two 128-bit halves); without it, the generic vector code for whatever the target has.
inline v8 load8(const bf16* p) {
#if defined(__AVX2__)
  const __m256i i = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return _mm256_castsi256_ps(i);  // __m256 and v8: the same 8 floats
#else
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8i i = __builtin_convertvector(h, v8i) << 16;
  v8 v;
  std::memcpy(&v, &i, sizeof v);
  return v;
#endif
}

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// float32 to bfloat16, rounding to nearest even as c10::BFloat16 (and Tensor.to) does; NaN stays NaN.
inline bf16 to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((b >> 16) | 0x40);
  return static_cast<bf16>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = to_bf16(v); }

inline v8 splat(float s) { return v8{s, s, s, s, s, s, s, s}; }

// a * b + c, fused where the CPU can. Sums must round the same in every tile shape (a row gives the
// same bits alone or in a batch), so the extension is built with -ffp-contract=off: left to itself
// the compiler fused some instantiations of a loop and not others. The products that should fuse
// say so here.
inline v8 fmadd(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// e^x for 8 floats: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n
// through the exponent bits), within 2 ulp of std::exp over [-87, 88]; clamped outside it.
inline v8 exp8(v8 x) {
  const v8 hi = v8{} + 88.3762626647949f, lo = v8{} - 87.3365447504f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v8 n = x * 1.44269504088896341f + 0.5f;
  const v8 t = __builtin_convertvector(__builtin_convertvector(n, v8i), v8);  // toward zero
  n = t > n ? t - 1.0f : t;                                                   // floor
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  v8 y = v8{} + 1.9875691500e-4f;
  y = fmadd(y, x, splat(1.3981999507e-3f));
  y = fmadd(y, x, splat(8.3334519073e-3f));
  y = fmadd(y, x, splat(4.1665795894e-2f));
  y = fmadd(y, x, splat(1.6666665459e-1f));
  y = fmadd(y, x, splat(5.0000001201e-1f));
  y = fmadd(y * x, x, x) + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// out[j] = silu(g[j]) * u[j] for j < n (SwiGLU's activation).
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 gv = load8(g + j);
    const v8 y = gv / (1.0f + exp8(-gv)) * load8(u + j);
    std::memcpy(out + j, &y, sizeof y);
  }
  for (; j < n; ++j) out[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}

// out[j] = act(g[j], u[j]) for j < n, as kernels/activation.py: SiLU (act 0, silu_mul) or Kimi K3's
// SiTU (act 1): beta * tanh(g / beta) * sigmoid(g) times linear_beta * tanh(u / linear_beta), or times
// u when linear_beta <= 0 (None), in float32. SiTU runs as a plain loop: K3's experts are packed
// (kernels/cpu_quant_moe), so this float32 path serves unquantised checkpoints and tests.
inline void gated_mul(const float* g, const float* u, float* out, int64_t n, int64_t act, float beta,
                      float linear_beta) {
  if (act == 0) return silu_mul(g, u, out, n);
  for (int64_t j = 0; j < n; ++j) out[j] = situ_mul(g[j], u[j], beta, linear_beta);
}

// Prefetch into L2 the element at p + offset. The address is formed in integer arithmetic: the
// callers reach past the end of their array (the rows after the last), where pointer arithmetic
// would be undefined behaviour; a prefetch itself never faults.
template <typename W>
inline void prefetch_l2(const W* p, int64_t offset) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + offset * sizeof(W)), 0, 1);
}

inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// ys[t][n0 + r] = dot(xs[t], w[n0 + r]) for r < R, t < T; each row K long; W float or bf16.
template <int R, int T, bool Prefetch = true, typename W>
inline void tile(const float* const* xs, const W* w, int64_t K, float* const* ys, int64_t n0) {
  v8 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = v8{};
  const W* wr = w + n0 * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = load8(xs[t] + k);
    for (int r = 0; r < R; ++r) {
      // The next tile's rows, into L2: each weight row is its own short stream (a 4 KB page for
      // K = 1024) that the hardware prefetcher barely starts on before it ends. Prefetches never
      // fault, so reading past the last row is harmless. 15-25% faster at 1-64 tokens (MoE).
      // (one prefetch per 64-byte line: every 8 floats, every 32 bf16)
      if constexpr (Prefetch) {
        if (sizeof(W) == 4 || (k & 31) == 0) prefetch_l2(wr, (R + r) * K + k);
      }
      const v8 wv = load8(wr + r * K + k);
      for (int t = 0; t < T; ++t) acc[r][t] = fmadd(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += to_f32(wr[r * K + kk]) * xs[t][kk];
      ys[t][n0 + r] = s;
    }
}

// Weight rows [n0, n1) against all M activation rows, TR weight rows by up to TT activation rows a
// tile. The TR * TT accumulators and the vectors they multiply should fit AVX2's 16 registers.
template <int TR, int TT, typename W>
void rows_tiled(const float* const* xs, int64_t M, const W* w, int64_t K, float* const* ys, int64_t n0,
                int64_t n1) {
  static_assert(TT <= 4, "the tail below covers up to 3 leftover activation rows");
  int64_t n = n0;
  for (; n + TR <= n1; n += TR) {
    int64_t t = 0;
    // Only the first pass over a weight tile prefetches the next one; later passes find it in cache.
    for (; t + TT <= M; t += TT) {
      if (t == 0) tile<TR, TT>(xs + t, w, K, ys + t, n);
      else tile<TR, TT, false>(xs + t, w, K, ys + t, n);
    }
    if constexpr (TT > 1) {
      if (M - t == 3) tile<TR, 3>(xs + t, w, K, ys + t, n);
      else if (M - t == 2) tile<TR, 2>(xs + t, w, K, ys + t, n);
      else if (M - t == 1) tile<TR, 1>(xs + t, w, K, ys + t, n);
    }
  }
  if constexpr (TR > 1) rows_tiled<1, TT>(xs, M, w, K, ys, n, n1);
}

// One activation row: 4 weight rows a tile (memory-bound; 4 row streams measured 5-20% faster than 8).
// More rows: 3 weight rows by 4 activation rows, the fastest tile measured for 2-16 rows.
template <typename W>
inline void rows(const float* const* xs, int64_t M, const W* w, int64_t K, float* const* ys, int64_t n0,
                 int64_t n1) {
  if (M == 1) rows_tiled<4, 1>(xs, M, w, K, ys, n0, n1);
  else rows_tiled<3, 4>(xs, M, w, K, ys, n0, n1);
}

// HF RMSNorm of one row: y = (x * rsqrt(mean(x^2) + eps)) * weight.
inline void rms_norm_row(const float* row, const float* w, int64_t D, float eps, float* y) {
  v8 acc = v8{};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const v8 v = load8(row + d);
    acc = fmadd(v, v, acc);
  }
  float ss = hsum(acc);
  for (; d < D; ++d) ss += row[d] * row[d];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d) y[d] = row[d] * r * w[d];
}

inline void check_f32(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == dim,
              name, " must be a contiguous ", dim, "-d float32 CPU tensor, got ", t.scalar_type(), " ",
              t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

// A weight (or cache) tensor's data as float32 or bf16, the two element types the kernels read.
inline bool is_weight(const torch::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() &&
         (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16);
}

inline void check_weight(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(is_weight(t) && t.dim() == dim, name, " must be a contiguous ", dim,
              "-d float32 or bfloat16 CPU tensor, got ", t.scalar_type(), " ", t.sizes(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

// fn(p) with p the tensor's data as const float* or const bf16* (a generic lambda: one instance each).
template <typename F>
decltype(auto) with_weight(const torch::Tensor& t, const F& fn) {
  if (t.scalar_type() == torch::kBFloat16) return fn(reinterpret_cast<const bf16*>(t.data_ptr<at::BFloat16>()));
  return fn(static_cast<const float*>(t.data_ptr<float>()));
}

// An activation as float32: x itself, or a float32 copy of a bf16 x (exact). The kernels compute
// in float32; their public entry points round the result back to the input's dtype.
inline void check_act(const torch::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == dim &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              name, " must be a contiguous ", dim, "-d float32 or bfloat16 CPU tensor, got ", x.scalar_type(), " ",
              x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
}

inline torch::Tensor as_f32(const torch::Tensor& x, const char* name, int64_t dim) {
  check_act(x, name, dim);
  return x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
}

template <typename F>  // float or const float
std::vector<F*> row_ptrs(F* base, int64_t m, int64_t stride) {
  std::vector<F*> p(m);
  for (int64_t i = 0; i < m; ++i) p[i] = base + i * stride;
  return p;
}

// cpu_moe_amx.cpp. Whether this process may run tile instructions (the CPU has AMX-BF16, the OS lets
// it: asked once); whether moe() runs an expert with m pairs there (moe_amx_rows).
bool moe_amx_usable();
bool moe_amx_rows_in(int64_t m);
// One bf16 expert on m token rows xs[t] (float32, D each): y [m, D] (rows D apart) =
// w2 [D, I] @ gated_mul(w13 [2I, D] @ x), activations rounded to bf16 for each product, float32 sums.
// Only where moe_amx_usable().
void moe_expert_amx(const float* const* xs, int64_t m, const bf16* w13, const bf16* w2, int64_t D, int64_t I,
                    float* y, int64_t act, float beta, float linear_beta);
// y [m, N] (rows N apart) = x @ w.T for m rows xs[t] (float32, K each) and w [N, K] bf16, the same
// product on all threads (runs of weight rows). Only where moe_amx_usable().
void linear_amx(const float* const* xs, int64_t m, const bf16* w, int64_t N, int64_t K, float* y);
// The same on the calling thread alone, y rows ldy apart.
void amx_product(const float* const* xs, int64_t m, const bf16* w, int64_t N, int64_t K, float* y, int64_t ldy);
// y [m, N] (rows ldy apart) = x @ w for w [K, N] bf16 row-major (re-laid out into the tiles' B operand
// on every call: for small weights), on the calling thread alone.
void amx_product_kn(const float* const* xs, int64_t m, const bf16* w, int64_t K, int64_t N, float* y, int64_t ldy);

}  // namespace kimitui_cpu
