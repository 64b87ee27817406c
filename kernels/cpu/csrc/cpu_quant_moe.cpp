// SwiGLU MoE over packed INT4 / MXFP4 experts on the CPU: one call runs a layer's experts for every
// token of a step, streaming the experts' tiles (kernels/cpu/quant_moe_layout.py) and decoding the
// 4-bit codes in registers (cpu_quant_moe_isa.cpp), float32 sums.
//
// Phase 1 computes h = act(gate, up) (SiLU's silu(gate) * up, or Kimi K3's SiTU) for each (token, expert) pair, phase 2 y = w2 @ h, then each token
// adds its weighted pairs in ascending expert order, as kernels/reference/__init__.py's _moe_grouped. Work items
// are (expert, 16-row tile); threads take the next free item from an atomic counter, so an expert with
// many tokens does not leave the other threads idle at the end of a phase. Within an item every token of
// the expert is computed from the same tile (re-read from cache per block of tokens), so a tile leaves
// memory once per step whatever the batch.
//
// Activations: bf16 ones on the avx512bf16 path stay bf16 (vdpbf16ps), and h is rounded to bf16 for
// phase 2 as a bf16 model computes it; everywhere else activations and h are float32.
// Built on first use by kernels/cpu/quant_moe.py.
#include <torch/extension.h>

#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_packed_experts.h"  // experts_capsules
#include "cpu_parallel.h"  // parallel_runs
#include "cpu_quant_moe_common.h"
#include "gated_act.h"

namespace cpu_quant_moe {
float g_e8m0[256];
}
using namespace cpu_quant_moe;

namespace {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

// AMX tiles may be used (cpu_amx.h: cpuid, XCR0, the Linux permission request) and this build has the
// tile kernel. Any refusal leaves avx512bf16.
bool amx_bf16_usable() { return kAmxBuilt && kimitui_amx::amx_bf16_usable(); }

int64_t best_isa() {
  static const int64_t best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512bf16"))
      return amx_bf16_usable() ? kAmxBf16 : kAvx512Bf16;
    if (__builtin_cpu_supports("avx512f")) return kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
    return kScalar;
  }();
  return best;
}

TileDotF32 f32_kernel(int64_t isa) {
  return isa >= kAvx512 ? tile_dot_avx512 : isa == kAvx2 ? tile_dot_avx2 : tile_dot_scalar;
}

inline uint16_t bf16_bits(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// fn(i) for i in [0, n), in runs of consecutive items taken by whichever thread is free next
// (kimitui_cpu::parallel_runs); a phase always goes to the threads, whatever it reads.
template <class F>
void for_each_item(int64_t n, F&& fn) {
  kimitui_cpu::parallel_runs(n, kimitui_cpu::kAlwaysSplit, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) fn(i);
  });
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Expert e's matrix with K input columns of a [E, bytes] tile tensor.
Tiles expert_tiles(const torch::Tensor& t, int64_t e, int64_t K, bool mxfp4) {
  const int64_t groups = ceil_div(K, 32);
  const int64_t scale_block = ceil_div(groups * kTileRows * (mxfp4 ? 1 : 2), 64) * 64;
  return Tiles{t.data_ptr<uint8_t>() + e * t.size(1), scale_block + groups * 256, scale_block, groups, mxfp4};
}

// The gated activation of phase 1's epilogue, as kernels/activation.py: SiLU (act 0) silu(g) * u, or
// SiTU (act 1, gated_act.h), in float32.
struct GatedAct {
  int64_t act;
  float beta, linear_beta;
  float operator()(float g, float u) const {
    return act == 0 ? g / (1.0f + std::exp(-g)) * u : situ_mul(g, u, beta, linear_beta);
  }
};

// Activation rows of one phase in the kernels' format: float32 or bf16 bits, zero past the columns.
struct Rows {
  std::vector<const float*> f32;
  std::vector<const uint16_t*> bf16;
};

// A step's (token, expert) pairs grouped by expert (counting sort, token order within an expert): pair q
// of expert e in [start[e], start[e + 1]); slot_pair[t * k + j] the pair of token t's j-th id (-1: an
// id outside [0, E)), pair_token[q] its token.
struct PairGroups {
  std::vector<int64_t> start, slot_pair, pair_token;
  int64_t P;
};

PairGroups group_pairs(const int64_t* ids, int64_t T, int64_t k, int64_t E) {
  PairGroups pg{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(T * k, -1), {}, 0};
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) ++pg.start[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) pg.start[e + 1] += pg.start[e];
  pg.P = pg.start[E];
  std::vector<int64_t> fill(pg.start.begin(), pg.start.end() - 1);
  pg.pair_token.resize(pg.P);
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) {
      pg.slot_pair[i] = fill[ids[i]]++;
      pg.pair_token[pg.slot_pair[i]] = i / k;
    }
  return pg;
}

// (expert, tile) work items of a phase, over the experts that have pairs.
std::vector<std::pair<int64_t, int64_t>> work_items(const std::vector<int64_t>& start, int64_t tiles) {
  std::vector<std::pair<int64_t, int64_t>> v;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e)
    if (start[e + 1] > start[e])
      for (int64_t t = 0; t < tiles; ++t) v.emplace_back(e, t);
  return v;
}

// Each token: its pairs' outputs y [P, D] times their weights, added to od [T, D] in ascending expert order.
void combine_pairs(const PairGroups& pg, const int64_t* ids, const float* tw, int64_t T, int64_t k, int64_t D,
                   const float* yd, float* od) {
  kimitui_cpu::parallel_runs(T, T * k * D * static_cast<int64_t>(sizeof(float)), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) slots[j] = t * k + j;
      std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      for (int64_t sl : slots) {
        if (pg.slot_pair[sl] < 0) continue;
        const float* yr = yd + pg.slot_pair[sl] * D;
        const float wt = tw[sl];
        for (int64_t d = 0; d < D; ++d) od[t * D + d] += yr[d] * wt;
      }
    }
  });
}

}  // namespace

// x [T, D] float32 or bf16, topk_ids [T, k] int64 (ids outside [0, E): computed elsewhere, add nothing),
// topk_weights [T, k] float32; w13 [E, bytes] uint8 (gate tiles, then up tiles), w2 [E, bytes] in the tile
// layout, contiguous; I the expert width; act, beta, linear_beta: the gated activation (GatedAct).
// -> [T, D] float32. Shapes are checked by cpu_quant_moe.py.
torch::Tensor moe(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                  const torch::Tensor& w13, const torch::Tensor& w2, int64_t I, bool mxfp4, int64_t isa, int64_t act,
                  double beta, double linear_beta) {
  const GatedAct gated{act, static_cast<float>(beta), static_cast<float>(linear_beta)};
  // best_isa() also makes the Linux tile permission request: no tile instruction runs before it
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "cpu_quant_moe: instruction set path ", isa, " is not one this CPU runs");
  const int64_t T = x.size(0), D = x.size(1), k = topk_ids.size(1), E = w13.size(0);
  const int64_t Dp = ceil_div(D, 32) * 32, Ip = ceil_div(I, 32) * 32;
  const int64_t tiles_i = ceil_div(I, kTileRows), tiles_d = ceil_div(D, kTileRows);
  const bool bf16 = isa >= kAvx512Bf16 && x.scalar_type() == torch::kBFloat16;
  const bool amx = bf16 && isa == kAmxBf16;
  const TileDotF32 dot32 = f32_kernel(isa);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* tw = topk_weights.data_ptr<float>();

  const PairGroups pg = group_pairs(ids, T, k, E);
  const std::vector<int64_t>& start = pg.start;
  const std::vector<int64_t>& pair_token = pg.pair_token;
  const int64_t P = pg.P;

  // Activations zero-padded to whole 32-column groups; h likewise (its padding is never written). The
  // AMX path reads phase 1's rows per pair (a copy of each pair's token row, so an expert's rows are
  // contiguous: one strided tile load).
  auto f32 = x.options().dtype(torch::kFloat32);
  const auto act_dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor xp = torch::zeros({T, Dp}, x.options().dtype(act_dtype));
  xp.narrow(1, 0, D).copy_(x);
  torch::Tensor xq;
  if (amx) {
    xq = torch::zeros({std::max<int64_t>(P, 1), Dp}, x.options().dtype(act_dtype));
    if (P > 0) xq.narrow(0, 0, P).copy_(xp.index_select(0, torch::from_blob(const_cast<int64_t*>(pair_token.data()), {P}, torch::kInt64)));
  }
  torch::Tensor h = torch::zeros({std::max<int64_t>(P, 1), Ip}, x.options().dtype(act_dtype));
  torch::Tensor y = torch::empty({std::max<int64_t>(P, 1), D}, f32), out = torch::zeros({T, D}, f32);
  const int64_t asize = bf16 ? 2 : 4;
  auto* xb = static_cast<const uint8_t*>(xp.data_ptr());
  auto* hb = static_cast<uint8_t*>(h.data_ptr());
  float* yd = y.data_ptr<float>();
  Rows xr, hr;
  for (int64_t q = 0; q < P; ++q) {
    const uint8_t* xrow = xb + pair_token[q] * Dp * asize;
    const uint8_t* hrow = hb + q * Ip * asize;
    if (bf16) {
      xr.bf16.push_back(reinterpret_cast<const uint16_t*>(xrow));
      hr.bf16.push_back(reinterpret_cast<const uint16_t*>(hrow));
    } else {
      xr.f32.push_back(reinterpret_cast<const float*>(xrow));
      hr.f32.push_back(reinterpret_cast<const float*>(hrow));
    }
  }
  // AMX: rows q0.. of a contiguous buffer (phase 1 xq, phase 2 h) instead of the row pointers.
  struct Contig {
    const uint8_t* base;
    int64_t stride;
  };
  const Contig xc{amx ? static_cast<const uint8_t*>(xq.data_ptr()) : nullptr, Dp * 2}, hc{hb, Ip * 2};
  auto dot = [&](const Tiles& m, int64_t tile, int nr, const Rows& rows, const Contig& cg, int64_t q0, int nc,
                 float* o, int64_t os) {
    if (amx)
      tile_dot_amx_bf16(m, tile, nr, reinterpret_cast<const uint16_t*>(cg.base + q0 * cg.stride), cg.stride, nc, o,
                        os);
    else if (bf16)
      tile_dot_avx512bf16(m, tile, nr, rows.bf16.data() + q0, nc, o, os);
    else
      dot32(m, tile, nr, rows.f32.data() + q0, nc, o, os);
  };

  auto items = [&](int64_t tiles) { return work_items(start, tiles); };

  const auto up_items = items(tiles_i);
  for_each_item(static_cast<int64_t>(up_items.size()), [&](int64_t i) {
    const auto [e, t] = up_items[i];
    const int nr = static_cast<int>(std::min<int64_t>(kTileRows, I - t * kTileRows));
    const int nc = static_cast<int>(start[e + 1] - start[e]);
    const Tiles m = expert_tiles(w13, e, D, mxfp4);
    std::vector<float> gu(2 * static_cast<size_t>(nc) * kTileRows);  // [gate | up][token][row]
    float* up = gu.data() + static_cast<int64_t>(nc) * kTileRows;
    dot(m, t, nr, xr, xc, start[e], nc, gu.data(), kTileRows);
    dot(m, tiles_i + t, nr, xr, xc, start[e], nc, up, kTileRows);
    for (int c = 0; c < nc; ++c) {
      const int64_t at = (start[e] + c) * Ip + t * kTileRows;
      for (int r = 0; r < nr; ++r) {
        const float v = gated(gu[c * kTileRows + r], up[c * kTileRows + r]);
        if (bf16)
          reinterpret_cast<uint16_t*>(hb)[at + r] = bf16_bits(v);
        else
          reinterpret_cast<float*>(hb)[at + r] = v;
      }
    }
  });

  const auto down_items = items(tiles_d);
  for_each_item(static_cast<int64_t>(down_items.size()), [&](int64_t i) {
    const auto [e, t] = down_items[i];
    const int nr = static_cast<int>(std::min<int64_t>(kTileRows, D - t * kTileRows));
    const int nc = static_cast<int>(start[e + 1] - start[e]);
    const Tiles m = expert_tiles(w2, e, I, mxfp4);
    dot(m, t, nr, hr, hc, start[e], nc, yd + start[e] * D + t * kTileRows, D);
  });

  combine_pairs(pg, ids, tw, T, k, D, yd, out.data_ptr<float>());
  return out;
}

// W4A8 int8 dot paths (cpu_quant_moe_w4a8.cpp): 0 portable, 1 AVX-VNNI, 2 AVX-512 VNNI; the widest this CPU
// runs. AVX-VNNI is cpuid leaf 7 subleaf 1, EAX bit 4 (with AVX2, whose OS support the builtin checks).
int64_t best_q8_isa() {
  static const int64_t best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
      return int64_t{2};
    unsigned a = 0, b, c, d;
    if (__builtin_cpu_supports("avx2") && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4)))
      return int64_t{1};
    return int64_t{0};
  }();
  return best;
}

TileDotQ8 q8_kernel(int64_t q8isa) {
  return q8isa == 2 ? tile_dot_q8_avx512vnni : q8isa == 1 ? tile_dot_q8_avxvnni : tile_dot_q8_scalar;
}

// Rows [n, K] (float32 or bf16) quantised per 32-column group, and their kernel views.
struct Q8Rows {
  std::vector<int32_t> q, asum;
  std::vector<float> d;
  int64_t groups;
  Q8Row row(int64_t i) const { return {q.data() + i * groups * 8, d.data() + i * groups, asum.data() + i * groups}; }
};

template <class T>
Q8Rows quantize_rows(const T* x, int64_t n, int64_t K, int64_t stride) {
  Q8Rows r{std::vector<int32_t>(n * ceil_div(K, 32) * 8), std::vector<int32_t>(n * ceil_div(K, 32)),
           std::vector<float>(n * ceil_div(K, 32)), ceil_div(K, 32)};
  kimitui_cpu::parallel_runs(n, n * K * static_cast<int64_t>(sizeof(float)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_q8(x + i * stride, K, r.groups, r.q.data() + i * r.groups * 8, r.d.data() + i * r.groups,
                  r.asum.data() + i * r.groups);
  });
  return r;
}

// The same MoE as moe() with W4A8 products (cpu_quant_moe_w4a8.cpp): x's rows quantised to int8 per
// 32-column group before phase 1, h (float32) before phase 2; q8isa one of best_q8_isa()'s paths.
torch::Tensor moe_w4a8(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                       const torch::Tensor& w13, const torch::Tensor& w2, int64_t I, bool mxfp4, int64_t q8isa,
                       int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(q8isa >= 0 && q8isa <= best_q8_isa(), "cpu_quant_moe: int8 path ", q8isa, " is not one this CPU runs");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "cpu_quant_moe: W4A8 takes float32 or bf16 activations");
  const GatedAct gated{act, static_cast<float>(beta), static_cast<float>(linear_beta)};
  const int64_t T = x.size(0), D = x.size(1), k = topk_ids.size(1), E = w13.size(0);
  const int64_t Ip = ceil_div(I, 32) * 32, tiles_i = ceil_div(I, kTileRows), tiles_d = ceil_div(D, kTileRows);
  const TileDotQ8 dot = q8_kernel(q8isa);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const PairGroups pg = group_pairs(ids, T, k, E);
  const std::vector<int64_t>& start = pg.start;
  const int64_t P = pg.P;

  const Q8Rows xq = x.scalar_type() == torch::kFloat32
                        ? quantize_rows(x.data_ptr<float>(), T, D, D)
                        : quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), T, D, D);
  std::vector<Q8Row> xr(P);
  for (int64_t q = 0; q < P; ++q) xr[q] = xq.row(pg.pair_token[q]);
  std::vector<float> h(std::max<int64_t>(P, 1) * Ip, 0.0f);

  const auto up_items = work_items(start, tiles_i);
  for_each_item(static_cast<int64_t>(up_items.size()), [&](int64_t i) {
    const auto [e, t] = up_items[i];
    const int nr = static_cast<int>(std::min<int64_t>(kTileRows, I - t * kTileRows));
    const int nc = static_cast<int>(start[e + 1] - start[e]);
    const Tiles m = expert_tiles(w13, e, D, mxfp4);
    std::vector<float> gu(2 * static_cast<size_t>(nc) * kTileRows);  // [gate | up][token][row]
    float* up = gu.data() + static_cast<int64_t>(nc) * kTileRows;
    dot(m, t, nr, xr.data() + start[e], nc, gu.data(), kTileRows);
    dot(m, tiles_i + t, nr, xr.data() + start[e], nc, up, kTileRows);
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < nr; ++r)
        h[(start[e] + c) * Ip + t * kTileRows + r] = gated(gu[c * kTileRows + r], up[c * kTileRows + r]);
  });

  const Q8Rows hq = quantize_rows(h.data(), P, I, Ip);
  std::vector<Q8Row> hr(P);
  for (int64_t q = 0; q < P; ++q) hr[q] = hq.row(q);
  std::vector<float> y(std::max<int64_t>(P, 1) * D);
  const auto down_items = work_items(start, tiles_d);
  for_each_item(static_cast<int64_t>(down_items.size()), [&](int64_t i) {
    const auto [e, t] = down_items[i];
    const int nr = static_cast<int>(std::min<int64_t>(kTileRows, D - t * kTileRows));
    const int nc = static_cast<int>(start[e + 1] - start[e]);
    const Tiles m = expert_tiles(w2, e, I, mxfp4);
    dot(m, t, nr, hr.data() + start[e], nc, y.data() + start[e] * D + t * kTileRows, D);
  });

  torch::Tensor out = torch::zeros({T, D}, x.options().dtype(torch::kFloat32));
  combine_pairs(pg, ids, topk_weights.data_ptr<float>(), T, k, D, y.data(), out.data_ptr<float>());
  return out;
}

// One matrix's W4A8 product, for tests: x [T, K] float32 times tiles [1, bytes] of N rows -> [T, N] float32.
torch::Tensor matmul_w4a8(const torch::Tensor& x, const torch::Tensor& tiles, int64_t N, bool mxfp4, int64_t q8isa) {
  TORCH_CHECK(q8isa >= 0 && q8isa <= best_q8_isa(), "cpu_quant_moe: int8 path ", q8isa, " is not one this CPU runs");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "matmul_w4a8: x must be contiguous float32");
  const int64_t T = x.size(0), K = x.size(1);
  const Q8Rows xq = quantize_rows(x.data_ptr<float>(), T, K, K);
  std::vector<Q8Row> xr(T);
  for (int64_t i = 0; i < T; ++i) xr[i] = xq.row(i);
  const Tiles m = expert_tiles(tiles, 0, K, mxfp4);
  torch::Tensor out = torch::empty({T, N}, x.options());
  for (int64_t t = 0; t < ceil_div(N, kTileRows); ++t) {
    const int nr = static_cast<int>(std::min<int64_t>(kTileRows, N - t * kTileRows));
    q8_kernel(q8isa)(m, t, nr, xr.data(), static_cast<int>(T), out.data_ptr<float>() + t * kTileRows, N);
  }
  return out;
}

// Checkpoint rows [row0, row0 + N) of packed [E, rows, bytes] (uint8 view: byte b holds columns 2b (low
// nibble) and 2b + 1, for INT4's little-endian int32 words and MXFP4 alike) and their scales [E, rows,
// bytes] (raw bf16 or E8M0 bytes, one per `ratio` 32-column groups) -> out[:, off : off + the matrix's
// tile bytes], as kernels/cpu/quant_moe_layout.py's repack (its Python text is the specification).
void repack(const torch::Tensor& packed, const torch::Tensor& scale, torch::Tensor& out, int64_t off, int64_t row0,
            int64_t N, int64_t K, int64_t ratio, bool mxfp4) {
  const int64_t E = packed.size(0), tiles = ceil_div(N, kTileRows);
  const Tiles shape = expert_tiles(out, 0, K, mxfp4);
  const int64_t ss = mxfp4 ? 1 : 2, pad = mxfp4 ? 0 : 8;
  const int64_t pb = packed.size(2), prow = packed.size(1) * pb, sb = scale.size(2), srow = scale.size(1) * sb;
  const uint8_t* pd = packed.data_ptr<uint8_t>();
  const uint8_t* sd = scale.data_ptr<uint8_t>();
  uint8_t* od = out.data_ptr<uint8_t>();
  const int64_t half_cols = shape.groups * 16;  // bytes of a row's codes, padded to whole groups
  at::parallel_for(0, E * tiles, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint8_t> row(static_cast<size_t>(half_cols) + 4);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / tiles, t = i % tiles;
      uint8_t* tile = od + e * out.size(1) + off + t * shape.tile_bytes;
      std::memset(tile, 0, static_cast<size_t>(shape.scale_block));
      uint8_t* codes = tile + shape.scale_block;
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t n = t * kTileRows + r;
        // the row's codes, columns past K (and rows past N) set to the padding code
        std::fill(row.begin(), row.end(), static_cast<uint8_t>(pad | pad << 4));
        if (n < N) {
          const uint8_t* src = pd + e * prow + (row0 + n) * pb;
          std::memcpy(row.data(), src, static_cast<size_t>(K / 2));
          if (K % 2) row[K / 2] = static_cast<uint8_t>((src[K / 2] & 15) | pad << 4);
          const uint8_t* sc = sd + e * srow + (row0 + n) * sb;
          for (int64_t g = 0; g < shape.groups; ++g)
            std::memcpy(tile + (g * kTileRows + r) * ss, sc + (g / ratio) * ss, static_cast<size_t>(ss));
        }
        for (int64_t b = 0; b < half_cols; b += 4) {  // 8 columns: block L = (b % 16) / 4 of group b / 16
          uint32_t v;
          std::memcpy(&v, row.data() + b, 4);
          // byte j of v holds columns 2j (low nibble, parity 0) and 2j + 1: gather each parity's 4 nibbles
          const uint32_t lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
          const uint32_t l2 = lo | (lo >> 4), h2 = hi | (hi >> 4);
          const uint16_t words[2] = {static_cast<uint16_t>((l2 & 0xFF) | ((l2 >> 8) & 0xFF00)),
                                     static_cast<uint16_t>((h2 & 0xFF) | ((h2 >> 8) & 0xFF00))};
          std::memcpy(codes + (b / 16) * 256 + 64 * ((b % 16) / 4) + 4 * r, words, 4);
        }
      }
    }
  });
}

const char* isa_name(int64_t isa) {
  return isa == kAmxBf16 ? "amx_bf16" : isa == kAvx512Bf16 ? "avx512bf16" : isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2+fma" : "scalar";
}

// Every binding that touches no Python object runs without the GIL (released once its arguments are
// converted, taken back before the result is): the host-expert workers, one per NUMA node, then run
// their kernels side by side, and the TUI's and HTTP server's threads keep running during a call.
// The capsule bindings keep it: they make or read Python objects.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (int b = 0; b < 256; ++b)
    g_e8m0[b] = b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, b - 127);
  m.def("moe", &moe, NoGil(), "gated (SiLU / SiTU) MoE over INT4 / MXFP4 experts in the tile layout, on the CPU");
  m.def("moe_w4a8", &moe_w4a8, NoGil(), "moe() with W4A8 products: activations quantised to int8 per 32 columns");
  m.def("matmul_w4a8", &matmul_w4a8, NoGil(), "one tiled matrix's W4A8 product (tests)");
  m.def("best_q8_isa", &best_q8_isa, NoGil(), "the widest int8 dot path: 2 AVX-512 VNNI, 1 AVX-VNNI, 0 portable");
  m.def("repack", &repack, NoGil(), "checkpoint-layout rows of packed experts -> the kernels' tile layout");
  m.def("best_isa", &best_isa, NoGil(),
        "the widest instruction set path this CPU (and OS) runs: 4 AMX-BF16, 3 AVX-512 BF16, 2 AVX-512, 1 AVX2+FMA, 0 portable");
  m.def("isa_name", &isa_name, NoGil(), "the name of an instruction set path");
  m.def("experts_capsules", [] {
    const kimitui_cpu::PackedExperts floats = &moe, w4a8 = &moe_w4a8;
    return py::make_tuple(py::capsule(reinterpret_cast<void*>(floats), kimitui_cpu::kPackedExpertsCapsule),
                          py::capsule(reinterpret_cast<void*>(w4a8), kimitui_cpu::kPackedExpertsW4a8Capsule));
  }, "moe and moe_w4a8 by pointer, for the few-row extension's use_packed_experts");
  m.def("use_team", [](py::capsule team) {
    TORCH_CHECK(std::string(team.name()) == kimitui_cpu::kTeamCapsule, "use_team: not a ", kimitui_cpu::kTeamCapsule,
                " capsule");
    kimitui_cpu::team_run() = reinterpret_cast<kimitui_cpu::TeamRun>(team.get_pointer());
  }, "run the parallel passes on another extension's thread team (its team_capsule())");
}
