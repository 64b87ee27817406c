// Few-row products on the CPU: the decode shapes, where a step multiplies 1-16 rows of
// activations by each weight. BLAS time grows with the row count there although the weight read
// (the real cost) does not; these loops read each weight tile once for every row. Weights are
// float32 or bfloat16 (widened in registers, cpu_few_rows.h); activations float32 or bfloat16,
// computed in float32 and the result rounded back to the activations' dtype.
//
// linear(x [M, K], w [N, K]) -> x @ w.T [M, N]
// moe(x [T, D], ids [T, k], weights [T, k], w13 [E, 2I, D], w2 [E, D, I]) -> [T, D]
// rms_norm(x [M, D], weight [D], eps) -> [M, D]
// with the MLA decode kernels of cpu_mla_decode.cpp and the decode blocks of cpu_decode_block.cpp.
// Threads take runs of weight rows (parallel_runs in cpu_parallel.h, on the kernels' thread team of
// torch's thread count, cpu_team.h). Built on first use by kernels/cpu/few_rows.py.

#include "cpu_few_rows.h"

using namespace kimitui_cpu;

namespace {

constexpr int64_t kBlock = 48;  // weight rows per work item of linear (a multiple of the 3- and 4-row tiles)
constexpr int64_t kGemmPairs = 32;  // moe: experts with this many pairs or more go to BLAS
// bf16 weights: from this many rows on, linear and each MoE expert run oneDNN's bf16 product (AMX or
// AVX-512 BF16 where the CPU has them) on activations rounded to bf16, as the PyTorch bf16 path
// does. Measured on one core of a Xeon with AMX (CPU clock, the benchmark model's shapes): the
// widening loops take 0.4-0.8x oneDNN's time at 1-4 rows and 1.0-1.35x at 8, where the 8-wide
// float32 FMAs, not the weight read, become the limit; about even at 6. On a CPU where oneDNN has
// no native bf16 product (AVX2 only: at::linear in bf16 is a slow fallback, 3-4x the widening loops'
// time at 6-16 rows on an AVX2 EPYC) the loops run up to kGemmPairs, and BLAS gets float32 weights.
constexpr int64_t kBf16BlasRows = 6;

// moe's per-pair expert outputs go to the caller's scratch tensor, grown up to 64 MB and kept
// between calls: a fresh [T * k, D] buffer for a 2048-token prefill of the benchmark model is 50 MB
// of page faults (about 40 ms) per layer. The caller owns it and lends it to one call at a time.
constexpr int64_t kKeptDownFloats = int64_t{16} << 20;

}  // namespace

bool runs_onednn(const torch::Tensor& w, int64_t rows) {
  return w.scalar_type() == torch::kBFloat16 && rows >= kBf16BlasRows && onednn_bf16_native();
}

torch::Tensor linear(torch::Tensor x_in, torch::Tensor w) {
  check_weight(w, "w", 2);
  if (x_in.dim() == 2 && runs_onednn(w, x_in.size(0))) {
    check_act(x_in, "x", 2);
    TORCH_CHECK(w.size(1) == x_in.size(1), "x has ", x_in.size(1), " features, w has ", w.size(1));
    return onednn_linear_bf16(x_in.to(torch::kBFloat16).contiguous(), w).to(x_in.scalar_type());  // no copies for bf16 x
  }
  const auto x = as_f32(x_in, "x", 2);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x has ", K, " features, w has ", w.size(1));
  auto y = torch::empty({M, N}, x.options());
  const auto xs = row_ptrs<const float>(x.data_ptr<float>(), M, K);
  const auto ys = row_ptrs(y.data_ptr<float>(), M, N);
  with_weight(w, [&](auto wp) {
    parallel_runs((N + kBlock - 1) / kBlock, N * K * w.element_size(), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        rows(xs.data(), M, wp, K, ys.data(), b * kBlock, std::min(N, (b + 1) * kBlock));
    });
  });
  return x_in.scalar_type() == torch::kFloat32 ? y : y.to(x_in.scalar_type());
}

torch::Tensor linear_amx_bf16(torch::Tensor x_in, torch::Tensor w) {
  check_weight(w, "w", 2);
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "linear_amx: w must be bf16, got ", w.scalar_type());
  TORCH_CHECK(moe_amx_usable(), "linear_amx: this CPU (or OS, or build) gives no AMX-BF16 tiles");
  const auto x = as_f32(x_in, "x", 2);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x has ", K, " features, w has ", w.size(1));
  auto y = torch::empty({M, N}, x.options());
  if (M > 0)
    linear_amx(row_ptrs<const float>(x.data_ptr<float>(), M, K).data(), M,
               reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>()), N, K, y.data_ptr<float>());
  return x_in.scalar_type() == torch::kFloat32 ? y : y.to(x_in.scalar_type());
}

// Gated experts: y_t = sum over t's slots, in ascending expert order, of weight * w2[e] @ act(g, u),
// [g; u] = w13[e] @ x_t; act silu(g) * u, or SiTU (gated_mul). An id outside [0, E) (a pair computed
// elsewhere) adds nothing. A token gives the same bits alone or in a batch as long as its experts get
// fewer than kGemmPairs pairs (decode batches); BLAS products, like the PyTorch path's, depend on
// their row count. w13 and w2: both float32 or both bf16 (then experts with kBf16BlasRows pairs or
// more run oneDNN's bf16 products, on activations rounded to bf16, as the PyTorch bf16 path does).
// Where the CPU and OS give AMX-BF16 tiles, bf16 experts with moe_amx_rows' pair counts (1-512 by
// default) run cpu_moe_amx.cpp's tile product instead (weight as the A operand, no re-layout); there
// a token's bits do not depend on the other tokens of its experts.
torch::Tensor moe(torch::Tensor x_in, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13, torch::Tensor w2,
                  torch::Tensor scratch, int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(act == 0 || (act == 1 && beta > 0), "activation ", act, " with beta ", beta,
              " is not SiLU (0) or SiTU (1) with a positive beta");
  const auto x = as_f32(x_in, "x", 2);
  check_f32(weights, "topk_weights", 2);
  check_weight(w13, "w13", 3);
  check_weight(w2, "w2", 3);
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "w13 (", w13.scalar_type(), ") and w2 (", w2.scalar_type(),
              ") must have one dtype");
  TORCH_CHECK(scratch.device().is_cpu() && scratch.scalar_type() == torch::kFloat32 && scratch.is_contiguous(),
              "scratch must be a contiguous float32 CPU tensor, got ", scratch.scalar_type(), " ", scratch.sizes());
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == torch::kInt64 && ids.is_contiguous() && ids.dim() == 2,
              "topk_ids must be a contiguous 2-d int64 CPU tensor, got ", ids.scalar_type(), " ", ids.sizes());
  const int64_t T = x.size(0), D = x.size(1), top_k = ids.size(1), E = w13.size(0), I2 = w13.size(1), I = I2 / 2;
  TORCH_CHECK(weights.sizes() == ids.sizes(), "topk_weights ", weights.sizes(), " vs topk_ids ", ids.sizes());
  TORCH_CHECK(ids.size(0) == T, "topk_ids has ", ids.size(0), " rows, x has ", T);
  TORCH_CHECK(I2 % 2 == 0 && w13.size(2) == D, "w13 ", w13.sizes(), " does not fit x with ", D, " features");
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == D && w2.size(2) == I, "w2 ", w2.sizes(), " does not fit w13 ",
              w13.sizes());

  // Group the (token, slot) pairs by expert, tokens ascending within an expert.
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T * top_k; ++i)
    if (id[i] >= 0 && id[i] < E) ++count[id[i] + 1];
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];  // now the start of each expert's group
  const int64_t P = count[E];
  std::vector<int64_t> pos(T * top_k, -1), next(count.begin(), count.end() - 1), token(P);
  for (int64_t i = 0; i < T * top_k; ++i)
    if (id[i] >= 0 && id[i] < E) {
      pos[i] = next[id[i]]++;
      token[pos[i]] = i / top_k;
    }
  std::vector<int64_t> active;  // experts with at least one pair
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) active.push_back(e);
  // One work item per active expert: its gate/up rows, the SwiGLU, then its down rows, for that
  // expert's group of pairs. Items go to whichever thread is free (experts differ in pair count).
  // An expert with kGemmPairs pairs or more is a compute-bound product: BLAS, one thread per expert
  // (MKL runs single-threaded inside a parallel region), which measured 74 GFLOP/s a thread against
  // 135 for two threads on one ~190-row product. Fewer pairs: the tiled loops, which stream the weight.
  std::vector<float> own;  // above kKeptDownFloats: this call's own buffer
  float* dn;
  if (P * D <= kKeptDownFloats) {
    if (scratch.numel() < P * D) scratch.resize_({P * D});
    dn = scratch.data_ptr<float>();
  } else {
    own.resize(P * D);
    dn = own.data();
  }
  std::vector<const float*> xs(P);
  for (int64_t p = 0; p < P; ++p) xs[p] = x.data_ptr<float>() + token[p] * D;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  const auto wdtype = w13.scalar_type();
  const bool bf16_native = onednn_bf16_native();
  // y [m, n] = a [m, k] @ w[e].T through BLAS (oneDNN's bf16 product for bf16 weights where it is
  // native; elsewhere the expert's weight widened to float32 for this product)
  auto gemm = [&](float* y, float* a, int64_t m, int64_t k, const torch::Tensor& w, int64_t e, int64_t n) {
    auto yt = torch::from_blob(y, {m, n}, f32);
    auto at_ = torch::from_blob(a, {m, k}, f32);
    if (wdtype == torch::kFloat32) at::mm_out(yt, at_, w.select(0, e).t());
    else if (!bf16_native) at::mm_out(yt, at_, w.select(0, e).to(torch::kFloat32).t());
    else yt.copy_(at::mm(at_.to(wdtype), w.select(0, e).t()));
  };
  with_weight(w13, [&](auto w13p) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w13p)>>;
    const W* w2p = reinterpret_cast<const W*>(w2.data_ptr());
    const int64_t blas_pairs = std::is_same_v<W, bf16> && bf16_native ? kBf16BlasRows : kGemmPairs;
    const bool amx = std::is_same_v<W, bf16> && moe_amx_usable();  // asks for the tiles before any thread uses them
    auto on_amx = [&](int64_t m) { return amx && moe_amx_rows_in(m); };
    bool any_blas = false;
    for (int64_t e : active) {
      const int64_t m = count[e + 1] - count[e];
      any_blas = any_blas || (m >= blas_pairs && !on_amx(m));
    }
    dynamic_for(static_cast<int64_t>(active.size()), any_blas, [&](int64_t i) {
      thread_local std::vector<float> gu, h, xg;  // kept across calls: no page faults per call
      const int64_t e = active[i], g = count[e], m = count[e + 1] - g;
      if constexpr (std::is_same_v<W, bf16>) {
        if (on_amx(m)) {
          moe_expert_amx(xs.data() + g, m, w13p + e * I2 * D, w2p + e * D * I, D, I, dn + g * D, act,
                         static_cast<float>(beta), static_cast<float>(linear_beta));
          return;
        }
      }
      if (static_cast<int64_t>(gu.size()) < m * I2) gu.resize(m * I2);
      if (static_cast<int64_t>(h.size()) < m * I) h.resize(m * I);
      const bool blas = m >= blas_pairs;
      if (blas) {
        if (static_cast<int64_t>(xg.size()) < m * D) xg.resize(m * D);
        for (int64_t p = 0; p < m; ++p) std::memcpy(xg.data() + p * D, xs[g + p], D * sizeof(float));
        gemm(gu.data(), xg.data(), m, D, w13, e, I2);
      } else {
        rows(xs.data() + g, m, w13p + e * I2 * D, D, row_ptrs(gu.data(), m, I2).data(), 0, I2);
      }
      for (int64_t p = 0; p < m; ++p)
        gated_mul(gu.data() + p * I2, gu.data() + p * I2 + I, h.data() + p * I, I, act, static_cast<float>(beta),
                  static_cast<float>(linear_beta));
      if (blas) {
        gemm(dn + g * D, h.data(), m, I, w2, e, D);
      } else {
        rows(row_ptrs<const float>(h.data(), m, I).data(), m, w2p + e * D * I, I, row_ptrs(dn + g * D, m, D).data(),
             0, D);
      }
    });
  });

  // Each token adds its weighted expert outputs in ascending expert order. (Zeroed here, not by
  // torch::zeros: past 32768 elements ATen fills on its OpenMP threads, waking them.)
  auto out = torch::empty({T, D}, x.options());
  const float* wt = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  parallel_runs(T, T * top_k * D * static_cast<int64_t>(sizeof(float)), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(top_k);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill_n(o + t * D, D, 0.0f);
      for (int64_t j = 0; j < top_k; ++j) slots[j] = t * top_k + j;
      std::sort(slots.begin(), slots.end(), [&](int64_t i, int64_t j) { return id[i] < id[j]; });
      for (int64_t s : slots) {
        if (pos[s] < 0) continue;
        const float* y = dn + pos[s] * D;
        for (int64_t d = 0; d < D; ++d) {
          const float v = y[d] * wt[s];
          o[t * D + d] += v;
        }
      }
    }
  });
  return x_in.scalar_type() == torch::kFloat32 ? out : out.to(x_in.scalar_type());
}

// DeepSeek-V3's router (noaux_tc), as kernels.reference.moe_route: scores = sigmoid (or softmax) of
// x @ w.T; the top_k experts by score + bias, within the topk_group groups whose two best
// score + bias sum highest; weights = their scores, normalised to sum 1 (norm), times scaling.
// -> (ids [T, top_k] int64 in descending order of score + bias, weights [T, top_k] float32).
std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor x, torch::Tensor w, torch::Tensor bias,
                                                   int64_t top_k, int64_t n_group, int64_t topk_group,
                                                   bool sigmoid, bool norm, double scaling) {
  check_f32(x, "x", 2);
  check_f32(w, "router weight", 2);
  check_f32(bias, "e_score_correction_bias", 1);
  const int64_t T = x.size(0), D = x.size(1), E = w.size(0);
  TORCH_CHECK(w.size(1) == D && bias.size(0) == E, "router weight ", w.sizes(), " and bias ", bias.sizes(),
              " do not fit x with ", D, " features");
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
                  (n_group == 1 || E / n_group >= 2),
              "n_group ", n_group, " / topk_group ", topk_group, " do not fit ", E, " experts");
  TORCH_CHECK(top_k >= 1 && top_k <= E / n_group * topk_group, "top_k ", top_k, " exceeds the ",
              E / n_group * topk_group, " experts of the kept groups");
  auto ids = torch::empty({T, top_k}, x.options().dtype(torch::kInt64));
  auto weights = torch::empty({T, top_k}, x.options());
  auto logits = torch::empty({T, E}, x.options());
  const auto xs = row_ptrs<const float>(x.data_ptr<float>(), T, D);
  const auto ls = row_ptrs(logits.data_ptr<float>(), T, E);
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const int64_t G = E / n_group;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    rows(xs.data() + t0, t1 - t0, wp, D, ls.data() + t0, 0, E);  // this block's logits
    std::vector<float> score(E), choice(E), group(n_group);
    std::vector<int64_t> order(std::max(E, n_group));
    std::vector<bool> kept(n_group);
    // larger first, the lower index on ties
    auto by = [](const std::vector<float>& v) {
      return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
    };
    for (int64_t t = t0; t < t1; ++t) {
      float* l = ls[t];
      // NaN-safe, as kernels.reference._router_scores: a NaN logit counts as -inf, a NaN score as 0,
      // a NaN biased score as -inf (the comparator below then stays a strict weak order)
      for (int64_t e = 0; e < E; ++e)
        if (std::isnan(l[e])) l[e] = -INFINITY;
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-l[e]));
      } else {
        const float m = *std::max_element(l, l + E);
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) sum += (score[e] = std::exp(l[e] - m));
        for (int64_t e = 0; e < E; ++e) score[e] /= sum;
      }
      for (int64_t e = 0; e < E; ++e) {
        if (std::isnan(score[e])) score[e] = 0.0f;
        choice[e] = score[e] + bp[e];
        if (std::isnan(choice[e])) choice[e] = -INFINITY;
      }
      if (n_group > 1) {
        for (int64_t g = 0; g < n_group; ++g) {
          float a = -INFINITY, b = -INFINITY;  // the group's two best
          for (int64_t e = g * G; e < (g + 1) * G; ++e) {
            if (choice[e] > a) {
              b = a;
              a = choice[e];
            } else if (choice[e] > b) {
              b = choice[e];
            }
          }
          group[g] = a + b;
        }
        for (int64_t g = 0; g < n_group; ++g) order[g] = g;
        std::partial_sort(order.begin(), order.begin() + topk_group, order.begin() + n_group, by(group));
        std::fill(kept.begin(), kept.end(), false);
        for (int64_t i = 0; i < topk_group; ++i) kept[order[i]] = true;
        for (int64_t e = 0; e < E; ++e)
          if (!kept[e / G]) choice[e] = -INFINITY;
      }
      for (int64_t e = 0; e < E; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + top_k, order.begin() + E, by(choice));
      int64_t* id = ids.data_ptr<int64_t>() + t * top_k;
      float* wt = weights.data_ptr<float>() + t * top_k;
      float sum = 0.0f;
      for (int64_t i = 0; i < top_k; ++i) sum += (wt[i] = score[id[i] = order[i]]);
      for (int64_t i = 0; i < top_k; ++i) {
        if (norm) wt[i] = wt[i] / (sum + 1e-20f);
        wt[i] = wt[i] * static_cast<float>(scaling);
      }
    }
  });
  return {ids, weights};
}

// HF RMSNorm in float32 over the last dim: y = (x * rsqrt(mean(x^2) + eps)) * weight. Small enough
// that in decode the eight ATen operations it replaces cost more than the arithmetic.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_f32(x, "x", 2);
  check_f32(weight, "weight", 1);
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.size(0) == D, "x has ", D, " features, the norm weight ", weight.size(0));
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_row(xp + m * D, wp, D, static_cast<float>(eps), yp + m * D);
  });
  return y;
}

int64_t threads() { return at::get_num_threads(); }

// Every binding that touches no Python object runs without the GIL (released once its arguments are
// converted, taken back before the result is): the host-expert workers, one per NUMA node, then run
// their kernels side by side, and the TUI's and HTTP server's threads keep running during a call.
// The capsule bindings keep it: they make or read Python objects.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, NoGil(), "x [M, K] @ w [N, K].T for float32 CPU tensors");
  m.def("moe", &moe, NoGil(), "gated (SiLU / SiTU) MoE over dense float32 experts on the CPU");
  m.def("mla_decode", &mla_decode, NoGil(), "absorbed MLA decode over the paged latent cache, float32 on the CPU");
  m.def("mla_decode_absorbed", &mla_decode_absorbed, NoGil(),
        "a whole absorbed MLA decode step after the projections (cache write included), float32 on the CPU");
  m.def("moe_route", &moe_route, NoGil(), "DeepSeek-V3 router (noaux_tc top-k), float32 on the CPU");
  m.def("rms_norm", &rms_norm, NoGil(), "HF RMSNorm over the last dim, float32 on the CPU");
  m.def("attention_block", &attention_block, NoGil(), "x + MLA(norm(x)) (or gated MLA of normed x) for a batch of decodes, on the CPU");
  m.def("ffn_block", &ffn_block, NoGil(), "x + MoE or MLP(norm(x)) for a few rows, float32 on the CPU");
  m.def("packed_ffn_block", &packed_ffn_block, NoGil(),
        "x + MoE(norm(x)) over packed (INT4 / MXFP4) routed experts for a few rows, on the CPU");
  m.def("latent_moe_block", &latent_moe_block, NoGil(),
        "Kimi Linear / K3's (latent) MoE over packed routed experts for a few normed rows, on the CPU");
  m.def("use_packed_experts", [](py::capsule floats, py::capsule w4a8) {
    TORCH_CHECK(std::string(floats.name()) == kPackedExpertsCapsule &&
                    std::string(w4a8.name()) == kPackedExpertsW4a8Capsule,
                "use_packed_experts: not the packed-experts extension's capsules");
    use_packed_experts(reinterpret_cast<PackedExperts>(floats.get_pointer()),
                       reinterpret_cast<PackedExperts>(w4a8.get_pointer()));
  }, "the packed-experts extension's MoE (its experts_capsules()), for packed_ffn_block");
  m.def("kda_block", &kda_block, NoGil(), "a Kimi Linear / K3 KDA layer's decode step for a few normed rows, on the CPU");
  m.def("use_kda_decode", [](py::capsule kda) {
    TORCH_CHECK(std::string(kda.name()) == kKdaDecodeCapsule, "use_kda_decode: not the K3 decode extension's capsule");
    use_kda_decode(reinterpret_cast<KdaDecode>(kda.get_pointer()));
  }, "the K3 decode extension's kda_decode (its kda_capsule()), for kda_block");
  m.def("team_capsule", [] {
    return py::capsule(reinterpret_cast<void*>(&Team::run_on), kTeamCapsule);
  }, "this extension's thread team, for another extension's use_team()");
  m.def("threads", &threads, NoGil(), "the thread count at::parallel_for uses here");
  m.def("moe_amx_rows", &moe_amx_rows, NoGil(),
        "set the pair counts [lo, hi] at which moe() runs a bf16 expert on AMX tiles; returns the previous ones");
  m.def("linear_amx", &linear_amx_bf16, NoGil(), "x [M, K] @ w [N, K].T for bf16 w on AMX-BF16 tiles");
  m.def("moe_amx_usable", &kimitui_cpu::moe_amx_usable, NoGil(), "whether moe() may use AMX tiles here");
  m.def("onednn_packed_count", &onednn_packed_count, NoGil(), "bf16 weights kept packed for oneDNN (cpu_onednn_packed.cpp)");
}
