// The AMX-BF16 tile kernel of cpu_quant_moe.cpp (bf16 activations), under its own `#pragma GCC target`
// like the paths of cpu_quant_moe_isa.cpp: the build passes no -mamx flag, and cpu_quant_moe.cpp calls
// this only after cpuid, XCR0 and the Linux permission request (arch_prctl) said the tiles may be used.
//
// One TDPBF16PS per 32-column group: A = 16 tokens x 32 bf16 activations (one 64-byte row per token),
// B = the group's codes of 16 output rows as 16 pairs of columns in the VNNI layout, C = 16 tokens x 16
// rows of float32, zeroed before every group. B row k (columns 2k, 2k + 1) is exactly the vector that
// the AVX-512 BF16 path decodes from the tile layout (word 2n + p = code of row n, column 2k + p), so
// the decode is the same shift and vpermw, stored to L1 instead of fed to vdpbf16ps. The group's C is
// then multiplied by the group's 16 scales and added to each token's float32 row total in AVX-512,
// group after group: codes never meet their scales before the group sum, as on every other path.
//
// Numerics of the group sum, measured on this project's Xeon (random bf16 inputs against models in
// C++): TDPBF16PS sums, per output, the 16 even-column products in order in one float32 chain and the
// 16 odd-column ones in another, then returns C + (even + odd), each addition rounded to nearest even
// (76,800 of 76,800 cases); VDPBF16PS computes (acc + odd product) + even product per pair (320,000 of
// 320,000); both flush denormal inputs and results to zero. The AVX-512 BF16 path (four partial sums of
// pairs) therefore differs in the last bits of a group sum. It could reproduce the tile's order with
// two vdpbf16ps per pair (one of each pair's activations zeroed) in 16-long chains: twice its multiplies,
// where the tiles at one token already run within ~0.7-1.05x of today's path (not built); so a process with this path uses it for bf16 activations at
// every batch size, and a token's bits do not depend on its batch (each C row depends only on its A
// row: the tiles are configured to the block's tokens).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_quant_moe_common.h"

namespace cpu_quant_moe {

// A compiler without the AMX intrinsics (GCC < 11) still builds the extension, without this path.
#if defined(__x86_64__) && __has_include(<amxbf16intrin.h>)
const bool kAmxBuilt = true;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,amx-tile,amx-bf16")
#include "cpu_quant_moe_avx512.h"  // scales16, bf16_table
namespace {

constexpr int kAhead = 4096;  // bytes prefetched ahead in the tile's stream, as the AVX-512 paths

using kimitui_amx::TileConfig;

// Group g's 256 code bytes -> the 1 KB B tile (16 rows of 16 bf16 pairs).
inline void decode_group(const uint8_t* blk, __m512i table, uint8_t* b) {
#pragma GCC unroll 4
  for (int L = 0; L < 4; ++L) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + 64 * L), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(blk + 64 * L);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      _mm512_store_si512(b + 64 * (4 * L + j), _mm512_permutexvar_epi16(j ? _mm512_srli_epi16(v, 4 * j) : v, table));
  }
}

// acc[m] += C[m] * s for the first M rows of a stored C tile.
inline void scale_add(__m512* acc, const float* c, __m512 s, int M) {
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    if (m < M) acc[m] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * m), s, acc[m]);
}

// Tiles 0, 1: C (M rows of 16 floats); 2, 3: A (M tokens x 32 bf16); 4, 5: B (16 pairs x 16 rows).
inline void configure(int M) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 6; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = static_cast<uint8_t>(i < 4 ? M : 16);
  }
  _tile_loadconfig(&cfg);
}

// M <= 16 tokens from x (rows xs bytes apart) against one tile; `b(g)` gives group g's B tile (and may
// decode ahead). Groups go two at a time (C tiles 0 and 1); a pair's C is stored to a 4-slot ring and
// scaled into the row totals one pair later, so the loads do not wait on the tile stores. The
// scale-and-add stays in group order.
template <bool kE8M0, class B>
void block(const uint8_t* tile, int64_t groups, const uint8_t* x, int64_t xs, int M, B&& b, float* cbuf,
           __m512* acc) {
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  auto add = [&](int64_t g) { scale_add(acc, cbuf + 256 * (g & 3), scales16<kE8M0>(tile, g), M); };
  int64_t g = 0, pending = -1;  // pending: the first group of a stored pair not yet added
  for (; g + 2 <= groups; g += 2) {
    const uint8_t* b0 = b(g);
    const uint8_t* b1 = b(g + 1);
    _tile_zero(0);
    _tile_loadd(2, x + 64 * g, xs);
    _tile_loadd(4, b0, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_zero(1);
    _tile_loadd(3, x + 64 * (g + 1), xs);
    _tile_loadd(5, b1, 64);
    _tile_dpbf16ps(1, 3, 5);
    if (pending >= 0) {
      add(pending);
      add(pending + 1);
    }
    _tile_stored(0, cbuf + 256 * (g & 3), 64);
    _tile_stored(1, cbuf + 256 * ((g + 1) & 3), 64);
    pending = g;
  }
  if (g < groups) {
    const uint8_t* b0 = b(g);
    _tile_zero(0);
    _tile_loadd(2, x + 64 * g, xs);
    _tile_loadd(4, b0, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (pending >= 0) {
      add(pending);
      add(pending + 1);
      pending = -1;
    }
    _tile_stored(0, cbuf + 256 * (g & 3), 64);
    add(g);
  }
  if (pending >= 0) {
    add(pending);
    add(pending + 1);
  }
}

template <bool kE8M0>
void tile_dot(const Tiles& t, int64_t tile, int nr, const uint16_t* x, int64_t xs, int nc, float* out, int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  const uint8_t* codes = p + t.scale_block;
  const __m512i table = bf16_table(kE8M0 ? kE2M1Lut : kInt4Lut);
  alignas(64) float cbuf[1024];
  thread_local std::vector<uint8_t> decoded;  // the whole tile's B tiles, when several blocks reuse them
  const auto* xb = reinterpret_cast<const uint8_t*>(x);
  const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
  __m512 acc[16];
  auto store = [&](int c0, int M) {
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(out + (c0 + m) * os, keep, acc[m]);
  };
  if (nc <= 16) {
    // One block: each group decoded into an L1 ring kLag groups before its product, so the tile load
    // does not wait on the decode's stores.
    constexpr int kLag = 4, kRing = 8;
    alignas(64) uint8_t ring[kRing * 1024];
    for (int64_t g = 0; g < std::min<int64_t>(kLag, t.groups); ++g)
      decode_group(codes + g * 256, table, ring + 1024 * (g % kRing));
    configure(nc);
    block<kE8M0>(p, t.groups, xb, xs, nc,
                 [&](int64_t g) {
                   if (g + kLag < t.groups) decode_group(codes + (g + kLag) * 256, table, ring + 1024 * ((g + kLag) % kRing));
                   return static_cast<const uint8_t*>(ring + 1024 * (g % kRing));
                 },
                 cbuf, acc);
    store(0, nc);
  } else {  // decode the tile once (groups x 1 KB, L2), then every block of 16 tokens reads it
    decoded.resize(static_cast<size_t>(t.groups) * 1024 + 64);
    uint8_t* d = decoded.data() + (-reinterpret_cast<uintptr_t>(decoded.data()) & 63);  // 64-byte aligned
    for (int64_t g = 0; g < t.groups; ++g) decode_group(codes + g * 256, table, d + 1024 * g);
    int configured = 0;
    for (int c0 = 0; c0 < nc; c0 += 16) {
      const int M = std::min(16, nc - c0);
      if (M != configured) configure(configured = M);
      block<kE8M0>(p, t.groups, xb + c0 * xs, xs, M,
                   [&](int64_t g) { return static_cast<const uint8_t*>(d + 1024 * g); }, cbuf, acc);
      store(c0, M);
    }
  }
  _tile_release();
}

}  // namespace

void tile_dot_amx_bf16(const Tiles& t, int64_t tile, int nr, const uint16_t* x, int64_t xs, int nc, float* out,
                       int64_t os) {
  if (t.e8m0)
    tile_dot<true>(t, tile, nr, x, xs, nc, out, os);
  else
    tile_dot<false>(t, tile, nr, x, xs, nc, out, os);
}
#pragma GCC pop_options
#else
const bool kAmxBuilt = false;
void tile_dot_amx_bf16(const Tiles&, int64_t, int, const uint16_t*, int64_t, int, float*, int64_t) { std::abort(); }
#endif

}  // namespace cpu_quant_moe
