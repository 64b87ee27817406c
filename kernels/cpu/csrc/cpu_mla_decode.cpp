// Absorbed MLA decode on the CPU with float32 arithmetic, reading the paged latent cache in place
// through the block tables (no per-layer gather of each sequence's context). The cache and W_UK /
// W_UV are float32 or bfloat16 (one dtype for the three), widened in registers as cpu_few_rows.h
// does for weights; scores, softmax and sums stay float32, and the newest latent is rounded to the
// cache's dtype when it is written.
//
// mla_decode(q [B, H, r + rope], cache [slots, r + rope], block tables, context lengths) -> [B, H, r]
// mla_decode_absorbed(q, kv, ...): a whole decode step of one layer after its projections -> [B, H, v]
//
// Part of the cpu_few_rows extension (see cpu_few_rows.cpp).

#include "cpu_few_rows.h"

using namespace kimitui_cpu;

namespace {

constexpr int kHeadGroup = 8;  // heads per work item
// bf16 W_UV on AMX tiles for steps of more sequences than this (the few-row decode's maximum, whose
// sequences keep their bits alone or in a batch; kernels/cpu/few_rows.py MAX_MLA_SEQS)
constexpr int64_t kAmxSeqs = 16;
// Columns of a 4-row tile of the W_UK product: 16 accumulators (AVX-512 has 32 vector registers);
// 1.0 ms for a float32 step at 16 sequences against 1.14 ms with 16 columns.
constexpr int kUkCols = 32;

// out[h][j] = sum over l < L of p[h][l] * keys[l][j], for h < nh and j < r; p rows L apart. An
// 8-wide column chunk of every head stays in registers while l runs.
template <typename C>
void weighted_sum(const float* p, const C* const* keys, int64_t L, int64_t r, int64_t nh, float* out) {
  int64_t j = 0;
  for (; j + 8 <= r; j += 8) {
    v8 acc[kHeadGroup] = {};
    for (int64_t l = 0; l < L; ++l) {
      const v8 kv = load8(keys[l] + j);
      for (int h = 0; h < kHeadGroup; ++h) acc[h] = fmadd(splat(p[h * L + l]), kv, acc[h]);
    }
    for (int64_t h = 0; h < nh; ++h) std::memcpy(out + h * r + j, &acc[h], sizeof(v8));
  }
  for (; j < r; ++j)
    for (int64_t h = 0; h < nh; ++h) {
      float s = 0.0f;
      for (int64_t l = 0; l < L; ++l) s += p[h * L + l] * to_f32(keys[l][j]);
      out[h * r + j] = s;
    }
}

// The keys of sequence b: pointers into the cache rows of its first L positions.
template <typename T>
void context_keys(const T* cache, int64_t slots, int64_t C, const int32_t* table, int64_t L, int64_t block_size,
                  int64_t b, std::vector<const T*>& keys) {
  keys.resize(L);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t slot = static_cast<int64_t>(table[l / block_size]) * block_size + l % block_size;
    TORCH_CHECK(slot >= 0 && slot < slots, "cache slot ", slot, " of sequence ", b, " is outside the cache");
    keys[l] = cache + slot * C;
  }
}

// Scaled scores this far below the largest get a weight of exactly zero: e^-60 (about 1e-26) is far
// under what a float32 sum that the largest term makes >= 1 can hold, so the weight adds nothing, but
// kept, it turns denormal once normalised or multiplied by a latent, and every operation on a
// denormal takes a microcode assist on Intel cores: a random-weight K2-shaped layer's attention over
// 100 positions ran 9x slower (840 against 94 us) with them.
constexpr float kNegligibleScore = -60.0f;

// p[l] = softmax_l(scale * p[l]) over one head's L scores, in place.
void softmax_row(float* p, int64_t L, float scale) {
  v8 mv = v8{} - INFINITY;
  int64_t l = 0;
  for (; l + 8 <= L; l += 8) {
    const v8 x = load8(p + l);
    mv = mv > x ? mv : x;
  }
  float m = std::max(std::max(std::max(mv[0], mv[1]), std::max(mv[2], mv[3])),
                     std::max(std::max(mv[4], mv[5]), std::max(mv[6], mv[7])));
  for (int64_t t = l; t < L; ++t) m = std::max(m, p[t]);
  m *= scale;  // scale > 0: the largest scaled score is the scaled largest score
  v8 sv = v8{};
  for (l = 0; l + 8 <= L; l += 8) {
    const v8 z = load8(p + l) * scale - m;
    const v8 e = z < kNegligibleScore ? v8{} : exp8(z);
    std::memcpy(p + l, &e, sizeof e);
    sv += e;
  }
  float sum = hsum(sv);
  for (int64_t t = l; t < L; ++t) {
    const float z = p[t] * scale - m;
    p[t] = z < kNegligibleScore ? 0.0f : std::exp(z);
    sum += p[t];
  }
  const float inv = 1.0f / sum;
  for (l = 0; l < L; ++l) p[l] *= inv;
}

// out[h] = softmax_l(scale * q[h] . key l) @ key l[:r] for nh <= kHeadGroup query rows q (C values
// each, C apart) over L >= 1 keys; out rows r apart. The scores run block by block of the paged
// cache, whose rows are contiguous within a block: a block is a small weight matrix to the tiled
// dot products (which prefetch its next rows), the heads its activation rows. The keys are read
// again for the weighted sum while they sit in L2.
template <typename T>
void attend(const float* q, int64_t nh, const std::vector<const T*>& keys, int64_t block_size, int64_t C,
            int64_t r, float scale, float* out, std::vector<float>& score) {
  const int64_t L = static_cast<int64_t>(keys.size());
  score.assign(kHeadGroup * L, 0.0f);  // heads past nh keep weights of zero
  const float* qs[kHeadGroup];
  float* ys[kHeadGroup];
  for (int64_t h = 0; h < nh; ++h) qs[h] = q + h * C;
  for (int64_t l0 = 0; l0 < L; l0 += block_size) {
    const int64_t n = std::min(block_size, L - l0);
    if (l0 + block_size < L)  // the next block's first tile of rows: the tiles prefetch only within a block
      for (int64_t c = 0; c < 3 * C; c += 16) prefetch_l2(keys[l0 + block_size], c);
    for (int64_t h = 0; h < nh; ++h) ys[h] = score.data() + h * L + l0;
    rows(qs, nh, keys[l0], C, ys, 0, n);  // score[h][l0 + i] = q[h] . key l0 + i
  }
  for (int64_t h = 0; h < nh; ++h) softmax_row(score.data() + h * L, L, scale);
  weighted_sum(score.data(), keys.data(), L, r, nh, out);
}

void check_tables(const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t B,
                  int64_t block_size) {
  for (const auto* t : {&block_tables, &context_lens})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt32 && t->is_contiguous(),
                "block_tables and context_lens must be contiguous int32 CPU tensors, got ", t->scalar_type());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B, "block_tables ",
              block_tables.sizes(), " and context_lens ", context_lens.sizes(), " must have one row per query (", B,
              ")");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, "context length ", lens[b], " of sequence ", b,
                " does not fit its ", max_blocks, " blocks of ", block_size);
}

// outs[t][j] = sum over i < n of as[t][i] * W[i][j] (W row-major, rows m apart) for t < T and the
// U * 8 columns from j, i ascending; each loaded (and widened) weight vector serves all T rows.
// Prefetch: fetch the tile's columns 8 rows ahead into L2 (the first pass over a chunk of W, which
// may come from memory; maybe past its end, harmless for a prefetch).
template <int T, int U, bool Prefetch, typename W>
inline void vec_mat_tile(const float* const* as, const W* w, int64_t n, int64_t m, int64_t j, float* const* outs) {
  v8 acc[T][U];
  for (int t = 0; t < T; ++t)
    for (int u = 0; u < U; ++u) acc[t][u] = v8{};
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (Prefetch)
      for (int c = 0; c < U * 8; c += 64 / static_cast<int>(sizeof(W))) prefetch_l2(w, (i + 8) * m + j + c);
    v8 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = load8(w + i * m + j + 8 * u);
    for (int t = 0; t < T; ++t) {
      const v8 a = splat(as[t][i]);
      for (int u = 0; u < U; ++u) acc[t][u] = fmadd(a, wv[u], acc[t][u]);
    }
  }
  for (int t = 0; t < T; ++t) std::memcpy(outs[t] + j, acc[t], sizeof acc[t]);
}

// Columns [j, j + 64) for all M rows: 4 rows by kUkCols columns a tile, the last 1-3 rows by 32-64
// columns, so that every tile keeps at least 8 FMA chains in flight (one row alone would otherwise
// wait on the FMA latency).
template <typename W>
inline void vec_mat_64(const float* const* as, int64_t M, const W* w, int64_t n, int64_t m, int64_t j,
                       float* const* outs) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4)
    for (int64_t c = 0; c < 64; c += kUkCols) {
      if (t == 0) vec_mat_tile<4, kUkCols / 8, true>(as + t, w, n, m, j + c, outs + t);
      else vec_mat_tile<4, kUkCols / 8, false>(as + t, w, n, m, j + c, outs + t);
    }
  // the last 1-3 rows prefetch only when they are all the rows
  if (M - t == 3)
    for (int64_t c = 0; c < 64; c += 32) {
      if (t == 0) vec_mat_tile<3, 4, true>(as + t, w, n, m, j + c, outs + t);
      else vec_mat_tile<3, 4, false>(as + t, w, n, m, j + c, outs + t);
    }
  else if (M - t == 2)
    for (int64_t c = 0; c < 64; c += 32) {
      if (t == 0) vec_mat_tile<2, 4, true>(as + t, w, n, m, j + c, outs + t);
      else vec_mat_tile<2, 4, false>(as + t, w, n, m, j + c, outs + t);
    }
  else if (M - t == 1) {
    if (t == 0) vec_mat_tile<1, 8, true>(as + t, w, n, m, j, outs + t);
    else vec_mat_tile<1, 8, false>(as + t, w, n, m, j, outs + t);
  }
}

// outs[t][j] = sum over i < n of as[t][i] * W[i][j] for t < M and j in [j0, j1) (j0 a multiple of
// 8), reading each 64-column chunk of W once for all M rows (it stays in L1 while the row tiles
// pass over it). Every output element is one float32 FMA chain over i ascending from zero in the
// 8-wide columns, the plain loop in the columns past the last multiple of 8, whatever M, the tile
// and the column range: a row's bits do not depend on the rows or column blocks it runs with.
template <typename W>
void vec_mat_rows(const float* const* as, int64_t M, const W* w, int64_t n, int64_t m, int64_t j0, int64_t j1,
                  float* const* outs) {
  int64_t j = j0;
  for (; j + 64 <= j1; j += 64) vec_mat_64(as, M, w, n, m, j, outs);
  for (; j + 8 <= j1; j += 8) {
    int64_t t = 0;
    for (; t + 4 <= M; t += 4) vec_mat_tile<4, 1, false>(as + t, w, n, m, j, outs + t);
    for (; t < M; ++t) vec_mat_tile<1, 1, false>(as + t, w, n, m, j, outs + t);
  }
  for (; j < j1; ++j)
    for (int64_t t = 0; t < M; ++t) {
      float s = 0.0f;
      for (int64_t i = 0; i < n; ++i) s += as[t][i] * to_f32(w[i * m + j]);
      outs[t][j] = s;
    }
}

// DeepSeek's interleaved rotary embedding: pairs (x[2p], x[2p+1]) turn by the angle of pair p.
template <typename T>
inline void rope_pairs(const float* x, const float* cos, const float* sin, int64_t pairs, T* y) {
  for (int64_t p = 0; p < pairs; ++p) {
    const float x0 = x[2 * p], x1 = x[2 * p + 1];
    store(y + 2 * p, x0 * cos[p] - x1 * sin[p]);
    store(y + 2 * p + 1, x0 * sin[p] + x1 * cos[p]);
  }
}

}  // namespace

// Absorbed MLA decode, one query per sequence, reading the latent cache in place through the block
// table: out[b, h] = softmax_l(scale * q[b, h] . cache[slot(b, l)]) @ cache[slot(b, l)][:r] for
// l < context_lens[b]. A work item is one sequence and up to kHeadGroup heads.
torch::Tensor mla_decode(torch::Tensor q_in, torch::Tensor cache, torch::Tensor block_tables,
                         torch::Tensor context_lens, int64_t block_size, int64_t r, double scale) {
  const auto q = as_f32(q_in, "q", 3);
  check_weight(cache, "cache", 2);
  const int64_t B = q.size(0), H = q.size(1), C = q.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(cache.size(1) == C && r > 0 && r <= C, "cache rows of ", cache.size(1), " values for queries of ", C,
              " (latent ", r, ")");
  check_tables(block_tables, context_lens, B, block_size);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  auto out = torch::zeros({B, H, r}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = (H + kHeadGroup - 1) / kHeadGroup;
  with_weight(cache, [&](auto cp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cp)>>;
    at::parallel_for(0, B * groups, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> score;
      std::vector<const T*> keys;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / groups, h0 = i % groups * kHeadGroup, nh = std::min<int64_t>(kHeadGroup, H - h0);
        if (lens[b] == 0) continue;
        context_keys(cp, cache.size(0), C, tables + b * max_blocks, lens[b], block_size, b, keys);
        attend(qp + (b * H + h0) * C, nh, keys, block_size, C, r, static_cast<float>(scale), op + (b * H + h0) * r,
               score);
      }
    });
  });
  return q_in.scalar_type() == torch::kFloat32 ? out : out.to(q_in.scalar_type());
}

// A whole absorbed decode step of one MLA layer after its projections, for a batch of decodes only:
//   q [B, H, nope + rope] (q_b_proj's output), kv [B, r + rope] (kv_a_proj_with_mqa's output).
// Writes each sequence's newest latent (kv_a_layernorm(kv[:r]), roped kv[r:]) to its cache slot,
// absorbs W_UK into the queries, attends over the paged cache and applies W_UV: -> [B, H, v].
// The same maths as MLAttention's unfused path (norm, rope, index_copy_, bmm, mla_decode, bmm), in
// one call instead of about forty small ATen operations. q and kv float32 or bf16 (computed in
// float32, the output in q's dtype); the norm weight and rotary tables float32; the cache, W_UK and
// W_UV float32 or bf16, one dtype. Empty cos and sin: NoPE (Kimi Linear / K3), the rope dims of the
// key and query go in unrotated.
torch::Tensor mla_decode_absorbed(torch::Tensor q_in, torch::Tensor kv_in, torch::Tensor kv_norm_weight, double eps,
                                  torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, torch::Tensor slots,
                                  torch::Tensor w_uk, torch::Tensor w_uv, torch::Tensor cache,
                                  torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                  double scale) {
  const auto q = as_f32(q_in, "q", 3);
  const auto kv = as_f32(kv_in, "kv", 2);
  check_f32(kv_norm_weight, "kv_norm_weight", 1);
  const bool nope_only = cos.numel() == 0 && sin.numel() == 0;  // NoPE (Kimi Linear / K3): no rotation
  if (!nope_only) {
    check_f32(cos, "cos", 2);
    check_f32(sin, "sin", 2);
  }
  check_weight(w_uk, "w_uk", 3);
  check_weight(w_uv, "w_uv", 3);
  check_weight(cache, "cache", 2);
  TORCH_CHECK(w_uk.scalar_type() == cache.scalar_type() && w_uv.scalar_type() == cache.scalar_type(), "w_uk (",
              w_uk.scalar_type(), "), w_uv (", w_uv.scalar_type(), ") and the cache (", cache.scalar_type(),
              ") must have one dtype");
  for (const auto* t : {&positions, &slots})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->is_contiguous(),
                "positions and slots must be contiguous int64 CPU tensors, got ", t->scalar_type());
  const int64_t B = q.size(0), H = q.size(1), r = kv_norm_weight.size(0), C = cache.size(1), rope = C - r;
  const int64_t nope = w_uk.size(1), v = w_uv.size(1), pairs = rope / 2;
  const int64_t max_pos = nope_only ? INT64_MAX : cos.size(0);
  TORCH_CHECK(rope > 0 && rope % 2 == 0 && q.size(2) == nope + rope && kv.size(0) == B && kv.size(1) == C,
              "q ", q.sizes(), " and kv ", kv.sizes(), " do not fit a cache row of ", C, " values (latent ", r, ")");
  TORCH_CHECK(w_uk.size(0) == H && w_uk.size(2) == r && w_uv.size(0) == H && w_uv.size(2) == r, "w_uk ",
              w_uk.sizes(), " and w_uv ", w_uv.sizes(), " do not fit ", H, " heads of latent ", r);
  TORCH_CHECK(nope_only || (cos.sizes() == sin.sizes() && cos.size(1) == pairs), "cos ", cos.sizes(), " and sin ",
              sin.sizes(), " do not fit ", rope, " rotary dims");
  TORCH_CHECK(positions.numel() == B && slots.numel() == B, "positions and slots need one entry per query (", B, ")");
  check_tables(block_tables, context_lens, B, block_size);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < max_pos, "position ", pos[b], " of sequence ", b,
                " is outside the rotary cache (", max_pos, ")");
    TORCH_CHECK(slot[b] >= 0 && slot[b] < cache.size(0), "cache slot ", slot[b], " of sequence ", b,
                " is outside the cache");
  }
  // not torch::zeros: past 32768 elements (32 sequences of 8 x 128) ATen fills on its OpenMP threads,
  // a wake-up of sleeping threads per layer (34 sequences took 8 ms against 1.5 at 32 on the loaded
  // 2-core Xeon); every active sequence's rows are written below, the others zeroed here
  auto out = torch::empty({B, H, v}, q.options());
  with_weight(cache, [&](auto cache_p) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cache_p)>>;
    T* cp = const_cast<T*>(cache_p);
    const T* uk = reinterpret_cast<const T*>(w_uk.data_ptr());
    const T* uv = reinterpret_cast<const T*>(w_uv.data_ptr());
    const float* kvp = kv.data_ptr<float>();
    const float* nw = kv_norm_weight.data_ptr<float>();
    // The newest latent of every sequence goes in first: it is part of its own context.
    std::vector<float> normed(r);
    for (int64_t b = 0; b < B; ++b) {
      const float* row = kvp + b * C;
      T* dst = cp + slot[b] * C;
      rms_norm_row(row, nw, r, static_cast<float>(eps), normed.data());
      for (int64_t j = 0; j < r; ++j) store(dst + j, normed[j]);
      if (nope_only)
        for (int64_t j = 0; j < rope; ++j) store(dst + r + j, row[r + j]);
      else
        rope_pairs(row + r, cos.data_ptr<float>() + pos[b] * pairs, sin.data_ptr<float>() + pos[b] * pairs, pairs,
                   dst + r);
    }
    const float* qp = q.data_ptr<float>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t max_blocks = block_tables.size(1);
    float* op = out.data_ptr<float>();
    const int64_t groups = (H + kHeadGroup - 1) / kHeadGroup;
    // Three passes, so that W_UK and W_UV are each read once per step for all its sequences, not
    // once per sequence (16 times at 16 decodes), and each loaded weight vector serves several
    // sequences' FMAs: the absorbed queries of every sequence, head by head; attention, sequence
    // by sequence; W_UV, head by head. A sequence's arithmetic is the same in each as when it runs
    // alone. (At 16 sequences of a Kimi-shaped layer, 8 heads, one thread: 1.0 ms a step against
    // 1.6 ms bf16, 2.9 ms float32, one sequence at a time.)
    std::vector<int64_t> active;  // the sequences with a context (an empty one keeps an output of zeros)
    for (int64_t b = 0; b < B; ++b)
      if (lens[b] > 0) active.push_back(b);
    const int64_t A = static_cast<int64_t>(active.size());
    for (int64_t b = 0; b < B; ++b)
      if (lens[b] <= 0) std::fill_n(op + b * H * v, H * v, 0.0f);
    std::vector<float> qc(B * H * C), lat(B * H * r);  // absorbed queries [B, H, C]; latent outputs [B, H, r]
    // A wide step (more sequences than the few-row decode's 16), every sequence with a context, where
    // the CPU has AMX-BF16 tiles: W_UK and W_UV on the tiles, their inputs rounded to bf16 (as the
    // bf16 PyTorch MLA computes them), float32 sums.
    const bool amx = std::is_same_v<T, bf16> && A == B && A > kAmxSeqs && moe_amx_usable();
    constexpr int64_t kCols = 128;  // W_UK columns per work item (a multiple of 64)
    const int64_t col_blocks = (r + kCols - 1) / kCols;
    if constexpr (std::is_same_v<T, bf16>) {
      if (amx)
        parallel_runs(H, H * nope * r * static_cast<int64_t>(sizeof(T)), [&](int64_t h0, int64_t h1) {
          std::vector<const float*> xs(A);
          for (int64_t h = h0; h < h1; ++h) {  // qc[b, h, :r] = q_nope[b, h] @ W_UK[h]
            for (int64_t a = 0; a < A; ++a) xs[a] = qp + (a * H + h) * (nope + rope);
            amx_product_kn(xs.data(), A, uk + h * nope * r, nope, r, qc.data() + h * C, H * C);
          }
        });
    }
    // (parallel_runs: runs of items per thread, or the calling thread alone for a small pass)
    if (!amx)
    parallel_runs(H * col_blocks, H * nope * r * static_cast<int64_t>(sizeof(T)), [&](int64_t i0, int64_t i1) {
      std::vector<const float*> xs(A);
      std::vector<float*> ys(A);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t h = i / col_blocks, j0 = i % col_blocks * kCols, j1 = std::min(j0 + kCols, r);
        for (int64_t a = 0; a < A; ++a) {
          xs[a] = qp + (active[a] * H + h) * (nope + rope);
          ys[a] = qc.data() + (active[a] * H + h) * C;
        }
        vec_mat_rows(xs.data(), A, uk + h * nope * r, nope, r, j0, j1, ys.data());  // q_nope @ W_UK[h]
      }
    });
    int64_t context_bytes = 0;  // the attention pass reads each sequence's context once per head group
    for (int64_t b : active) context_bytes += lens[b] * C * static_cast<int64_t>(sizeof(T)) * groups;
    parallel_runs(groups * A, context_bytes, [&](int64_t i0, int64_t i1) {
      std::vector<float> score;
      std::vector<const T*> keys;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = active[i % A], h0 = i / A * kHeadGroup, nh = std::min<int64_t>(kHeadGroup, H - h0);
        for (int64_t h = h0; h < h0 + nh; ++h) {
          const float* qr = qp + (b * H + h) * (nope + rope) + nope;
          float* dst = qc.data() + (b * H + h) * C + r;
          if (nope_only)
            std::copy(qr, qr + rope, dst);
          else
            rope_pairs(qr, cos.data_ptr<float>() + pos[b] * pairs, sin.data_ptr<float>() + pos[b] * pairs, pairs, dst);
        }
        context_keys(static_cast<const T*>(cp), cache.size(0), C, tables + b * max_blocks, lens[b], block_size, b,
                     keys);
        attend(qc.data() + (b * H + h0) * C, nh, keys, block_size, C, r, static_cast<float>(scale),
               lat.data() + (b * H + h0) * r, score);
      }
    });
    if constexpr (std::is_same_v<T, bf16>) {
      if (amx) {  // W_UV[h] [v, r] as the tiles' A operand as it lies
        parallel_runs(H, H * v * r * static_cast<int64_t>(sizeof(T)), [&](int64_t h0, int64_t h1) {
          std::vector<const float*> xs(A);
          for (int64_t h = h0; h < h1; ++h) {
            for (int64_t a = 0; a < A; ++a) xs[a] = lat.data() + (a * H + h) * r;
            amx_product(xs.data(), A, uv + h * v * r, v, r, op + h * v, H * v);
          }
        });
        return;
      }
    }
    constexpr int64_t kRows = 48;  // W_UV rows per work item (a multiple of the 3- and 4-row tiles)
    const int64_t row_blocks = (v + kRows - 1) / kRows;
    parallel_runs(H * row_blocks, H * v * r * static_cast<int64_t>(sizeof(T)), [&](int64_t i0, int64_t i1) {
      std::vector<const float*> xs(A);
      std::vector<float*> ys(A);
      for (int64_t i = i0; i < i1; ++i) {  // out[b, h] = W_UV[h] @ latent output [b, h]
        const int64_t h = i / row_blocks, n0 = i % row_blocks * kRows, n1 = std::min(n0 + kRows, v);
        for (int64_t a = 0; a < A; ++a) {
          xs[a] = lat.data() + (active[a] * H + h) * r;
          ys[a] = op + (active[a] * H + h) * v;
        }
        rows(xs.data(), A, uv + h * v * r, r, ys.data(), n0, n1);
      }
    });
  });
  return q_in.scalar_type() == torch::kFloat32 ? out : out.to(q_in.scalar_type());
}
