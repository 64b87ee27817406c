// A decoder layer's two residual blocks for a batch of decodes, each in one call from Python:
//
// attention_block(x, ...) -> x + o_proj(MLA(input_layernorm(x)))   (writes the newest latents)
// ffn_block(x, ...)       -> x + MoE or MLP(post_attention_layernorm(x))
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

}  // namespace

// MLA's decode for x [B, D]: in_proj [q_width + r + rope, D] is q_a_proj (or q_proj) stacked on
// kv_a_proj_with_mqa; q_norm and q_b are empty without a q LoRA. The rest as mla_decode_absorbed.
torch::Tensor attention_block(torch::Tensor x_in, torch::Tensor positions, torch::Tensor slots, torch::Tensor cache,
                              torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                              torch::Tensor norm, double eps, torch::Tensor in_proj, int64_t q_width,
                              torch::Tensor q_norm, double q_eps, torch::Tensor q_b, int64_t heads,
                              torch::Tensor kv_norm, double kv_eps, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor w_uk, torch::Tensor w_uv, double scale, torch::Tensor o_proj) {
  const auto x = as_f32(x_in, "x", 2);
  TORCH_CHECK(q_width > 0 && q_width < in_proj.size(0), "q_width ", q_width, " does not fit in_proj ",
              in_proj.sizes());
  const int64_t B = x.size(0);
  const QuietTeam quiet(runs_onednn(in_proj, B));  // the products on OpenMP threads, the MLA on the team
  const auto y = ::linear(::rms_norm(x, norm, eps), in_proj);
  auto q = y.slice(1, 0, q_width).contiguous();
  if (q_b.numel()) q = ::linear(::rms_norm(q, q_norm, q_eps), q_b);
  const auto o = ::mla_decode_absorbed(q.view({B, heads, -1}), y.slice(1, q_width).contiguous(), kv_norm, kv_eps, cos,
                                     sin, positions, slots, w_uk, w_uv, cache, block_tables, context_lens, block_size,
                                     scale);
  auto out = ::linear(o.view({B, -1}), o_proj).add_(x);
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
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == torch::kInt64 && counts.is_contiguous() &&
                  counts.numel() == router_w.size(0),
              "counts must be a contiguous int64 CPU tensor of ", router_w.size(0), " experts, got ",
              counts.scalar_type(), " ", counts.sizes());
  const auto [ids, weights] = ::moe_route(h, router_w, bias, top_k, n_group, topk_group, sigmoid, norm_topk, scaling);
  int64_t* c = counts.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) ++c[id[i]];
  auto y = ::moe(h, ids, weights, w13, w2, scratch);
  if (gate_up.numel()) y.add_(swiglu(h, gate_up, down));
  y.add_(x);
  return dtype == torch::kFloat32 ? y : y.to(dtype);
}
