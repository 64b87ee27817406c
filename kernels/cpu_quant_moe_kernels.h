// The per-instruction-set kernels of cpu_quant_moe.cpp. This file is included once per instruction set,
// inside that set's namespace and `#pragma GCC target` region, after the set's vector primitives:
//   W (floats per vector), Vec, Lut, make_lut(const float[16]), vzero, vload, vstore, vfma(a, b, acc),
//   vsum(Vec), dequant32(const uint8_t bytes[16], float scale, const Lut&, Vec out[32 / W]).
// dequant32 writes a 32-column group in the order perm_index() gives (even columns of each W-byte run,
// then its odd ones), so nibbles need no shuffles; activations are stored in the same order.
//
// Numerics: every output is one Vec accumulator per (weight row, token), fed the dequantised weight
// (exact in float32: a 4-bit code times a bf16 or power-of-two scale) times the activation, group by
// group in column order, then vsum. The register path (fused_block) and the tiled path (tiled_rows)
// run exactly that sequence, so a row's result does not depend on how many tokens share its expert.

constexpr int kGroupVecs = 32 / W;

// Row r's 32-column group starting at k0, dequantised. The last group of a row whose packed bytes end
// before 16 (INT4 with K % 32 != 0) is read through a zero-padded copy: never past the row's bytes.
static inline void dequant_group(const QMat& m, const Lut& lut, int64_t r, int64_t k0, Vec* out) {
  const uint8_t* row = m.data + r * m.row_bytes;
  const float s = group_scale(m, r, k0);
  const int64_t b0 = k0 / 2;
  if (b0 + 16 <= m.row_bytes) {
    dequant32(row + b0, s, lut, out);
    return;
  }
  alignas(64) uint8_t tail[16] = {0};
  std::memcpy(tail, row + b0, static_cast<size_t>(m.row_bytes - b0));
  dequant32(tail, s, lut, out);
}

// out[c * ostride + r] = <row r0 + r, xs[c]> for r < nr <= R, c < nc <= C. R x C accumulators stay in
// registers over all of K; each group of each row is dequantised once for the C tokens. Rows and
// tokens past nr / nc repeat the last one (computed, not stored), so the loop has no tail branches.
template <int R, int C>
static void fused_block(const QMat& m, const Lut& lut, int64_t r0, int nr, const float* const* xs, int nc,
                        float* out, int64_t ostride) {
  Vec acc[R][C];
  int64_t rows[R];
  const float* x[C];
  for (int r = 0; r < R; ++r) rows[r] = r0 + std::min(r, nr - 1);
  for (int c = 0; c < C; ++c) x[c] = xs[std::min(c, nc - 1)];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const int64_t groups = (m.K + 31) / 32;
  for (int64_t g = 0; g < groups; ++g) {
    Vec xv[C][kGroupVecs];
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < kGroupVecs; ++p) xv[c][p] = vload(x[c] + g * 32 + p * W);
    for (int r = 0; r < R; ++r) {
      Vec w[kGroupVecs];
      dequant_group(m, lut, rows[r], g * 32, w);
      for (int p = 0; p < kGroupVecs; ++p)
        for (int c = 0; c < C; ++c) acc[r][c] = vfma(w[p], xv[c][p], acc[r][c]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < nc; ++c) out[c * ostride + r] = vsum(acc[r][c]);
}

// acc[r][c] (in abuf, vector index r * nc_all + c) += w rows . x tokens over nvec vectors: the tiled
// path's register block. Rows/tokens past nr / nc repeat the last one and store the same bits twice.
template <int R, int C>
static void micro_block(const float* wbuf, int64_t wstride, int nr, const float* const* x, int64_t xoff, int nc,
                        int64_t nvec, float* abuf, int nc_all) {
  const float* w[R];
  const float* xp[C];
  float* a[R][C];
  Vec acc[R][C];
  for (int r = 0; r < R; ++r) w[r] = wbuf + std::min(r, nr - 1) * wstride;
  for (int c = 0; c < C; ++c) xp[c] = x[std::min(c, nc - 1)] + xoff;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      a[r][c] = abuf + (static_cast<int64_t>(std::min(r, nr - 1)) * nc_all + std::min(c, nc - 1)) * W;
      acc[r][c] = vload(a[r][c]);
    }
  for (int64_t v = 0; v < nvec; ++v) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload(w[r] + v * W);
    for (int c = 0; c < C; ++c) {
      const Vec xv = vload(xp[c] + v * W);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(wv[r], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(a[r][c], acc[r][c]);
}

// Many tokens (prefill): rows [r0, r0 + nr) are dequantised kChunkGroups groups at a time into wbuf
// and reused by every token of a kTokenBlock block, so dequantising costs 1 / kTokenBlock of the
// products; x's chunk for the block (kTokenBlock x 512 floats) stays in L2.
static void tiled_rows(const QMat& m, const Lut& lut, int64_t r0, int nr, const float* const* xs, int nc, float* out,
                       int64_t ostride, Scratch& s) {
  const int64_t groups = (m.K + 31) / 32;
  const int64_t wstride = kChunkGroups * 32;
  s.wbuf.resize(static_cast<size_t>(kTileRows * wstride));
  for (int t0 = 0; t0 < nc; t0 += kTokenBlock) {
    const int tn = std::min(kTokenBlock, nc - t0);
    s.abuf.assign(static_cast<size_t>(nr) * tn * W, 0.0f);
    for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
      const int64_t gn = std::min<int64_t>(kChunkGroups, groups - g0);
      for (int r = 0; r < nr; ++r)
        for (int64_t g = 0; g < gn; ++g) {
          Vec w[kGroupVecs];
          dequant_group(m, lut, r0 + r, (g0 + g) * 32, w);
          for (int p = 0; p < kGroupVecs; ++p) vstore(s.wbuf.data() + r * wstride + g * 32 + p * W, w[p]);
        }
      for (int rb = 0; rb < nr; rb += kMicroR)
        for (int cb = 0; cb < tn; cb += kMicroC)
          micro_block<kMicroR, kMicroC>(s.wbuf.data() + rb * wstride, wstride, std::min(kMicroR, nr - rb),
                                        xs + t0 + cb, g0 * 32, std::min(kMicroC, tn - cb), gn * kGroupVecs,
                                        s.abuf.data() + static_cast<int64_t>(rb) * tn * W + cb * W, tn);
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < tn; ++c)
        out[(t0 + c) * ostride + r] = vsum(vload(s.abuf.data() + (static_cast<int64_t>(r) * tn + c) * W));
  }
}

// out[c * ostride + r] = <row r0 + r, xs[c]> for r < nr <= kTileRows, c < nc: the registers path for
// decode-sized token counts, the tiled one above (same bits) for more.
static void rows_dot(const QMat& m, int64_t r0, int nr, const float* const* xs, int nc, float* out, int64_t ostride,
                     Scratch& s) {
  const Lut lut = make_lut(m.lut);
  if (nc > kFusedMaxTokens) {
    tiled_rows(m, lut, r0, nr, xs, nc, out, ostride, s);
    return;
  }
  if (nc == 1) {
    for (int r = 0; r < nr; r += kFusedR1)
      fused_block<kFusedR1, 1>(m, lut, r0 + r, std::min(kFusedR1, nr - r), xs, 1, out + r, ostride);
    return;
  }
  for (int c = 0; c < nc; c += kFusedC)
    for (int r = 0; r < nr; r += kFusedR)
      fused_block<kFusedR, kFusedC>(m, lut, r0 + r, std::min(kFusedR, nr - r), xs + c, std::min(kFusedC, nc - c),
                                    out + c * ostride + r, ostride);
}
