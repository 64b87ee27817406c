// Kimi K3's SiTU, act(gate) * up, in float32 for the C++ CPU MoE kernels (cpu_few_rows, cpu_quant_moe),
// as kernels/activation.py: beta * tanh(g / beta) * sigmoid(g) times linear_beta * tanh(u / linear_beta),
// or u itself when linear_beta <= 0 (None).
#pragma once

#include <cmath>

inline float situ_mul(float g, float u, float beta, float linear_beta) {
  const float up = linear_beta > 0.0f ? linear_beta * std::tanh(u / linear_beta) : u;
  return beta * std::tanh(g / beta) / (1.0f + std::exp(-g)) * up;
}
