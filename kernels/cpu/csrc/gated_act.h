// Kimi K3's SiTU, act(gate) * up, in float32 for the C++ CPU kernels (cpu_few_rows, cpu_quant_moe,
// cpu_k3_decode), as kernels/activation.py: beta * tanh(g / beta) * sigmoid(g) times
// linear_beta * tanh(u / linear_beta), or u itself when linear_beta <= 0 (None). Also the exp, sigmoid
// and tanh the K3 kernels build on.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) in float32 with no library call, so that a loop of it vectorises (GCC vectorises std::exp
// only under -ffast-math): Cephes expf's reduction x = n ln2 + r (ln2 in two parts) and degree-6
// polynomial, 2^n written into the exponent bits, as exp8 in cpu_few_rows.h. Within 2 ulp of expf.
// x is clamped to [-87.3, 88.3]: where expf gives 0 (below -103) or inf (above 88.7) this gives about
// 1e-38 or 2e38, which every caller (sigmoid, tanh, KDA's decays exp(g <= 0)) turns into the same 0, 1
// or -1 up to rounding.
inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  // n = round(x / ln2) by adding and removing 1.5 * 2^23 (std::floor / nearbyint would not vectorise)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// tanh(x): Cephes tanhf's odd polynomial below |x| 0.625, 1 - 2 / (exp(2|x|) + 1) with x's sign above
// (no cancellation there: the result is at least 0.55). Within a few ulp of tanhf; branch-free, so
// loops of it vectorise.
inline float tanh_f32(float x) {
  const float a = std::fabs(x), z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float big = std::copysign(1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f), x);
  return a < 0.625f ? small : big;
}

inline float situ_mul(float g, float u, float beta, float linear_beta) {
  const float up = linear_beta > 0.0f ? linear_beta * tanh_f32(u / linear_beta) : u;
  return beta * tanh_f32(g / beta) * sigmoid_f32(g) * up;
}
