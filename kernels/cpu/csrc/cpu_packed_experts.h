// The packed-expert extension's MoE over its tile layout (cpu_quant_moe.cpp's moe and moe_w4a8: x, topk
// ids, topk weights, w13 and w2 tiles, inter, mxfp4, instruction-set path, act, beta, linear_beta), handed
// to the few-row extension by pointer (its use_packed_experts), so that its packed_ffn_block calls the
// experts with no Python between. Both extensions are built by one build against one torch.
#pragma once

#include <torch/extension.h>

namespace kimitui_cpu {

using PackedExperts = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                        const torch::Tensor&, const torch::Tensor&, int64_t, bool, int64_t, int64_t,
                                        double, double);
// The names of the Python capsules that carry the float and the W4A8 PackedExperts.
constexpr const char* kPackedExpertsCapsule = "kimitui_cpu.PackedExperts";
constexpr const char* kPackedExpertsW4a8Capsule = "kimitui_cpu.PackedExpertsW4A8";

}  // namespace kimitui_cpu
