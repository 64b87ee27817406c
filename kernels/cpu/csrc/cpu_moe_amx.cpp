// AMX-BF16 products for the routed experts of the few-row MoE (moe() in cpu_few_rows.cpp), bf16 weights,
// and for bf16 linears of a few dozen rows on weights kept in no packed copy (linear_amx: the LM head;
// amx_product: MLA's W_UV in a wide decode step; amx_product_kn: its W_UK, a [K, N] weight re-laid out
// into B tiles per call, small enough that this costs little beside the product at 17+ rows).
//
// A decode step of a few dozen rows gives each expert a handful of (token, slot) pairs. oneDNN's bf16
// product takes the weight as its B operand and lays it out again (VNNI pairs) on every call, and
// experts cannot keep a second, packed copy (Kimi K2's are 1T parameters). Here the weight is the A
// operand instead, as it lies: out^T [N, tokens] = W [N, K] x act^T, so an A tile is 16 plain weight
// rows x 32 bf16 (a strided tile load, no re-layout), and only the few activation rows are re-laid
// out per call into the B operand (pairs of K interleaved: B[k / 2][token][2], 16 tokens a tile, zero
// past the last token and past K). C tiles (16 weight rows x 16 tokens, float32) accumulate over the
// whole of K and are transposed into the tokens' rows when stored. An expert runs w13, the gated
// activation (gated_mul, float32, on the float32 sums), then w2 on the activation rounded to bf16, as
// the oneDNN path feeds it; the products sum in float32.
//
// Numerics: activations are rounded to bf16 (vcvtne2ps2bf16: nearest even, a denormal in or out is
// zero, as TDPBF16PS treats denormals anyway); TDPBF16PS then sums each 32-column step's products in
// float32 (cpu_quant_moe_amx.cpp describes its order) onto C. A token's result does not depend on
// the other tokens of its expert (each C column depends only on its B column).
//
// Under its own `#pragma GCC target`, like cpu_quant_moe_amx.cpp: the extension's variants are built
// for x86-64-v4, -v3 and plain x86-64, and no tile instruction runs before moe_amx_usable() (cpuid,
// XCR0, the Linux permission request: cpu_amx.h) said yes.
#include "cpu_few_rows.h"

#include "cpu_amx.h"

#include <atomic>

#if defined(__x86_64__) && __has_include(<amxbf16intrin.h>)
#define KIMITUI_MOE_AMX 1
#include <immintrin.h>
#endif

namespace {
// moe() runs an expert here when it has g_amx_min to g_amx_max pairs (moe_amx_rows sets them, for the
// benchmarks' alternation). benchmarks/cpu_moe_amx.py, 2-core Xeon with AMX, the vs_vllm_cpu model's
// experts (hidden 1024, width 256), one MoE layer against the earlier path (widening loops below 6
// pairs, oneDNN's bf16 product from 6): 1.15x at 1 pair per expert, 1.3x at 4, 2.1-2.3x at 6-32, 2.0x
// at 64, 1.4x at 128, 1.16x at 256, 1.06x at 512, where oneDNN's re-layout of the weight is paid
// back over the rows; past 512 oneDNN keeps them.
std::atomic<int64_t> g_amx_min{1}, g_amx_max{512};
}  // namespace

namespace kimitui_cpu {

bool moe_amx_usable() {
#ifdef KIMITUI_MOE_AMX
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16") && kimitui_amx::amx_bf16_usable();
  }();
  return ok;
#else
  return false;
#endif
}

bool moe_amx_rows_in(int64_t m) {
  return m >= g_amx_min.load(std::memory_order_relaxed) && m <= g_amx_max.load(std::memory_order_relaxed);
}

}  // namespace kimitui_cpu

std::tuple<int64_t, int64_t> moe_amx_rows(int64_t lo, int64_t hi) {
  TORCH_CHECK(lo >= 1 && hi >= 0, "moe_amx_rows: lo must be >= 1 and hi >= 0, got ", lo, ", ", hi);
  return {g_amx_min.exchange(lo), g_amx_max.exchange(hi)};
}

#ifdef KIMITUI_MOE_AMX
namespace kimitui_cpu {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,amx-tile,amx-bf16")
namespace {

constexpr int64_t kStep = 32;         // K columns per tile product
constexpr int64_t kTileU16 = 16 * 32;  // one 1 KB tile in uint16

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 64-byte aligned storage grown on demand, one per thread and purpose.
struct Buffer {
  std::vector<uint8_t> bytes;
  template <class T>
  T* get(int64_t n) {
    const size_t want = static_cast<size_t>(n) * sizeof(T) + 64;
    if (bytes.size() < want) bytes.resize(want);
    return reinterpret_cast<T*>(bytes.data() + (-reinterpret_cast<uintptr_t>(bytes.data()) & 63));
  }
};

// r[i][j] -> r[j][i] for 16 x 16 32-bit values.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + c], 128-bit lane L: rows 4g..4g+3 of column 4L + c
  __m512i u[16];
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[c + 4] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[c + 8] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// m float32 rows of K -> the B operand: ceil(m / 16) token blocks x ceil(K / 32) steps of one tile
// each, tile row j = the pairs (2j, 2j + 1) of its 16 tokens, zero past m and K.
void pack_b(const float* const* rows, int64_t m, int64_t K, uint16_t* b) {
  const int64_t steps = ceil_div(K, kStep);
  for (int64_t t0 = 0; t0 < m; t0 += 16) {
    const int64_t mt = std::min<int64_t>(16, m - t0);
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k0 = s * kStep, kw = std::min(kStep, K - k0);
      const __mmask16 lo = static_cast<__mmask16>(kw >= 16 ? 0xffff : (1u << kw) - 1);
      const __mmask16 hi = static_cast<__mmask16>(kw >= 32 ? 0xffff : kw <= 16 ? 0 : (1u << (kw - 16)) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        if (i < mt) {
          const float* p = rows[t0 + i] + k0;
          r[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + 16), _mm512_maskz_loadu_ps(lo, p));
        } else {
          r[i] = _mm512_setzero_si512();
        }
      }
      transpose16(r);
      uint16_t* tile = b + ((t0 / 16) * steps + s) * kTileU16;
      for (int j = 0; j < 16; ++j) _mm512_store_si512(tile + 32 * j, r[j]);
    }
  }
}

// C tile c (16 weight rows x 16 tokens, float32, rows 64 bytes apart) -> out[t * ldo + n] for n < nr,
// t < mt.
inline void store_c(const float* c, int64_t nr, int64_t mt, float* out, int64_t ldo) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + 16 * i);
  transpose16(r);
  const __mmask16 keep = static_cast<__mmask16>(nr >= 16 ? 0xffff : (1u << nr) - 1);
  for (int64_t t = 0; t < mt; ++t) _mm512_mask_storeu_ps(out + t * ldo, keep, _mm512_castsi512_ps(r[t]));
}

// All eight tiles 16 rows x 64 bytes: C 0-3 (two weight blocks x two token blocks), A 4-5, B 6-7.
inline void configure() {
  kimitui_amx::TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Where a weight block's A tiles come from: `direct` steps straight from the weight rows (stride
// bytes apart), the rest from `tail` (64 bytes a row).
struct ASource {
  const uint16_t* base;
  int64_t stride;
  int64_t direct;
  const uint16_t* tail;
  const uint16_t* at(int64_t s) const { return s < direct ? base + s * kStep : tail; }
  int64_t stride_at(int64_t s) const { return s < direct ? stride : 64; }
};

// out[t * ldo + n] = sum_k w[n, k] * x_t[k] for n < N, t < m; b: the m rows packed by pack_b.
void gemm_wt(const bf16* w, int64_t N, int64_t K, const uint16_t* b, int64_t m, float* out, int64_t ldo) {
  thread_local Buffer pad_buf;
  const int64_t steps = ceil_div(K, kStep), full = K / kStep, tbs = ceil_div(m, 16);
  alignas(64) uint16_t tails[2][kTileU16];
  alignas(64) float cbuf[4][256];
  const auto* wp = reinterpret_cast<const uint16_t*>(w);
  uint16_t* pad = nullptr;  // the last, partial weight block: [16][steps * 32], zero-padded
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    ASource src[2];
    int64_t nr[2];
    for (int blk = 0; blk < 2; ++blk) {
      const int64_t nb = n0 + 16 * blk;
      nr[blk] = std::clamp<int64_t>(N - nb, 0, 16);
      if (nr[blk] == 16) {
        src[blk] = {wp + nb * K, K * 2, full, tails[blk]};
        if (full < steps) {  // the K tail: zero-padded copy of the rows' last columns
          std::memset(tails[blk], 0, sizeof tails[blk]);
          for (int i = 0; i < 16; ++i)
            std::memcpy(tails[blk] + 32 * i, wp + (nb + i) * K + full * kStep, (K - full * kStep) * 2);
        }
      } else if (nr[blk] > 0) {
        if (!pad) pad = pad_buf.get<uint16_t>(16 * steps * kStep);
        std::memset(pad, 0, 16 * steps * kStep * 2);
        for (int64_t i = 0; i < nr[blk]; ++i) std::memcpy(pad + i * steps * kStep, wp + (nb + i) * K, K * 2);
        src[blk] = {pad, steps * kStep * 2, steps, nullptr};
      }
    }
    // the next 32 weight rows (contiguous), prefetched into L2 over this block's first token pass
    const uint8_t* next = reinterpret_cast<const uint8_t*>(wp + std::min(N, n0 + 32) * K);
    const int64_t next_bytes = (std::min(N, n0 + 64) - std::min(N, n0 + 32)) * K * 2;
    const int64_t chunk = ceil_div(ceil_div(next_bytes, steps), 64) * 64;
    for (int64_t tb = 0; tb < tbs; tb += 2) {
      const bool two_n = nr[1] > 0, two_t = tb + 1 < tbs;
      const uint16_t* b0 = b + tb * steps * kTileU16;
      const uint16_t* b1 = b0 + steps * kTileU16;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        if (tb == 0)
          for (int64_t o = s * chunk; o < std::min(next_bytes, (s + 1) * chunk); o += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
        _tile_loadd(4, src[0].at(s), src[0].stride_at(s));
        _tile_loadd(6, b0 + s * kTileU16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_t) {
          _tile_loadd(7, b1 + s * kTileU16, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_n) {
          _tile_loadd(5, src[1].at(s), src[1].stride_at(s));
          _tile_dpbf16ps(2, 5, 6);
          if (two_t) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, cbuf[0], 64);
      if (two_t) _tile_stored(1, cbuf[1], 64);
      if (two_n) _tile_stored(2, cbuf[2], 64);
      if (two_n && two_t) _tile_stored(3, cbuf[3], 64);
      for (int blk = 0; blk < (two_n ? 2 : 1); ++blk)
        for (int j = 0; j < (two_t ? 2 : 1); ++j) {
          const int64_t t0 = (tb + j) * 16;
          store_c(cbuf[2 * blk + j], nr[blk], std::min<int64_t>(16, m - t0), out + t0 * ldo + n0 + 16 * blk, ldo);
        }
    }
  }
}

// m float32 rows of K -> A tiles: ceil(m / 16) blocks of 16 rows x ceil(K / 32) * 32 bf16, rows
// `stride` bf16 apart, zero past m and K.
void pack_a(const float* const* rows, int64_t m, int64_t K, uint16_t* a, int64_t stride) {
  const int64_t steps = ceil_div(K, kStep);
  for (int64_t t = 0; t < ceil_div(m, 16) * 16; ++t)
    for (int64_t s = 0; s < steps; ++s) {
      uint16_t* dst = a + t * stride + s * kStep;
      if (t >= m) {
        _mm512_storeu_si512(dst, _mm512_setzero_si512());
        continue;
      }
      const int64_t k0 = s * kStep, kw = std::min(kStep, K - k0);
      const __mmask16 lo = static_cast<__mmask16>(kw >= 16 ? 0xffff : (1u << kw) - 1);
      const __mmask16 hi = static_cast<__mmask16>(kw >= 32 ? 0xffff : kw <= 16 ? 0 : (1u << (kw - 16)) - 1);
      const float* p = rows[t] + k0;
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + 16), _mm512_maskz_loadu_ps(lo, p)));
    }
}

// w [K, N] bf16 row-major -> B tiles: ceil(N / 16) column blocks x ceil(K / 32) steps, tile row j =
// the pairs (w[2j][n], w[2j + 1][n]) of its 16 columns, zero past K and N.
void pack_b_weight(const bf16* w, int64_t K, int64_t N, uint16_t* b) {
  const int64_t steps = ceil_div(K, kStep);
  const auto* wp = reinterpret_cast<const uint16_t*>(w);
  for (int64_t j = 0; j < ceil_div(N, 16); ++j) {
    const int64_t n0 = 16 * j, nw = std::min<int64_t>(16, N - n0);
    const __mmask32 keep = static_cast<__mmask32>(nw >= 16 ? 0xffff : (1u << nw) - 1);
    for (int64_t s = 0; s < steps; ++s) {
      uint16_t* tile = b + (j * steps + s) * kTileU16;
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t k = s * kStep + 2 * r;
        const __m512i e = k < K ? _mm512_maskz_loadu_epi16(keep, wp + k * N + n0) : _mm512_setzero_si512();
        const __m512i o = k + 1 < K ? _mm512_maskz_loadu_epi16(keep, wp + (k + 1) * N + n0) : _mm512_setzero_si512();
        const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(e)),
                                              _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(o)), 16));
        _mm512_store_si512(tile + 32 * r, pairs);
      }
    }
  }
}

}  // namespace

void amx_product_kn(const float* const* xs, int64_t m, const bf16* w, int64_t K, int64_t N, float* y, int64_t ldy) {
  thread_local Buffer abuf, bbuf;
  const int64_t steps = ceil_div(K, kStep), tbs = ceil_div(m, 16), nbs = ceil_div(N, 16), stride = steps * kStep;
  uint16_t* a = abuf.get<uint16_t>(tbs * 16 * stride);
  uint16_t* b = bbuf.get<uint16_t>(nbs * steps * kTileU16);
  pack_a(xs, m, K, a, stride);
  pack_b_weight(w, K, N, b);
  alignas(64) float cbuf[256];
  configure();
  // C 0-3: two token blocks x two column blocks; A 4-5 (token blocks), B 6-7 (column blocks)
  for (int64_t j = 0; j < nbs; j += 2) {
    const bool two_n = j + 1 < nbs;
    for (int64_t tb = 0; tb < tbs; tb += 2) {
      const bool two_t = tb + 1 < tbs;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, a + tb * 16 * stride + s * kStep, stride * 2);
        _tile_loadd(6, b + (j * steps + s) * kTileU16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) {
          _tile_loadd(7, b + ((j + 1) * steps + s) * kTileU16, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_t) {
          _tile_loadd(5, a + (tb + 1) * 16 * stride + s * kStep, stride * 2);
          _tile_dpbf16ps(2, 5, 6);
          if (two_n) _tile_dpbf16ps(3, 5, 7);
        }
      }
      // C[i][c] = token 16 * (tb + i / 2) + row, column 16 * (j + i % 2) + c
      auto put = [&](int i) {
        const int64_t t0 = (tb + i / 2) * 16, n0 = (j + i % 2) * 16, nw = std::min<int64_t>(16, N - n0);
        const __mmask16 keep = static_cast<__mmask16>(nw >= 16 ? 0xffff : (1u << nw) - 1);
        for (int64_t t = 0; t < std::min<int64_t>(16, m - t0); ++t)
          _mm512_mask_storeu_ps(y + (t0 + t) * ldy + n0, keep, _mm512_load_ps(cbuf + 16 * t));
      };
      _tile_stored(0, cbuf, 64);
      put(0);
      if (two_n) {
        _tile_stored(1, cbuf, 64);
        put(1);
      }
      if (two_t) {
        _tile_stored(2, cbuf, 64);
        put(2);
      }
      if (two_n && two_t) {
        _tile_stored(3, cbuf, 64);
        put(3);
      }
    }
  }
  _tile_release();
}

void moe_expert_amx(const float* const* xs, int64_t m, const bf16* w13, const bf16* w2, int64_t D, int64_t I,
                    float* y, int64_t act, float beta, float linear_beta) {
  thread_local Buffer bx, bh, gu_buf, h_buf;
  const int64_t tbs = ceil_div(m, 16), I2 = 2 * I;
  uint16_t* b1 = bx.get<uint16_t>(tbs * ceil_div(D, kStep) * kTileU16);
  uint16_t* b2 = bh.get<uint16_t>(tbs * ceil_div(I, kStep) * kTileU16);
  float* gu = gu_buf.get<float>(m * I2);
  float* h = h_buf.get<float>(m * I);
  configure();
  pack_b(xs, m, D, b1);
  gemm_wt(w13, I2, D, b1, m, gu, I2);
  std::vector<const float*> hs(m);
  for (int64_t t = 0; t < m; ++t) {
    gated_mul(gu + t * I2, gu + t * I2 + I, h + t * I, I, act, beta, linear_beta);
    hs[t] = h + t * I;
  }
  pack_b(hs.data(), m, I, b2);
  gemm_wt(w2, D, I, b2, m, y, D);
  _tile_release();
}

void amx_product(const float* const* xs, int64_t m, const bf16* w, int64_t N, int64_t K, float* y, int64_t ldy) {
  thread_local Buffer bb;
  uint16_t* b = bb.get<uint16_t>(ceil_div(m, 16) * ceil_div(K, kStep) * kTileU16);
  configure();
  pack_b(xs, m, K, b);
  gemm_wt(w, N, K, b, m, y, ldy);
  _tile_release();
}

void linear_amx(const float* const* xs, int64_t m, const bf16* w, int64_t N, int64_t K, float* y) {
  std::vector<uint8_t> bytes(ceil_div(m, 16) * ceil_div(K, kStep) * kTileU16 * 2 + 64);
  auto* b = reinterpret_cast<uint16_t*>(bytes.data() + (-reinterpret_cast<uintptr_t>(bytes.data()) & 63));
  pack_b(xs, m, K, b);
  // runs of 32 weight rows (gemm_wt's block) to the threads; each configures its own tiles
  parallel_runs(ceil_div(N, 32), N * K * 2, [&](int64_t i0, int64_t i1) {
    configure();
    const int64_t n0 = 32 * i0, n1 = std::min(N, 32 * i1);
    gemm_wt(w + n0 * K, n1 - n0, K, b, m, y + n0, N);
    _tile_release();
  });
}

#pragma GCC pop_options
}  // namespace kimitui_cpu
#else
namespace kimitui_cpu {
void moe_expert_amx(const float* const*, int64_t, const bf16*, const bf16*, int64_t, int64_t, float*, int64_t, float,
                    float) {
  std::abort();
}
void linear_amx(const float* const*, int64_t, const bf16*, int64_t, int64_t, float*) { std::abort(); }
void amx_product(const float* const*, int64_t, const bf16*, int64_t, int64_t, float*, int64_t) { std::abort(); }
void amx_product_kn(const float* const*, int64_t, const bf16*, int64_t, int64_t, float*, int64_t) { std::abort(); }
}  // namespace kimitui_cpu
#endif
