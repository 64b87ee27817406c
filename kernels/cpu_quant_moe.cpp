// SwiGLU MoE over packed INT4 / MXFP4 experts on the CPU: one call runs a layer's experts for every
// token of a step, reading the checkpoint's packed weights and dequantising them in registers
// (cpu_quant_moe_isa.cpp), float32 sums.
//
// Phase 1 computes h = act(gate, up) (SiLU's silu(gate) * up, or Kimi K3's SiTU) for each (token,
// expert) pair, phase 2 y = w2 @ h, then each token adds its weighted pairs in ascending expert
// order, as kernels/reference.py's _moe_grouped.
// Work items are (expert, 16 weight rows); threads take the next free item from an atomic counter, so
// an expert with many tokens does not leave the other threads idle at the end of a phase.
// Built on first use by kernels/cpu_quant_moe.py.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_quant_moe_common.h"

namespace cpu_quant_moe {
float g_e8m0[256];
}
using namespace cpu_quant_moe;

namespace {

// nibble -> value: INT4 stores q + 8; E2M1 (bit 3 the sign) as in the OCP MX spec.
const float kInt4Lut[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
const float kE2M1Lut[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kScalar;
}

int vector_width(int64_t isa) { return isa == kAvx2 ? 8 : 16; }

RowsDot rows_dot_for(int64_t isa) {
  return isa == kAvx512 ? rows_dot_avx512 : isa == kAvx2 ? rows_dot_avx2 : rows_dot_scalar;
}

// Where column j of an activation row goes: within each 32-column group, each run of w bytes of the
// packed weight puts its low-nibble (even) columns first, then its odd ones, as dequant32 decodes them.
inline int64_t activation_position(int64_t j, int w) {
  const int64_t g = j / 32, i = j % 32, b = i / 2;
  return g * 32 + (b / w) * 2 * w + (i % 2) * w + b % w;
}

// fn(i, scratch) for i in [0, n), each i taken by whichever thread is free next.
template <class F>
void for_each_item(int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)));
#pragma omp parallel num_threads(threads)
  {
    Scratch s;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, s);
  }
}

// Expert e's matrix of a stacked [E, N, *] packed weight and its [E, N, groups] scales.
QMat expert_matrix(const torch::Tensor& packed, const torch::Tensor& scale, int64_t e, bool mxfp4, int64_t group,
                   int64_t K) {
  const int64_t row_bytes = packed.size(2) * packed.element_size(), n = packed.size(1);
  const auto* data = static_cast<const uint8_t*>(packed.data_ptr()) + e * n * row_bytes;
  const auto* sc = static_cast<const uint8_t*>(scale.data_ptr()) + e * n * scale.size(2) * scale.element_size();
  return QMat{data, row_bytes, sc, scale.size(2), mxfp4, group, K, mxfp4 ? kE2M1Lut : kInt4Lut};
}

// The gated activation of phase 1's epilogue, as kernels/activation.py: SiLU (act 0) silu(g) * u, or
// SiTU (act 1) beta * tanh(g / beta) * sigmoid(g) times linear_beta * tanh(u / linear_beta) (u itself
// when linear_beta <= 0, i.e. None), all in float32.
struct GatedAct {
  int64_t act;
  float beta, linear_beta;
  float operator()(float g, float u) const {
    if (act == 0) return g / (1.0f + std::exp(-g)) * u;
    const float gate = beta * std::tanh(g / beta) / (1.0f + std::exp(-g));
    return gate * (linear_beta > 0.0f ? linear_beta * std::tanh(u / linear_beta) : u);
  }
};

}  // namespace

// x [T, D] float32, topk_ids [T, k] int64 (ids outside [0, E): computed elsewhere, add nothing),
// topk_weights [T, k] float32; w13 [E, 2I, *] (gate rows, then up), w2 [E, D, *] packed as described
// in cpu_quant_moe_isa.cpp, contiguous; act, beta, linear_beta: the gated activation (GatedAct).
// -> [T, D] float32. Shapes are checked by cpu_quant_moe.py.
torch::Tensor moe(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                  const torch::Tensor& w13, const torch::Tensor& w13_scale, const torch::Tensor& w2,
                  const torch::Tensor& w2_scale, bool mxfp4, int64_t group, int64_t isa, int64_t act, double beta,
                  double linear_beta) {
  const GatedAct gated{act, static_cast<float>(beta), static_cast<float>(linear_beta)};
  const int64_t T = x.size(0), D = x.size(1), k = topk_ids.size(1), E = w13.size(0), I = w13.size(1) / 2;
  const int64_t Dp = (D + 31) / 32 * 32, Ip = (I + 31) / 32 * 32;
  const int w = vector_width(isa);
  const RowsDot rows_dot = rows_dot_for(isa);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* tw = topk_weights.data_ptr<float>();

  // Pairs grouped by expert (counting sort, token order within an expert): q in [start[e], start[e + 1]).
  std::vector<int64_t> start(E + 1, 0), slot_pair(T * k, -1);
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) ++start[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t P = start[E];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), pair_token(P);
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) {
      slot_pair[i] = fill[ids[i]]++;
      pair_token[slot_pair[i]] = i / k;
    }

  // Activations as float32 rows in the kernels' column order, zero-padded to whole 32-column groups.
  auto opts = x.options().dtype(torch::kFloat32);
  torch::Tensor xp = torch::zeros({T, Dp}, opts), h = torch::zeros({std::max<int64_t>(P, 1), Ip}, opts);
  torch::Tensor y = torch::empty({std::max<int64_t>(P, 1), D}, opts), out = torch::zeros({T, D}, opts);
  const float* xs = x.data_ptr<float>();
  float *xpd = xp.data_ptr<float>(), *hd = h.data_ptr<float>(), *yd = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < D; ++j) xpd[t * Dp + activation_position(j, w)] = xs[t * D + j];
  });
  std::vector<const float*> x_rows(P), h_rows(P);
  for (int64_t q = 0; q < P; ++q) {
    x_rows[q] = xpd + pair_token[q] * Dp;
    h_rows[q] = hd + q * Ip;
  }

  // (expert, first row) work items of a phase, over the experts that have pairs.
  auto items = [&](int64_t rows) {
    std::vector<std::pair<int64_t, int64_t>> v;
    for (int64_t e = 0; e < E; ++e)
      if (start[e + 1] > start[e])
        for (int64_t r = 0; r < rows; r += kTileRows) v.emplace_back(e, r);
    return v;
  };

  const auto up_items = items(I);
  for_each_item(static_cast<int64_t>(up_items.size()), [&](int64_t i, Scratch& s) {
    const auto [e, j0] = up_items[i];
    const int nr = static_cast<int>(std::min<int64_t>(kTileRows, I - j0));
    const int nc = static_cast<int>(start[e + 1] - start[e]);
    const QMat m = expert_matrix(w13, w13_scale, e, mxfp4, group, D);
    std::vector<float> gu(2 * static_cast<size_t>(nc) * kTileRows);  // [gate | up][token][row]
    float* up = gu.data() + static_cast<int64_t>(nc) * kTileRows;
    rows_dot(m, j0, nr, x_rows.data() + start[e], nc, gu.data(), kTileRows, s);
    rows_dot(m, I + j0, nr, x_rows.data() + start[e], nc, up, kTileRows, s);
    for (int c = 0; c < nc; ++c) {
      float* hrow = hd + (start[e] + c) * Ip;
      for (int r = 0; r < nr; ++r) {
        hrow[activation_position(j0 + r, w)] = gated(gu[c * kTileRows + r], up[c * kTileRows + r]);
      }
    }
  });

  const auto down_items = items(D);
  for_each_item(static_cast<int64_t>(down_items.size()), [&](int64_t i, Scratch& s) {
    const auto [e, d0] = down_items[i];
    const int nr = static_cast<int>(std::min<int64_t>(kTileRows, D - d0));
    const int nc = static_cast<int>(start[e + 1] - start[e]);
    const QMat m = expert_matrix(w2, w2_scale, e, mxfp4, group, I);
    rows_dot(m, d0, nr, h_rows.data() + start[e], nc, yd + start[e] * D + d0, D, s);
  });

  // Each token: its pairs' outputs times their weights, added in ascending expert order.
  float* od = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) slots[j] = t * k + j;
      std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      for (int64_t sl : slots) {
        if (slot_pair[sl] < 0) continue;
        const float* yr = yd + slot_pair[sl] * D;
        const float wt = tw[sl];
        for (int64_t d = 0; d < D; ++d) od[t * D + d] += yr[d] * wt;
      }
    }
  });
  return out;
}

const char* isa_name(int64_t isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2+fma" : "scalar"; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (int b = 0; b < 256; ++b)
    g_e8m0[b] = b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, b - 127);
  m.def("moe", &moe, "gated (SiLU / SiTU) MoE over packed INT4 / MXFP4 experts on the CPU (float32 activations)");
  m.def("best_isa", &best_isa, "the widest instruction set path this CPU runs: 2 AVX-512, 1 AVX2+FMA, 0 portable");
  m.def("isa_name", &isa_name, "the name of an instruction set path");
}
