// The K3 decode extension's kda_decode (cpu_k3_decode.cpp: a KDA layer's step between its projections),
// handed to the few-row extension by pointer (its use_kda_decode), so that its kda_block runs a whole
// KDA layer's decode with no Python between. Both extensions are built by one build against one torch.
#pragma once

#include <torch/extension.h>

namespace kimitui_cpu {

// qkv, f_b, b, gate, conv_weight, A_log, dt_bias, lower_bound, norm_weight, eps, conv_state, rec_state,
// slots, scale (see cpu_k3_decode.cpp)
using KdaDecode = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                    torch::Tensor, torch::Tensor, double, torch::Tensor, double, torch::Tensor,
                                    torch::Tensor, torch::Tensor, double);
// The name of the Python capsule that carries it.
constexpr const char* kKdaDecodeCapsule = "kimitui_cpu.KdaDecode";

}  // namespace kimitui_cpu
