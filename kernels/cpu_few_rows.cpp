// Few-row fp32 products on the CPU: the decode shapes, where a step multiplies 1-16 rows of
// activations by each weight. BLAS time grows with the row count there although the weight read
// (the real cost) does not; these loops read each weight tile once for every row.
//
// linear(x [M, K], w [N, K]) -> x @ w.T [M, N]
// moe(x [T, D], ids [T, k], weights [T, k], w13 [E, 2I, D], w2 [E, D, I]) -> [T, D]
// mla_decode(q [B, H, r + rope], cache [slots, r + rope], block tables, context lengths) -> [B, H, r]
// rms_norm(x [M, D], weight [D], eps) -> [M, D]
//
// Each output element is one dot product accumulated in a fixed order that does not depend on M,
// so a row gives the same bits alone or in a batch. Threads split weight rows (at::parallel_for,
// torch's own thread pool and thread count). Built on first use by kernels/cpu_few_rows.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

constexpr int kHeadGroup = 8;    // mla_decode: heads per work item
constexpr int64_t kBlock = 48;   // weight rows per work item (a multiple of the 3- and 8-row tiles)

// ys[t][n0 + r] = dot(xs[t], w[n0 + r]) for r < R, t < T; each row K long.
template <int R, int T>
inline void tile(const float* const* xs, const float* w, int64_t K, float* const* ys, int64_t n0) {
  v8 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = v8{};
  const float* wr = w + n0 * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = load8(xs[t] + k);
    for (int r = 0; r < R; ++r) {
      // The next tile's rows, into L2: each weight row is its own short stream (a 4 KB page for
      // K = 1024) that the hardware prefetcher barely starts on before it ends. Prefetches never
      // fault, so reading past the last row is harmless. 15-25% faster at 1-64 tokens (MoE).
      __builtin_prefetch(wr + (R + r) * K + k, 0, 1);
      const v8 wv = load8(wr + r * K + k);
      for (int t = 0; t < T; ++t) acc[r][t] += wv * xv[t];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += wr[r * K + kk] * xs[t][kk];
      ys[t][n0 + r] = s;
    }
}

// Weight rows [n0, n1) against all M activation rows, TR weight rows by up to TT activation rows a
// tile. TR + TR * TT + 1 vector registers must fit the 16 of AVX2.
template <int TR, int TT>
void rows_tiled(const float* const* xs, int64_t M, const float* w, int64_t K, float* const* ys, int64_t n0,
                int64_t n1) {
  int64_t n = n0;
  for (; n + TR <= n1; n += TR) {
    int64_t t = 0;
    for (; t + TT <= M; t += TT) tile<TR, TT>(xs + t, w, K, ys + t, n);
    if constexpr (TT > 1) {
      if (M - t == 3) tile<TR, 3>(xs + t, w, K, ys + t, n);
      else if (M - t == 2) tile<TR, 2>(xs + t, w, K, ys + t, n);
      else if (M - t == 1) tile<TR, 1>(xs + t, w, K, ys + t, n);
    }
  }
  if constexpr (TR > 1) rows_tiled<1, TT>(xs, M, w, K, ys, n, n1);
}

// One activation row: 8 weight rows a tile (memory-bound, more streams in flight). Otherwise 3 weight
// rows by 4 activation rows: the fastest of the tiles measured for 2-16 rows (benchmarks/cpu_few_rows.py).
void rows(const float* const* xs, int64_t M, const float* w, int64_t K, float* const* ys, int64_t n0, int64_t n1) {
  if (M == 1) rows_tiled<8, 1>(xs, M, w, K, ys, n0, n1);
  else rows_tiled<3, 4>(xs, M, w, K, ys, n0, n1);
}

// out[h][j] = sum over l < L of p[l][h] * keys[l][j], for h < nh and j < r; p has kHeadGroup
// columns (zero past nh). An 8-wide column chunk of every head stays in registers while l runs.
void weighted_sum(const float* p, const float* const* keys, int64_t L, int64_t r, int64_t nh, float* out) {
  int64_t j = 0;
  for (; j + 8 <= r; j += 8) {
    v8 acc[kHeadGroup] = {};
    for (int64_t l = 0; l < L; ++l) {
      const v8 kv = load8(keys[l] + j);
      for (int h = 0; h < kHeadGroup; ++h) acc[h] += p[l * kHeadGroup + h] * kv;
    }
    for (int64_t h = 0; h < nh; ++h) std::memcpy(out + h * r + j, &acc[h], sizeof(v8));
  }
  for (; j < r; ++j)
    for (int64_t h = 0; h < nh; ++h) {
      float s = 0.0f;
      for (int64_t l = 0; l < L; ++l) s += p[l * kHeadGroup + h] * keys[l][j];
      out[h * r + j] = s;
    }
}

void check_f32(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == dim,
              name, " must be a contiguous ", dim, "-d float32 CPU tensor, got ", t.scalar_type(), " ",
              t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

template <typename F>  // float or const float
std::vector<F*> row_ptrs(F* base, int64_t m, int64_t stride) {
  std::vector<F*> p(m);
  for (int64_t i = 0; i < m; ++i) p[i] = base + i * stride;
  return p;
}

// fn(i) for i in [0, n), each i taken by whichever of torch's threads is free next.
template <typename F>
void dynamic_for(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w) {
  check_f32(x, "x", 2);
  check_f32(w, "w", 2);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x has ", K, " features, w has ", w.size(1));
  auto y = torch::empty({M, N}, x.options());
  const auto xs = row_ptrs<const float>(x.data_ptr<float>(), M, K);
  const auto ys = row_ptrs(y.data_ptr<float>(), M, N);
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows(xs.data(), M, wp, K, ys.data(), b * kBlock, std::min(N, (b + 1) * kBlock));
  });
  return y;
}

// SwiGLU experts: y_t = sum over t's slots, in ascending expert order, of weight * w2[e] @ (silu(g) * u),
// [g; u] = w13[e] @ x_t. An id outside [0, E) (a pair computed elsewhere) adds nothing.
torch::Tensor moe(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13, torch::Tensor w2) {
  check_f32(x, "x", 2);
  check_f32(weights, "topk_weights", 2);
  check_f32(w13, "w13", 3);
  check_f32(w2, "w2", 3);
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
  auto gate_up = torch::empty({P, I2}, x.options());
  auto act = torch::empty({P, I}, x.options());
  auto down = torch::empty({P, D}, x.options());
  std::vector<const float*> xs(P);
  for (int64_t p = 0; p < P; ++p) xs[p] = x.data_ptr<float>() + token[p] * D;
  const auto gu_rows = row_ptrs(gate_up.data_ptr<float>(), P, I2);
  const auto act_rows = row_ptrs<const float>(act.data_ptr<float>(), P, I);
  const auto down_rows = row_ptrs(down.data_ptr<float>(), P, D);
  const float* w13p = w13.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  float* a = act.data_ptr<float>();
  const float* gu = gate_up.data_ptr<float>();
  dynamic_for(static_cast<int64_t>(active.size()), [&](int64_t i) {
    const int64_t e = active[i], g = count[e], m = count[e + 1] - g;
    rows(xs.data() + g, m, w13p + e * I2 * D, D, gu_rows.data() + g, 0, I2);
    for (int64_t p = g; p < g + m; ++p)
      for (int64_t j = 0; j < I; ++j) {
        const float v = gu[p * I2 + j];
        a[p * I + j] = v / (1.0f + std::exp(-v)) * gu[p * I2 + I + j];
      }
    rows(act_rows.data() + g, m, w2p + e * D * I, I, down_rows.data() + g, 0, D);
  });

  // Each token adds its weighted expert outputs in ascending expert order.
  auto out = torch::zeros({T, D}, x.options());
  const float* wt = weights.data_ptr<float>();
  const float* dn = down.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(top_k);
    for (int64_t t = t0; t < t1; ++t) {
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
  return out;
}

// Absorbed MLA decode, one query per sequence, reading the latent cache in place through the block
// table: out[b, h] = softmax_l(scale * q[b, h] . cache[slot(b, l)]) @ cache[slot(b, l)][:r] for
// l < context_lens[b]. A work item is one sequence and up to kHeadGroup heads; its keys are read
// twice (scores, then the weighted sum) while they sit in L2.
torch::Tensor mla_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                         torch::Tensor context_lens, int64_t block_size, int64_t r, double scale) {
  check_f32(q, "q", 3);
  check_f32(cache, "cache", 2);
  for (const auto* t : {&block_tables, &context_lens})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt32 && t->is_contiguous(),
                "block_tables and context_lens must be contiguous int32 CPU tensors, got ", t->scalar_type());
  const int64_t B = q.size(0), H = q.size(1), C = q.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(cache.size(1) == C && r > 0 && r <= C, "cache rows of ", cache.size(1), " values for queries of ", C,
              " (latent ", r, ")");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.numel() == B, "block_tables ", block_tables.sizes(),
              " and context_lens ", context_lens.sizes(), " must have one row per query (", B, ")");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t slots = cache.size(0);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, "context length ", lens[b], " of sequence ", b,
                " does not fit its ", max_blocks, " blocks of ", block_size);
  auto out = torch::zeros({B, H, r}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = (H + kHeadGroup - 1) / kHeadGroup;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * groups, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score;
    std::vector<const float*> keys;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / groups, h0 = i % groups * kHeadGroup, nh = std::min<int64_t>(kHeadGroup, H - h0);
      const int64_t L = lens[b];
      if (L == 0) continue;
      keys.resize(L);
      for (int64_t l = 0; l < L; ++l) {
        const int64_t block = tables[b * max_blocks + l / block_size];
        const int64_t slot = block * block_size + l % block_size;
        TORCH_CHECK(slot >= 0 && slot < slots, "cache slot ", slot, " of sequence ", b, " is outside the cache");
        keys[l] = cp + slot * C;
      }
      score.resize(L * kHeadGroup);
      std::vector<float*> rows_out(L);
      for (int64_t l = 0; l < L; ++l) rows_out[l] = score.data() + l * kHeadGroup;
      // score[l][h] = q[b, h0 + h] . key l: the heads are the weight rows, the keys the activations.
      rows(keys.data(), L, qp + (b * H + h0) * C, C, rows_out.data(), 0, nh);
      for (int64_t h = 0; h < nh; ++h) {
        float m = -INFINITY, sum = 0.0f;
        for (int64_t l = 0; l < L; ++l) m = std::max(m, score[l * kHeadGroup + h] * sc);
        for (int64_t l = 0; l < L; ++l) {
          const float e = std::exp(score[l * kHeadGroup + h] * sc - m);
          score[l * kHeadGroup + h] = e;
          sum += e;
        }
        for (int64_t l = 0; l < L; ++l) score[l * kHeadGroup + h] /= sum;
      }
      for (int64_t l = 0; l < L; ++l)  // a last group of fewer heads: padding weights of zero
        for (int64_t h = nh; h < kHeadGroup; ++h) score[l * kHeadGroup + h] = 0.0f;
      weighted_sum(score.data(), keys.data(), L, r, nh, op + (b * H + h0) * r);
    }
  });
  return out;
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
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * D;
      v8 acc = v8{};
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {
        const v8 v = load8(row + d);
        acc += v * v;
      }
      float ss = hsum(acc);
      for (; d < D; ++d) ss += row[d] * row[d];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (d = 0; d < D; ++d) yp[m * D + d] = row[d] * r * wp[d];
    }
  });
  return y;
}

int64_t threads() { return at::get_num_threads(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x [M, K] @ w [N, K].T for float32 CPU tensors");
  m.def("moe", &moe, "SwiGLU MoE over dense float32 experts on the CPU");
  m.def("mla_decode", &mla_decode, "absorbed MLA decode over the paged latent cache, float32 on the CPU");
  m.def("rms_norm", &rms_norm, "HF RMSNorm over the last dim, float32 on the CPU");
  m.def("threads", &threads, "the thread count at::parallel_for uses here");
}
