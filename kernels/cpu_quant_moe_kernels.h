// The per-instruction-set kernels of cpu_quant_moe.cpp. This file is included once per instruction set,
// inside that set's namespace and `#pragma GCC target` region, after the set's vector primitives:
//   W (floats per vector), Vec, Lut, make_lut(const float[16]), scale_lut(Lut, float), vzero, vload,
//   vstore, vfma(a, b, acc), vsum(Vec), dequant32(const uint8_t bytes[16], const Lut& scaled, Vec out[32 / W]).
// The table is scaled once per group (lut[q] * s is exact, so this equals scaling each weight).
// dequant32 writes a 32-column group in the order perm_index() gives (even columns of each W-byte run,
// then its odd ones), so nibbles need no shuffles; activations are stored in the same order.
//
// Numerics: every output is one Vec accumulator per (weight row, token), fed the dequantised weight
// (exact in float32: a 4-bit code times a bf16 or power-of-two scale) times the activation, group by
// group in column order, then vsum. The register path (fused_block) and the tiled path (tiled_rows)
// run exactly that sequence, so a row's result does not depend on how many tokens share its expert.

constexpr int kGroupVecs = 32 / W;
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead each weight row is prefetched

// Row r's 32-column group starting at k0, dequantised. The last group of a row whose packed bytes end
// before 16 (INT4 with K % 32 != 0) is read through a zero-padded copy: never past the row's bytes.
static inline void dequant_group(const QMat& m, const Lut& lut, int64_t r, int64_t k0, Vec* out) {
  const uint8_t* row = m.data + r * m.row_bytes;
  const Lut scaled = scale_lut(lut, group_scale(m, r, k0));
  const int64_t b0 = k0 / 2;
  if (b0 + 16 <= m.row_bytes) {
    dequant32(row + b0, scaled, out);
    return;
  }
  alignas(64) uint8_t tail[16] = {0};
  std::memcpy(tail, row + b0, static_cast<size_t>(m.row_bytes - b0));
  dequant32(tail, scaled, out);
}

// The scale of group i of a row (scales at s): a bf16 (the top half of a float32) or an E8M0 byte.
template <bool kE8M0>
static inline float row_scale(const uint8_t* s, int64_t i) {
  if (kE8M0) return g_e8m0[s[i]];
  uint16_t b;
  std::memcpy(&b, s + 2 * i, 2);
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// out[c * ostride + r] = <row r0 + r, xs[c]> for r < nr <= R, c < nc <= C. R x C accumulators stay in
// registers over all of K; each group of each row is dequantised once for the C tokens. Rows and
// tokens past nr / nc repeat the last one (computed, not stored), so the loop has no tail branches.
template <int R, int C, bool kE8M0>
static void fused_block(const QMat& m, const Lut& lut, int64_t r0, int nr, const float* const* xs, int nc,
                        float* out, int64_t ostride) {
  Vec acc[R][C];
  int64_t rows[R];
  const uint8_t *wrow[R], *srow[R];
  const float* x[C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    rows[r] = r0 + std::min(r, nr - 1);
    wrow[r] = m.data + rows[r] * m.row_bytes;
    srow[r] = m.scale + rows[r] * m.scale_row * (kE8M0 ? 1 : 2);
  }
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) x[c] = xs[std::min(c, nc - 1)];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const int64_t groups = (m.K + 31) / 32;
  const int64_t whole = std::min(groups, m.row_bytes / 16);  // groups whose 16 bytes lie inside the row
  const int64_t per_scale = m.group / 32;  // groups of 32 columns per scale
  int64_t si = 0, left = per_scale;         // scale index of group g, without a division per group
  for (int64_t g = 0; g < groups; ++g) {
    Vec xv[C][kGroupVecs];
    if ((g & 3) == 0) {
      // R weight rows and R scale rows are read at once: more streams than the hardware prefetcher
      // follows, so each row's bytes kPrefetchBytes ahead are requested explicitly (addresses formed
      // as integers: past a row's end they are only hints, never dereferenced)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const uintptr_t w_ahead = reinterpret_cast<uintptr_t>(wrow[r]) + g * 16 + kPrefetchBytes;
        __builtin_prefetch(reinterpret_cast<const void*>(w_ahead));
        if ((g & 63) == 0) {
          const uintptr_t s_ahead = reinterpret_cast<uintptr_t>(srow[r]) + si * (kE8M0 ? 1 : 2) + kPrefetchBytes / 8;
          __builtin_prefetch(reinterpret_cast<const void*>(s_ahead));
        }
      }
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
      for (int p = 0; p < kGroupVecs; ++p) xv[c][p] = vload(x[c] + g * 32 + p * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      Vec w[kGroupVecs];
      if (g < whole)
        dequant32(wrow[r] + g * 16, scale_lut(lut, row_scale<kE8M0>(srow[r], si)), w);
      else
        dequant_group(m, lut, rows[r], g * 32, w);
#pragma GCC unroll 16
      for (int p = 0; p < kGroupVecs; ++p)
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[r][c] = vfma(w[p], xv[c][p], acc[r][c]);
    }
    if (--left == 0) {
      ++si;
      left = per_scale;
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
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      a[r][c] = abuf + (static_cast<int64_t>(std::min(r, nr - 1)) * nc_all + std::min(c, nc - 1)) * W;
      acc[r][c] = vload(a[r][c]);
    }
  for (int64_t v = 0; v < nvec; ++v) {
    Vec wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) wv[r] = vload(w[r] + v * W);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const Vec xv = vload(xp[c] + v * W);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(wv[r], xv, acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
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
        for (int cb = 0; cb < tn; cb += kMicroC) {
          const int cn = std::min(kMicroC, tn - cb);
          // a last block of fewer tokens runs a narrower kernel rather than computing repeats
          auto run = [&](auto c) {
            micro_block<kMicroR, decltype(c)::value>(s.wbuf.data() + rb * wstride, wstride, std::min(kMicroR, nr - rb),
                                                     xs + t0 + cb, g0 * 32, cn, gn * kGroupVecs,
                                                     s.abuf.data() + static_cast<int64_t>(rb) * tn * W + cb * W, tn);
          };
          switch (cn) {
            case 1: run(std::integral_constant<int, 1>{}); break;
            case 2: run(std::integral_constant<int, 2>{}); break;
            case 3: run(std::integral_constant<int, 3>{}); break;
            case 4: run(std::integral_constant<int, (kMicroC >= 4 ? 4 : kMicroC)>{}); break;
            case 5: run(std::integral_constant<int, (kMicroC >= 5 ? 5 : kMicroC)>{}); break;
            default: run(std::integral_constant<int, kMicroC>{}); break;
          }
        }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < tn; ++c)
        out[(t0 + c) * ostride + r] = vsum(vload(s.abuf.data() + (static_cast<int64_t>(r) * tn + c) * W));
  }
}

template <bool kE8M0>
static void fused_rows(const QMat& m, const Lut& lut, int64_t r0, int nr, const float* const* xs, int nc, float* out,
                       int64_t ostride) {
  if (nc == 1) {
    for (int r = 0; r < nr; r += kFusedR1)
      fused_block<kFusedR1, 1, kE8M0>(m, lut, r0 + r, std::min(kFusedR1, nr - r), xs, 1, out + r, ostride);
    return;
  }
  for (int c = 0; c < nc; c += kFusedC) {
    const int cn = std::min(kFusedC, nc - c);
    auto run = [&](auto cc) {  // a last block of fewer tokens: a narrower kernel, no repeated tokens
      for (int r = 0; r < nr; r += kFusedR)
        fused_block<kFusedR, decltype(cc)::value, kE8M0>(m, lut, r0 + r, std::min(kFusedR, nr - r), xs + c, cn,
                                                         out + c * ostride + r, ostride);
    };
    if (cn == kFusedC)
      run(std::integral_constant<int, kFusedC>{});
    else if (cn == 1)
      run(std::integral_constant<int, 1>{});
    else if (cn == 2)
      run(std::integral_constant<int, 2>{});
    else
      run(std::integral_constant<int, 3>{});
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
  if (m.e8m0)
    fused_rows<true>(m, lut, r0, nr, xs, nc, out, ostride);
  else
    fused_rows<false>(m, lut, r0, nr, xs, nc, out, ostride);
}
