// A decoder layer's two residual blocks for a batch of decodes, each in one call from Python:
//
// attention_block(x, ...) -> x + o_proj(MLA(input_layernorm(x)))   (writes the newest latents)
// ffn_block(x, ...)       -> x + MoE or MLP(post_attention_layernorm(x))
// packed_ffn_block(x, ...) -> the same for a MoE whose routed experts are packed tiles (INT4 / MXFP4)
//
// They chain the same kernels the layer calls one by one (linear, rms_norm, mla_decode_absorbed,
// moe_route, moe, and ATen's silu and mul), in the same order, so the results are bit for bit those
// of the unfused layer. What goes is the Python between the kernels: about 20 module calls and
// dispatch checks per layer, 2-3 ms of a 16-18 ms single-request step of the benchmark model.
//
// A bf16 model's blocks take and return bf16 x and read bf16 matrices (and a bf16 latent cache);
// its norm weights, rotary tables and router come as float32 (cast once when the layer is fused).
// Inside a block the activations stay float32: x is widened on entry, every product sums in
// float32, and only the block's output (x plus the half's result, added in float32) is rounded to
// bf16, once; the bf16 PyTorch path rounds after every operation instead.
//
// Part of the cpu_few_rows extension (see cpu_few_rows.cpp).

#include "cpu_few_rows.h"

using namespace kimitui_cpu;

namespace {

// down(silu(gate) * up), [gate; up] = gate_up @ h (MLP.forward with its fused gate_up weight).
torch::Tensor swiglu(const torch::Tensor& h, const torch::Tensor& gate_up, const torch::Tensor& down) {
  const auto gu = ::linear(h, gate_up);
  const int64_t I = gu.size(1) / 2;
  return ::linear(at::silu(gu.slice(1, 0, I)) * gu.slice(1, I), down);
}

// The router's top-k ids and weights for h, each token's experts counted into counts [E] (int64).
std::tuple<torch::Tensor, torch::Tensor> route_and_count(const torch::Tensor& h, const torch::Tensor& counts,
                                                         const torch::Tensor& router_w, const torch::Tensor& bias,
                                                         int64_t top_k, int64_t n_group, int64_t topk_group,
                                                         bool sigmoid, bool norm_topk, double scaling) {
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == torch::kInt64 && counts.is_contiguous() &&
                  counts.numel() == router_w.size(0),
              "counts must be a contiguous int64 CPU tensor of ", router_w.size(0), " experts, got ",
              counts.scalar_type(), " ", counts.sizes());
  auto routed = ::moe_route(h, router_w, bias, top_k, n_group, topk_group, sigmoid, norm_topk, scaling);
  const auto& ids = std::get<0>(routed);
  int64_t* c = counts.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) ++c[id[i]];
  return routed;
}

// down(act(gate) * up), [gate; up] = gate_up @ h, for SiLU (act 0) or SiTU (act 1, see gated_mul).
torch::Tensor gated_mlp(const torch::Tensor& h, const torch::Tensor& gate_up, const torch::Tensor& down, int64_t act,
                        double beta, double linear_beta) {
  if (act == 0) return swiglu(h, gate_up, down);
  const auto gu = ::linear(h, gate_up);
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto a = torch::empty({T, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    gated_mul(g + t * 2 * I, g + t * 2 * I + I, a.data_ptr<float>() + t * I, I, act, static_cast<float>(beta),
              static_cast<float>(linear_beta));
  return ::linear(a, down);
}

// The packed-experts extension's two MoE entry points, set once by use_packed_experts.
PackedExperts g_packed_experts[2] = {nullptr, nullptr};  // [float products, W4A8]
// The K3 decode extension's kda_decode, set once by use_kda_decode.
KdaDecode g_kda_decode = nullptr;

}  // namespace

// MLA's decode for x [B, D]: in_proj [q_width + r + rope, D] is q_a_proj (or q_proj) stacked on
// kv_a_proj_with_mqa; q_norm and q_b are empty without a q LoRA. The rest as mla_decode_absorbed
// (cos and sin empty: NoPE). Kimi Linear / K3's form: norm empty (x comes normed), gate [H * v, D]
// (the output gate: o_proj(sigmoid(gate @ x) * attention)) and residual false (the output alone).
torch::Tensor attention_block(torch::Tensor x_in, torch::Tensor positions, torch::Tensor slots, torch::Tensor cache,
                              torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                              torch::Tensor norm, double eps, torch::Tensor in_proj, int64_t q_width,
                              torch::Tensor q_norm, double q_eps, torch::Tensor q_b, int64_t heads,
                              torch::Tensor kv_norm, double kv_eps, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor w_uk, torch::Tensor w_uv, double scale, torch::Tensor o_proj,
                              torch::Tensor gate, bool residual) {
  const auto x = as_f32(x_in, "x", 2);
  TORCH_CHECK(q_width > 0 && q_width < in_proj.size(0), "q_width ", q_width, " does not fit in_proj ",
              in_proj.sizes());
  const int64_t B = x.size(0);
  const QuietTeam quiet(runs_onednn(in_proj, B));  // the products on OpenMP threads, the MLA on the team
  const auto h = norm.numel() ? ::rms_norm(x, norm, eps) : x;
  const auto y = ::linear(h, in_proj);
  auto q = y.slice(1, 0, q_width).contiguous();
  if (q_b.numel()) q = ::linear(::rms_norm(q, q_norm, q_eps), q_b);
  auto o = ::mla_decode_absorbed(q.view({B, heads, -1}), y.slice(1, q_width).contiguous(), kv_norm, kv_eps, cos,
                                 sin, positions, slots, w_uk, w_uv, cache, block_tables, context_lens, block_size,
                                 scale)
               .view({B, -1});
  if (gate.numel()) o = o.mul(::linear(h, gate).sigmoid_());
  auto out = ::linear(o, o_proj);
  if (residual) out.add_(x);
  return x_in.scalar_type() == torch::kFloat32 ? out : out.to(x_in.scalar_type());
}

// A KDA layer's decode step (engine/layers/kda.py) for x [N, D] already normed, one token of each of N
// sequences in its state slot: in_proj [3P + hd + H + G, D] is q | k | v, f_a_proj, b_proj and the
// output gate's input (G = P: K3's full-rank g_proj; G = hd: Kimi Linear's g_a_proj, then g_b [P, hd]),
// f_b [P, hd] f_b_proj; the step between the projections is the K3 extension's kda_decode (linked by
// use_kda_decode), then o_proj [D, P]. Float32 inside, the output (no residual) rounded to x's dtype.
torch::Tensor kda_block(torch::Tensor x_in, torch::Tensor slots, torch::Tensor conv_state, torch::Tensor rec_state,
                        torch::Tensor in_proj, int64_t heads, int64_t head_dim, torch::Tensor f_b, torch::Tensor g_b,
                        torch::Tensor conv_weight, torch::Tensor A_log, torch::Tensor dt_bias, double lower_bound,
                        torch::Tensor norm_weight, double eps, double scale, torch::Tensor o_proj) {
  TORCH_CHECK(g_kda_decode != nullptr, "kda_block: the K3 decode extension has not been linked in (use_kda_decode)");
  const auto x = as_f32(x_in, "x", 2);
  const int64_t P = heads * head_dim, gate_width = g_b.numel() ? head_dim : P;
  TORCH_CHECK(in_proj.dim() == 2 && in_proj.size(0) == 3 * P + head_dim + heads + gate_width, "kda_block: in_proj ",
              in_proj.sizes(), " is not q | k | v | f_a | b | gate for ", heads, " heads of ", head_dim);
  const QuietTeam quiet(runs_onednn(in_proj, x.size(0)));
  const auto y = ::linear(x, in_proj);
  const int64_t f0 = 3 * P, b0 = f0 + head_dim, g0 = b0 + heads;
  const auto f = ::linear(y.slice(1, f0, b0).contiguous(), f_b);
  const auto g_in = y.slice(1, g0, g0 + gate_width);
  const auto g = g_b.numel() ? ::linear(g_in.contiguous(), g_b) : g_in.contiguous();
  const auto o = g_kda_decode(y.slice(1, 0, f0), f, y.slice(1, b0, g0).contiguous(), g, conv_weight, A_log, dt_bias,
                              lower_bound, norm_weight, eps, conv_state, rec_state, slots, scale);
  const auto out = ::linear(o, o_proj);
  return x_in.scalar_type() == torch::kFloat32 ? out : out.to(x_in.scalar_type());
}

// The feed-forward half for x [T, D]. With a router (router_w not empty): routed SwiGLU experts
// w13 [E, 2I, D], w2 [E, D, I], plus the shared experts (gate_up, down) when given; each token's
// experts are counted into counts [E] (int64). Without one: the dense MLP (gate_up, down).
torch::Tensor ffn_block(torch::Tensor x_in, torch::Tensor counts, torch::Tensor norm, double eps, torch::Tensor gate_up,
                        torch::Tensor down, torch::Tensor router_w, torch::Tensor bias, int64_t top_k,
                        int64_t n_group, int64_t topk_group, bool sigmoid, bool norm_topk, double scaling,
                        torch::Tensor w13, torch::Tensor w2, torch::Tensor scratch) {
  const auto x = as_f32(x_in, "x", 2);
  const auto dtype = x_in.scalar_type();
  // the dense products on OpenMP threads (oneDNN), the routed experts on the team (or OpenMP)
  const QuietTeam quiet(runs_onednn(router_w.numel() ? w13 : gate_up, x.size(0)));
  const auto h = ::rms_norm(x, norm, eps);
  if (!router_w.numel()) {
    auto y = swiglu(h, gate_up, down).add_(x);
    return dtype == torch::kFloat32 ? y : y.to(dtype);
  }
  const auto [ids, weights] =
      route_and_count(h, counts, router_w, bias, top_k, n_group, topk_group, sigmoid, norm_topk, scaling);
  auto y = ::moe(h, ids, weights, w13, w2, scratch);
  if (gate_up.numel()) y.add_(swiglu(h, gate_up, down));
  y.add_(x);
  return dtype == torch::kFloat32 ? y : y.to(dtype);
}

// Kimi Linear / K3's MoE (engine/layers/latent_moe.py) for x [T, D], already normed: the router on x (its
// experts counted into counts), the routed experts (packed, as packed_ffn_block's) in the latent space
// down [L, D] projects to, their sum normed (norm [L], when given) and projected back by up [D, L], plus
// the shared experts (gate_up, shared_down) with the same gated activation; without down / up (Kimi
// Linear) the experts see x itself. Float32 inside, the result rounded to x's dtype once; no residual.
torch::Tensor latent_moe_block(torch::Tensor x_in, torch::Tensor counts, torch::Tensor router_w, torch::Tensor bias,
                               int64_t top_k, int64_t n_group, int64_t topk_group, bool sigmoid, bool norm_topk,
                               double scaling, torch::Tensor down, torch::Tensor norm, double eps, torch::Tensor up,
                               torch::Tensor gate_up, torch::Tensor shared_down, bool w4a8, torch::Tensor w13,
                               torch::Tensor w2, int64_t inter, bool mxfp4, int64_t path, int64_t act, double beta,
                               double linear_beta) {
  const PackedExperts experts = g_packed_experts[w4a8 ? 1 : 0];
  TORCH_CHECK(experts != nullptr, "latent_moe_block: the packed-experts extension has not been linked in "
              "(use_packed_experts)");
  TORCH_CHECK(down.numel() == 0 || up.numel() != 0, "latent_moe_block: a latent down projection needs its up");
  const auto x = as_f32(x_in, "x", 2);
  const auto dtype = x_in.scalar_type();
  const auto [ids, weights] =
      route_and_count(x, counts, router_w, bias, top_k, n_group, topk_group, sigmoid, norm_topk, scaling);
  const auto z = down.numel() ? ::linear(x, down) : x;
  auto y = experts(dtype == torch::kFloat32 ? z : z.to(dtype), ids, weights, w13, w2, inter, mxfp4, path, act, beta,
                   linear_beta);
  if (up.numel()) y = ::linear(norm.numel() ? ::rms_norm(y, norm, eps) : y, up);
  if (gate_up.numel()) y.add_(gated_mlp(x, gate_up, shared_down, act, beta, linear_beta));
  return dtype == torch::kFloat32 ? y : y.to(dtype);
}

void kimitui_cpu::use_kda_decode(KdaDecode kda_decode) { g_kda_decode = kda_decode; }

void kimitui_cpu::use_packed_experts(PackedExperts floats, PackedExperts w4a8) {
  g_packed_experts[0] = floats;
  g_packed_experts[1] = w4a8;
}

// ffn_block's MoE with the routed experts in the packed-experts extension's tile layout (w13, w2 uint8
// [E, bytes] of `inter`-wide experts, INT4 or MXFP4), multiplied by its float products (w4a8 false;
// `path` an instruction-set path) or its W4A8 ones (`path` an int8 path); act, beta and linear_beta its
// gated activation. As ffn_block, the norm, the router, the shared experts (SiLU) and the sums run in
// float32 and the output is rounded to x's dtype once; the experts take the normed rows in x's dtype,
// as they do when the layer runs op by op.
torch::Tensor packed_ffn_block(torch::Tensor x_in, torch::Tensor counts, torch::Tensor norm, double eps,
                               torch::Tensor gate_up, torch::Tensor down, torch::Tensor router_w, torch::Tensor bias,
                               int64_t top_k, int64_t n_group, int64_t topk_group, bool sigmoid, bool norm_topk,
                               double scaling, bool w4a8, torch::Tensor w13, torch::Tensor w2, int64_t inter,
                               bool mxfp4, int64_t path, int64_t act, double beta, double linear_beta) {
  const PackedExperts experts = g_packed_experts[w4a8 ? 1 : 0];
  TORCH_CHECK(experts != nullptr, "packed_ffn_block: the packed-experts extension has not been linked in "
              "(use_packed_experts)");
  TORCH_CHECK(router_w.numel(), "packed_ffn_block needs a router");
  const auto x = as_f32(x_in, "x", 2);
  const auto dtype = x_in.scalar_type();
  const auto h = ::rms_norm(x, norm, eps);
  const auto [ids, weights] =
      route_and_count(h, counts, router_w, bias, top_k, n_group, topk_group, sigmoid, norm_topk, scaling);
  auto y = experts(dtype == torch::kFloat32 ? h : h.to(dtype), ids, weights, w13, w2, inter, mxfp4, path, act, beta,
                   linear_beta);
  if (gate_up.numel()) y.add_(swiglu(h, gate_up, down));
  y.add_(x);
  return dtype == torch::kFloat32 ? y : y.to(dtype);
}
