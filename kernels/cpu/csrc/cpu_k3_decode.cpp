// Kimi K3 / Kimi Linear decode pieces that ran as dozens of small ATen operations each, one call each:
//
// kda_decode(...)        a KDA layer's whole step between its projections, one token for each of N
//                        sequences: the short causal conv + SiLU from each slot's history, the forget
//                        gate, beta, the delta-rule step on the slot's fp32 state and the output's
//                        RMSNorm gated by sigmoid(gate) (Backend.kda_decode, kernels/kda.py).
// attn_res_mix_norm(...) an attention-residual softmax mix over the block snapshots with the
//                        sublayer's RMSNorm after it (Backend.attn_res_mix_norm, reference.attn_res_mix).
// situ_and_mul(...)      K3's SiTU of a dense MLP's (shared experts') fused gate/up product.
//
// The arithmetic is float32 and rounds where the PyTorch path rounds to the activations' dtype (bf16
// or float32): the conv's output, the recurrence's output, the mix, the norm's two steps and the
// residual sum. Sums run in another order than ATen's, so a result is within a few float32 ulps of the
// PyTorch path before those roundings (and so within one bf16 ulp after them, rarely).
//
// Inputs are float32 or bf16 (activations in one dtype; the small weights each in its own, read as
// float32); the states float32. The loops are plain C++ that GCC vectorises, compiled for AVX-512,
// AVX2 and plain x86-64 in one build (target_clones) where the compiler supports it.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include "cpu_kda_decode.h"
#include "cpu_parallel.h"  // parallel_runs on the few-row extension's team (use_team)
#include "gated_act.h"     // exp_f32, sigmoid_f32, situ_mul

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define K3_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define K3_CLONES
#endif

namespace {

// A float32 or bf16 vector or matrix read as float32 (2-d: rows at `row_stride`, columns contiguous).
struct View {
  const void* p = nullptr;
  bool bf16 = false;
  int64_t row_stride = 0;

  static View of(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu(), name, ": a CPU tensor is needed");
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, name,
                ": float32 or bf16, got ", t.scalar_type());
    TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, ": the last dim must be contiguous");
    View v;
    v.p = t.data_ptr();
    v.bf16 = t.scalar_type() == torch::kBFloat16;
    v.row_stride = t.dim() >= 2 ? t.stride(0) : 0;
    return v;
  }
  // row r's elements [c0, c0 + n) as float32 into out
  void row(int64_t r, int64_t c0, int64_t n, float* out) const {
    const int64_t off = r * row_stride + c0;
    if (bf16) {
      const auto* s = static_cast<const c10::BFloat16*>(p) + off;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(s[i]);
    } else {
      const auto* s = static_cast<const float*>(p) + off;
      for (int64_t i = 0; i < n; ++i) out[i] = s[i];
    }
  }
};

// round to the activations' dtype and back (bf16: nearest even, as ATen's casts)
inline void round_to(float* x, int64_t n, bool bf16) {
  if (!bf16) return;
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<c10::BFloat16>(x[i]));
}

// x [n] into out (float32 or bf16) from element `offset` on
inline void store_at(const torch::Tensor& out, int64_t offset, const float* x, int64_t n) {
  if (out.scalar_type() == torch::kBFloat16) {
    auto* d = out.data_ptr<c10::BFloat16>() + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<c10::BFloat16>(x[i]);
  } else {
    std::copy(x, x + n, out.data_ptr<float>() + offset);
  }
}

inline void store(const torch::Tensor& out, int64_t r, const float* x, int64_t n) {
  store_at(out, r * out.stride(0), x, n);
}

// One head's delta-rule step on S [K, V] (in place): S <- diag(exp(g)) S; u = k^T S, o = q^T S;
// delta = beta (v - u); o += (q . k) delta; S += k delta^T. q already scaled, q and k l2-normed.
K3_CLONES void delta_step(float* __restrict S, const float* __restrict q, const float* __restrict k,
                          const float* __restrict v, const float* __restrict decay, float beta, int64_t K,
                          int64_t V, float* __restrict o, float* __restrict u) {
  for (int64_t j = 0; j < V; ++j) o[j] = u[j] = 0.0f;
  float qk = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict s = S + i * V;
    const float d = decay[i], ki = k[i], qi = q[i];
    qk += qi * ki;
    for (int64_t j = 0; j < V; ++j) {
      const float x = s[j] * d;
      s[j] = x;
      u[j] += ki * x;
      o[j] += qi * x;
    }
  }
  for (int64_t j = 0; j < V; ++j) {
    u[j] = beta * (v[j] - u[j]);  // delta
    o[j] += qk * u[j];
  }
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict s = S + i * V;
    const float ki = k[i];
    for (int64_t j = 0; j < V; ++j) s[j] += ki * u[j];
  }
}

inline float sum_squares(const float* x, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

}  // namespace

// qkv [N, 3P] (q | k | v channels; rows may be strided), f_b and gate [N, P], b [N, H] in the
// activations' dtype; conv_weight [3P, W], A_log [H], dt_bias [P], norm_weight [Dv]; conv_state
// [slots, 3P, W-1] and rec_state [slots, H, K, V] float32, updated in place at slots [N] (int64,
// each >= 0, distinct). lower_bound: K3's safe gate (lower_bound * sigmoid(exp(A_log) * a)) when it
// is negative, else Kimi Linear's -exp(A_log) * softplus(a). -> [N, H * V] in qkv's dtype.
torch::Tensor kda_decode(torch::Tensor qkv, torch::Tensor f_b, torch::Tensor b, torch::Tensor gate,
                         torch::Tensor conv_weight, torch::Tensor A_log, torch::Tensor dt_bias, double lower_bound,
                         torch::Tensor norm_weight, double eps, torch::Tensor conv_state, torch::Tensor rec_state,
                         torch::Tensor slots, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && f_b.dim() == 2 && b.dim() == 2 && gate.dim() == 2, "kda_decode: qkv, f_b, b, gate must be 2-d");
  TORCH_CHECK(rec_state.dim() == 4 && rec_state.scalar_type() == torch::kFloat32 && rec_state.is_contiguous(),
              "kda_decode: rec_state must be a contiguous float32 [slots, H, K, V]");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.scalar_type() == torch::kFloat32 && conv_state.is_contiguous(),
              "kda_decode: conv_state must be a contiguous float32 [slots, C, W-1]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64, "kda_decode: slots must be int64 [N]");
  const int64_t N = qkv.size(0), H = rec_state.size(1), K = rec_state.size(2), V = rec_state.size(3);
  const int64_t P = H * K, C = conv_state.size(1), Wm1 = conv_state.size(2), W = Wm1 + 1;
  TORCH_CHECK(K == V, "kda_decode: head_k_dim ", K, " != head_v_dim ", V, " (the conv's q | k | v split needs one width)");
  TORCH_CHECK(qkv.size(1) == 3 * P && C == 3 * P, "kda_decode: qkv ", qkv.sizes(), " and conv_state ", conv_state.sizes(),
              " do not hold 3 x ", H, " heads x ", K);
  TORCH_CHECK(f_b.size(0) == N && f_b.size(1) == P && gate.size(0) == N && gate.size(1) == P && b.size(0) == N &&
                  b.size(1) == H && slots.size(0) == N,
              "kda_decode: f_b ", f_b.sizes(), ", gate ", gate.sizes(), ", b ", b.sizes(), ", slots ", slots.sizes(),
              " do not match ", N, " rows of ", H, " heads x ", K);
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == C && conv_weight.size(1) == W && conv_weight.is_contiguous(),
              "kda_decode: conv_weight ", conv_weight.sizes(), ", expected contiguous [", C, ", ", W, "]");
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == P && norm_weight.numel() == V,
              "kda_decode: A_log, dt_bias, norm_weight have ", A_log.numel(), ", ", dt_bias.numel(), ", ",
              norm_weight.numel(), " elements, expected ", H, ", ", P, ", ", V);
  const bool act_bf16 = qkv.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(f_b.scalar_type() == qkv.scalar_type() && b.scalar_type() == qkv.scalar_type() &&
                  gate.scalar_type() == qkv.scalar_type(),
              "kda_decode: qkv, f_b, b, gate must share one dtype");
  const View vqkv = View::of(qkv, "qkv"), vfb = View::of(f_b, "f_b"), vb = View::of(b, "b"), vg = View::of(gate, "gate");
  const View valog = View::of(A_log.reshape(-1), "A_log");
  const View vdt = View::of(dt_bias.reshape(-1), "dt_bias"), vnw = View::of(norm_weight.reshape(-1), "norm_weight");
  const int64_t num_slots = rec_state.size(0);
  const auto* slot = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(slot[n] >= 0 && slot[n] < num_slots && conv_state.size(0) == num_slots, "kda_decode: slot ", slot[n],
                " out of range [0, ", num_slots, ")");

  auto out = torch::empty({N, P}, qkv.options().memory_format(torch::MemoryFormat::Contiguous));
  std::vector<float> rate(H), dt(P), nw(V);
  valog.row(0, 0, H, rate.data());
  for (auto& r : rate) r = std::exp(r);
  vdt.row(0, 0, P, dt.data());
  vnw.row(0, 0, V, nw.data());
  const auto cw_f32 = conv_weight.to(torch::kFloat32).contiguous();  // float32 already in the model: no copy
  const float* cw = cw_f32.data_ptr<float>();
  const bool safe_gate = lower_bound < 0;
  const float lb = static_cast<float>(lower_bound), sc = static_cast<float>(scale);
  float* conv = conv_state.data_ptr<float>();
  float* rec = rec_state.data_ptr<float>();
  const float e = static_cast<float>(eps);

  // One work item per (row, head): a head's q, k, v channels, its conv history, its state and its
  // output columns are its own (the rows' slots are distinct), so items run on the team side by side.
  kimitui_cpu::parallel_runs(N * H, N * H * K * V * 8, [&](int64_t i0, int64_t i1) {
    std::vector<float> x(3 * K), y(3 * K), fb(K), gt(V), dec(K), o(V), u(V);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / H, h = i % H, s = slot[n];
      float b1;
      vb.row(n, h, 1, &b1);
      vfb.row(n, h * K, K, fb.data());
      vg.row(n, h * V, V, gt.data());
      // short conv + SiLU over the slot's history (oldest first) of this head's q, k and v channels,
      // then the history moves on by one
      for (int64_t part = 0; part < 3; ++part) {
        const int64_t c0 = part * P + h * K;
        vqkv.row(n, c0, K, x.data() + part * K);
        for (int64_t j = 0; j < K; ++j) {
          const int64_t c = c0 + j;
          float* hist = conv + (s * C + c) * Wm1;
          const float* w = cw + c * W;
          const float xc = x[part * K + j];
          float acc = 0.0f;
          for (int64_t t = 0; t < Wm1; ++t) acc += hist[t] * w[t];
          acc += xc * w[Wm1];
          y[part * K + j] = acc / (1.0f + exp_f32(-acc));
          for (int64_t t = 0; t + 1 < Wm1; ++t) hist[t] = hist[t + 1];
          if (Wm1) hist[Wm1 - 1] = xc;
        }
      }
      round_to(y.data(), 3 * K, act_bf16);  // the conv's output in the activations' dtype, as the PyTorch path
      float* q = y.data();
      float* k = y.data() + K;
      const float* v = y.data() + 2 * K;
      const float qn = 1.0f / std::sqrt(sum_squares(q, K) + 1e-6f), kn = 1.0f / std::sqrt(sum_squares(k, K) + 1e-6f);
      for (int64_t j = 0; j < K; ++j) {
        q[j] = q[j] * qn * sc;
        k[j] = k[j] * kn;
        const float a = fb[j] + dt[h * K + j];
        const float g = safe_gate ? lb * sigmoid_f32(rate[h] * a) : -rate[h] * (a > 20.0f ? a : std::log1p(std::exp(a)));
        dec[j] = exp_f32(g);
      }
      delta_step(rec + (s * H + h) * K * V, q, k, v, dec.data(), sigmoid_f32(b1), K, V, o.data(), u.data());
      round_to(o.data(), V, act_bf16);  // the recurrence's output in v's dtype
      const float r = 1.0f / std::sqrt(sum_squares(o.data(), V) / static_cast<float>(V) + e);
      for (int64_t j = 0; j < V; ++j) o[j] = o[j] * r * nw[j] * sigmoid_f32(gt[j]);
      store_at(out, n * P + h * V, o.data(), V);
    }
  });
  return out;
}

// The KDA recurrence over packed prefill sequences, token after token (Backend.kda_chunk's result, the
// per-token form of kernels/kda.py's oracle): q, k [T, H, K] and v [T, H, V] (float32 or bf16, one
// dtype), g [T, H, K] and beta [T, H] float32 (log-decays and write strengths), initial_state
// [N, H, K, V] float32, cu_seqlens [N + 1] int64. q and k are l2-normed (eps 1e-6 inside the sqrt), q
// scaled. -> (o [T, H, V] in v's dtype, final_state [N, H, K, V] float32). Each (sequence, head) is one
// work item on the kernels' thread team: its state [K, V] stays in cache for the whole sequence, where the
// chunked form moves [C, C] and [C, K] blocks through many small products (3x slower on a 2-core
// CPU at 64 and 256 tokens of 8 heads x 128).
std::vector<torch::Tensor> kda_sequential(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                          torch::Tensor beta, torch::Tensor initial_state, torch::Tensor cu_seqlens,
                                          double scale) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1),
              "kda_sequential: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " are not [T, H, K] / [T, H, V]");
  const int64_t T = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2);
  TORCH_CHECK(g.sizes() == q.sizes() && g.scalar_type() == torch::kFloat32 && beta.dim() == 2 && beta.size(0) == T &&
                  beta.size(1) == H && beta.scalar_type() == torch::kFloat32,
              "kda_sequential: g ", g.sizes(), " and beta ", beta.sizes(), " must be float32 [T, H, K] and [T, H]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "kda_sequential: q, k and v must share one dtype");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == torch::kInt64 && cu_seqlens.size(0) >= 1,
              "kda_sequential: cu_seqlens must be int64 [N + 1]");
  const auto cu_c = cu_seqlens.contiguous();
  const int64_t N = cu_c.size(0) - 1;
  const int64_t* cu = cu_c.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[N] == T, "kda_sequential: cu_seqlens does not partition ", T, " rows");
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(cu[n + 1] >= cu[n], "kda_sequential: cu_seqlens must not decrease");
  TORCH_CHECK(initial_state.dim() == 4 && initial_state.size(0) == N && initial_state.size(1) == H &&
                  initial_state.size(2) == K && initial_state.size(3) == V,
              "kda_sequential: initial_state ", initial_state.sizes(), ", expected [", N, ", ", H, ", ", K, ", ", V, "]");
  const View vq = View::of(q.reshape({T, H * K}), "q"), vk = View::of(k.reshape({T, H * K}), "k");
  const View vv = View::of(v.reshape({T, H * V}), "v");
  const auto gc = g.contiguous(), bc = beta.contiguous();
  auto state = initial_state.to(torch::kFloat32).contiguous().clone();
  auto out = torch::empty({T, H, V}, v.options().memory_format(torch::MemoryFormat::Contiguous));
  const float sc = static_cast<float>(scale);
  const float* gp = gc.data_ptr<float>();
  const float* bp = bc.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  kimitui_cpu::parallel_runs(N * H, kimitui_cpu::kAlwaysSplit, [&](int64_t i0, int64_t i1) {
    std::vector<float> qt(K), kt(K), vt(V), dec(K), o(V), u(V);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / H, h = i % H;
      float* S = sp + i * K * V;
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        vq.row(t, h * K, K, qt.data());
        vk.row(t, h * K, K, kt.data());
        vv.row(t, h * V, V, vt.data());
        const float qn = sc / std::sqrt(sum_squares(qt.data(), K) + 1e-6f);
        const float kn = 1.0f / std::sqrt(sum_squares(kt.data(), K) + 1e-6f);
        const float* gt = gp + (t * H + h) * K;
        for (int64_t j = 0; j < K; ++j) {
          qt[j] *= qn;
          kt[j] *= kn;
          dec[j] = exp_f32(gt[j]);
        }
        delta_step(S, qt.data(), kt.data(), vt.data(), dec.data(), bp[t * H + h], K, V, o.data(), u.data());
        store_at(out, (t * H + h) * V, o.data(), V);
      }
    }
  });
  return {out, state};
}

// (norm(mix(s, blocks[:n])) * norm_weight, s) for x [T, D]: s = x + delta (delta empty: s = x, returned
// as x itself), rounded to x's dtype; save: s also written to blocks[n]. The mix (n > 0) weights the
// candidates blocks[0..n-1], s by softmax_i(rmsnorm(c_i) . (res_norm_weight * proj_weight)); with n = 0
// the norm reads s. blocks [>= n (+1 with save), T, D] contiguous in x's dtype.
std::vector<torch::Tensor> attn_res_mix_norm(torch::Tensor x, torch::Tensor blocks, int64_t n,
                                             torch::Tensor res_norm_weight, double res_eps, torch::Tensor proj_weight,
                                             torch::Tensor norm_weight, double norm_eps, torch::Tensor delta,
                                             bool save) {
  TORCH_CHECK(x.dim() == 2, "attn_res_mix_norm: x must be [T, D], got ", x.sizes());
  const int64_t T = x.size(0), D = x.size(1);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(1) == T && blocks.size(2) == D && blocks.is_contiguous() &&
                  blocks.scalar_type() == x.scalar_type(),
              "attn_res_mix_norm: blocks ", blocks.sizes(), " must be contiguous [>= n, ", T, ", ", D, "] in x's dtype");
  TORCH_CHECK(n >= 0 && n + (save ? 1 : 0) <= blocks.size(0), "attn_res_mix_norm: n ", n, " (save ", save,
              ") does not fit blocks ", blocks.sizes());
  const bool has_delta = delta.numel() > 0;
  TORCH_CHECK(!has_delta || (delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type()),
              "attn_res_mix_norm: delta ", delta.sizes(), " must match x ", x.sizes());
  TORCH_CHECK(res_norm_weight.numel() == D && proj_weight.numel() == D && norm_weight.numel() == D,
              "attn_res_mix_norm: the weights must have ", D, " elements");
  const View vx = View::of(x, "x");
  const View vd = has_delta ? View::of(delta, "delta") : View();
  std::vector<float> q(D), nw(D), sv(D), tmp(D), h(D), scores(n + 1);
  {
    std::vector<float> a(D);
    View::of(res_norm_weight.reshape(-1), "res_norm_weight").row(0, 0, D, q.data());
    View::of(proj_weight.reshape(-1), "proj_weight").row(0, 0, D, a.data());
    for (int64_t i = 0; i < D; ++i) q[i] *= a[i];  // the norm weight folded into the query
    View::of(norm_weight.reshape(-1), "norm_weight").row(0, 0, D, nw.data());
  }
  const View vblk = View::of(blocks.view({-1, D}), "blocks");
  auto out = torch::empty({T, D}, x.options().memory_format(torch::MemoryFormat::Contiguous));
  torch::Tensor s_out = has_delta ? torch::empty({T, D}, out.options()) : x;
  const float reps = static_cast<float>(res_eps), neps = static_cast<float>(norm_eps);
  for (int64_t t = 0; t < T; ++t) {
    vx.row(t, 0, D, sv.data());
    if (has_delta) {
      vd.row(t, 0, D, tmp.data());
      for (int64_t i = 0; i < D; ++i) sv[i] += tmp[i];
      round_to(sv.data(), D, bf16);
      store(s_out, t, sv.data(), D);
    }
    if (save) store(blocks.select(0, n), t, sv.data(), D);
    if (n == 0) {
      for (int64_t i = 0; i < D; ++i) h[i] = sv[i];
    } else {
      // scores of the candidates blocks[0..n-1], then s; softmax; the weighted sum of the raw candidates
      float mx = -INFINITY;
      for (int64_t c = 0; c <= n; ++c) {
        const float* v = sv.data();
        if (c < n) {
          vblk.row(c * T + t, 0, D, tmp.data());
          v = tmp.data();
        }
        const float r = 1.0f / std::sqrt(sum_squares(v, D) / static_cast<float>(D) + reps);
        float dot = 0.0f;
        for (int64_t i = 0; i < D; ++i) dot += v[i] * r * q[i];
        scores[c] = dot;
        mx = std::max(mx, dot);
      }
      float z = 0.0f;
      for (int64_t c = 0; c <= n; ++c) z += (scores[c] = std::exp(scores[c] - mx));
      for (int64_t i = 0; i < D; ++i) h[i] = 0.0f;
      for (int64_t c = 0; c <= n; ++c) {
        const float p = scores[c] / z;
        const float* v = sv.data();
        if (c < n) {
          vblk.row(c * T + t, 0, D, tmp.data());
          v = tmp.data();
        }
        for (int64_t i = 0; i < D; ++i) h[i] += p * v[i];
      }
      round_to(h.data(), D, bf16);  // the mix in x's dtype
    }
    // the sublayer's RMSNorm: bf16 rounds the normalised row, then the product with the weight
    const float r = 1.0f / std::sqrt(sum_squares(h.data(), D) / static_cast<float>(D) + neps);
    for (int64_t i = 0; i < D; ++i) h[i] *= r;
    round_to(h.data(), D, bf16);
    for (int64_t i = 0; i < D; ++i) h[i] *= nw[i];
    store(out, t, h.data(), D);
  }
  return {out, s_out};
}

// Kimi K3's SiTU of a gated MLP's fused product gu [T, 2I] (gate | up; rows may be strided), as
// kernels/activation.py: beta * tanh(g / beta) * sigmoid(g) times linear_beta * tanh(u / linear_beta) (u
// itself when linear_beta <= 0), in float32, rounded once to gu's dtype. -> [T, I]
torch::Tensor situ_and_mul(torch::Tensor gu, double beta, double linear_beta) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "situ_and_mul: gu must be [T, 2I], got ", gu.sizes());
  TORCH_CHECK(beta > 0, "situ_and_mul: beta must be positive, got ", beta);
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  const View v = View::of(gu, "gu");
  auto out = torch::empty({T, I}, gu.options().memory_format(torch::MemoryFormat::Contiguous));
  std::vector<float> g(I), u(I);
  const float b = static_cast<float>(beta), lb = static_cast<float>(linear_beta);
  for (int64_t t = 0; t < T; ++t) {
    v.row(t, 0, I, g.data());
    v.row(t, I, I, u.data());
    for (int64_t i = 0; i < I; ++i) g[i] = situ_mul(g[i], u[i], b, lb);
    store(out, t, g.data(), I);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Tensors in, tensors out, no Python objects touched: the GIL is released for the call, so the
  // server's event loop and other threads run while a step computes.
  using NoGil = py::call_guard<py::gil_scoped_release>;
  m.def("situ_and_mul", &situ_and_mul, "SiTU(gate) * up of a fused gate/up product", NoGil());
  m.def("use_team", [](py::capsule team) {
    TORCH_CHECK(std::string(team.name()) == kimitui_cpu::kTeamCapsule, "use_team: not a ", kimitui_cpu::kTeamCapsule,
                " capsule");
    kimitui_cpu::team_run() = reinterpret_cast<kimitui_cpu::TeamRun>(team.get_pointer());
  }, "run the parallel passes on another extension's thread team (its team_capsule())");
  m.def("kda_capsule", [] {
    return py::capsule(reinterpret_cast<void*>(static_cast<kimitui_cpu::KdaDecode>(&kda_decode)),
                       kimitui_cpu::kKdaDecodeCapsule);
  }, "kda_decode by pointer, for the few-row extension's use_kda_decode");
  m.def("kda_decode", &kda_decode, "KDA decode step between the projections (see cpu_k3_decode.cpp)", NoGil());
  m.def("kda_sequential", &kda_sequential, "KDA recurrence over packed prefill sequences, token by token", NoGil());
  m.def("attn_res_mix_norm", &attn_res_mix_norm, "attention-residual mix and the norm after it", NoGil());
}
