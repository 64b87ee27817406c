// The tile kernels of cpu_quant_moe.cpp, one per instruction set, each under its own `#pragma GCC
// target`: the build passes no -march flag, so only the chosen path's instructions run and the portable
// one runs on any x86-64 CPU. The tile layout (kernels/cpu/quant_moe_layout.py) puts "lanes = output
// rows": a 64-byte block holds 16 rows x 8 columns as 32 words, word i = (row i / 2, column parity
// i % 2), nibble j of it = column 8L + 2j + parity. A shift by 4j and a 16-bit table lookup give 16 rows
// x 2 columns of bf16 codes (vdpbf16ps against one broadcast activation pair); a shift by 4m and a
// 32-bit lookup give 16 rows x 1 column of float32 codes (FMA against one broadcast activation).
//
// Numerics, every path: per (row, token, 32-column group) the codes times the activations are summed
// in float32 (a fixed split into partial sums), then times the group's scale and added to the row's
// float32 sum, group after group. The codes (-8..7, E2M1 values) and bf16 activations are exact, so the
// only roundings are float32 additions; no code is ever rounded together with its scale. A token's
// result does not depend on how many tokens share the call (the token blocks only repeat the loads).
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_quant_moe_common.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the tile layout's 16-bit words are little-endian"
#endif

namespace cpu_quant_moe {

const float kInt4Lut[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
const float kE2M1Lut[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

namespace {

// Bytes of the tile's stream prefetched ahead of the block being read, on the AVX-512 paths: into L1 at
// kAhead (4096 beat 1024 and 2048 at batch 1-4, idle machine), and into L2 at kAheadL2. One core's L1
// misses in flight cap what it pulls from DRAM (about 10 GB/s per Zen 4 core here with L1 prefetches
// alone, where a float32 sum streams 21); the far L2 requests keep more lines in flight. On a 2-core
// Zen 4 VM, experts of hidden 2048 / width 1024 at batch 1: 14-15 -> 18-23 GB/s (bf16 activations),
// 14-16 -> 16-20 (float32); 8192-24576 all did about as well as 16384.
constexpr int kAhead = 4096;
constexpr int kAheadL2 = 16384;
// the AVX2 path's distance: on a 2-core AVX2 EPYC (Zen 3) 8192 read 16.3 GB/s at batch 1 against 14.4
// for 1024 and 13.0 for 4096 (INT4, K2 experts)
constexpr int kAheadAvx2 = 8192;
// Partial sums per (token, group) on AVX-512: independent chains, so one token's FMAs do not wait on
// each other (the split is fixed, whatever the token count: a token's result does not depend on its batch).
constexpr int kParts = 4;

inline void prefetch_avx512(const uint8_t* block) {
  _mm_prefetch(reinterpret_cast<const char*>(block + kAhead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(block + kAheadL2), _MM_HINT_T1);
}

// 32-byte aligned storage for the decoded-code buffers (aligned vector loads and stores).
template <class T>
struct AlignedAlloc {
  using value_type = T;
  AlignedAlloc() = default;
  template <class U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const AlignedAlloc<U>&) const { return true; }
  template <class U>
  bool operator!=(const AlignedAlloc<U>&) const { return false; }
};

// Scalar float of scale i of a tile's scale block.
inline float scale_at(const uint8_t* s, int64_t i, bool e8m0) {
  if (e8m0) return g_e8m0[s[i]];
  uint16_t b;
  std::memcpy(&b, s + 2 * i, 2);
  const uint32_t bits = static_cast<uint32_t>(b) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

// ---------------------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#include "cpu_quant_moe_avx512.h"  // scales16, bf16_table
namespace {

inline __m512 sum4(const __m512* p) { return _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])); }

template <int C, bool kE8M0>
void f32_block_avx512(const Tiles& t, const uint8_t* tile, int nr, const float* const* x, float* out, int64_t os) {
  const __m512 lut = _mm512_loadu_ps(kE8M0 ? kE2M1Lut : kInt4Lut);
  const uint8_t* codes = tile + t.scale_block;
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* blk = codes + g * 256;
    __m512 part[C][kParts];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < kParts; ++p) part[c][p] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      prefetch_avx512(blk + 64 * L);
      const __m512i v = _mm512_loadu_si512(blk + 64 * L);
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) {
        // permutexvar reads the low 4 bits of each lane: no mask after the shift
        const __m512 w = _mm512_permutexvar_ps(m ? _mm512_srli_epi32(v, 4 * m) : v, lut);
        const int64_t col = g * 32 + 8 * L + 2 * (m & 3) + (m >> 2);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) part[c][m & 3] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[c][col]), part[c][m & 3]);
      }
    }
    const __m512 s = scales16<kE8M0>(tile, g);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(sum4(part[c]), s, acc[c]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + c * os, keep, acc[c]);
}

}  // namespace

void tile_dot_avx512(const Tiles& t, int64_t tile, int nr, const float* const* x, int nc, float* out, int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  token_blocks<4>(nc, [&](auto c, int c0) {
    if (t.e8m0)
      f32_block_avx512<decltype(c)::value, true>(t, p, nr, x + c0, out + c0 * os, os);
    else
      f32_block_avx512<decltype(c)::value, false>(t, p, nr, x + c0, out + c0 * os, os);
  });
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- AVX-512 BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma")
namespace {

// scales16, bf16_table and sum4 of the AVX-512 region above serve here too (a superset target may call them).

template <int C, bool kE8M0>
void bf16_block(const Tiles& t, const uint8_t* tile, int nr, const uint16_t* const* x, float* out, int64_t os,
                __m512i table) {
  const uint8_t* codes = tile + t.scale_block;
  const uint32_t* xp[C];  // activation pairs (columns 2k, 2k + 1) as one 32-bit lane
  for (int c = 0; c < C; ++c) xp[c] = reinterpret_cast<const uint32_t*>(x[c]);
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* blk = codes + g * 256;
    __m512 part[C][kParts];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < kParts; ++p) part[c][p] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      prefetch_avx512(blk + 64 * L);
      const __m512i v = _mm512_loadu_si512(blk + 64 * L);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(j ? _mm512_srli_epi16(v, 4 * j) : v, table);
        const int64_t k = g * 16 + 4 * L + j;
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          part[c][j] = _mm512_dpbf16_ps(part[c][j], w, (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[c][k])));
      }
    }
    const __m512 s = scales16<kE8M0>(tile, g);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(sum4(part[c]), s, acc[c]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + c * os, keep, acc[c]);
}

}  // namespace

void tile_dot_avx512bf16(const Tiles& t, int64_t tile, int nr, const uint16_t* const* x, int nc, float* out,
                         int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  const __m512i table = bf16_table(t.e8m0 ? kE2M1Lut : kInt4Lut);
  token_blocks<4>(nc, [&](auto c, int c0) {
    if (t.e8m0)
      bf16_block<decltype(c)::value, true>(t, p, nr, x + c0, out + c0 * os, os, table);
    else
      bf16_block<decltype(c)::value, false>(t, p, nr, x + c0, out + c0 * os, os, table);
  });
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- AVX2
// The same sums as f32_block_avx512, the 16 rows as two halves of 8 (a 32-byte half of each block),
// with two partial sums per (token, group, half): part[m % 2]. AVX2 has 16 ymm registers and no
// 16-entry float lookup: one vpshufb per 32 codes turns nibbles into int8 values (E2M1 doubled:
// integers), and per 8 codes a second one moves them to the top byte of each 32-bit lane, which
// converts exactly (code_floats); about 2.6 vector instructions per 8 codes, against 5 for two
// 8-entry permutes and a blend.
//
// One or two tokens (decode): both halves in flight, four FMA chains per token, each code decoded
// once per token pair. Three or more: each chunk of kChunkGroups groups of the tile is decoded once
// into a float buffer (L1-resident), then blocks of up to 3 tokens run over it with 12 partial-sum
// registers, as a GEMM micro-kernel does. A (row, token)'s additions are the same in both, in the
// same order: its bits do not depend on its batch. Measured on a 2-core AVX2 EPYC (Zen 3), K2 experts,
// against the previous AVX2 kernel (permute lookups, two tokens at a time): 2.2x at batch 1, 3.1x at 64.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {

constexpr int kChunkGroups = 8;  // groups decoded at a time by the multi-token path (8 x 2 KB)

// int8 code values of the 16 nibbles, in both 128-bit lanes (vpshufb looks up within a lane)
inline __m256i code_table(bool e8m0) {
  return e8m0 ? _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
              : _mm256_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7,
                                 -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}

// A 32-byte half block's codes as int8 values: lo holds nibble 2b of byte b, hi nibble 2b + 1.
struct Codes {
  __m256i lo, hi;
};

inline Codes decode_bytes(__m256i v, __m256i table) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  return {_mm256_shuffle_epi8(table, _mm256_and_si256(v, nib)),
          _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib))};
}

// Nibble m of each 32-bit lane (8 rows, column 8L + 2 (m % 4) + m / 4 of the block) as floats, times
// 2^24: a second vpshufb moves its int8 value (byte m / 2 of the lane) to the lane's top byte and
// zeroes the rest, which converts exactly (one shuffle per 8 codes instead of a shift pair).
template <int b>
inline __m256i top_byte_mask() {
  constexpr char z = char(0x80);  // vpshufb: a set top bit writes zero
  return _mm256_setr_epi8(z, z, z, b, z, z, z, 4 + b, z, z, z, 8 + b, z, z, z, 12 + b,
                          z, z, z, b, z, z, z, 4 + b, z, z, z, 8 + b, z, z, z, 12 + b);
}

template <int m>
inline __m256 code_floats(const Codes& c) {
  const __m256i src = (m & 1) ? c.hi : c.lo;
  return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(src, top_byte_mask<(m >> 1)>()));
}

// code_floats gives the codes times 2^24 (E2M1 ones doubled: 2 x 2^24), which each group's sum
// divides off again (kUnscale) before its scale. The scaling makes no rounding differ from unscaled
// sums unless a partial sum leaves float32's normal range (activations beyond about 1e30, or group
// sums below about 1e-31, which then lose bits as subnormals).
constexpr float kUnscale = 0x1p-24f;

inline Codes load_codes(const uint8_t* p, __m256i table) {
  return decode_bytes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), table);
}

template <class F, int... m>
inline void each_m(F&& f, std::integer_sequence<int, m...>) {
  (f(std::integral_constant<int, m>{}), ...);
}

constexpr int col_of(int L, int m) { return 8 * L + 2 * (m & 3) + (m >> 2); }

// The 8 scales of rows 8h .. 8h + 7 of group g (E8M0 ones halved: the codes come doubled).
inline __m256 scales8(const uint8_t* s, int64_t g, int h, bool e8m0) {
  if (e8m0) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16 * g + 8 * h)));
    __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(b, 23));
    const __m256 zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(0x1p-127f), zero);
    v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_set1_epi32(255))));
    return _mm256_mul_ps(v, _mm256_set1_ps(0.5f));
  }
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32 * g + 16 * h)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

void store_rows(const __m256 acc[2], int nr, float* out) {
  alignas(32) float row[16];
  _mm256_store_ps(row, acc[0]);
  _mm256_store_ps(row + 8, acc[1]);
  std::memcpy(out, row, sizeof(float) * nr);
}

// The two paths' shared arithmetic, so that a (row, token) gets the same additions in the same order
// whichever runs it. part[c][h][m % 2] += codes of half h x activation of column col, for C tokens:
template <int C, int m>
inline void fma_tokens(__m256 (&part)[C][2][2], __m256 w0, __m256 w1, const float* const* x, int64_t col) {
  for (int c = 0; c < C; ++c) {
    const __m256 xb = _mm256_broadcast_ss(x[c] + col);
    part[c][0][m & 1] = _mm256_fmadd_ps(w0, xb, part[c][0][m & 1]);
    part[c][1][m & 1] = _mm256_fmadd_ps(w1, xb, part[c][1][m & 1]);
  }
}

// a group's end: its two partial sums, unscaled, times the group scale s, added to acc.
inline __m256 add_group(const __m256 (&part)[2], __m256 s, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_add_ps(part[0], part[1]), _mm256_set1_ps(kUnscale)), s, acc);
}

// One or two tokens: decode each half block and multiply it at once.
template <int C>
void row_avx2(const Tiles& t, const uint8_t* tile, int nr, const float* const* x, float* out, int64_t os) {
  const __m256i table = code_table(t.e8m0);
  const uint8_t* codes = tile + t.scale_block;
  __m256 acc[C][2];
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* blk = codes + g * 256;
    __m256 part[C][2][2];
    for (int c = 0; c < C; ++c) part[c][0][0] = part[c][0][1] = part[c][1][0] = part[c][1][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAheadAvx2 + 64 * L), _MM_HINT_T0);
      const Codes c0 = load_codes(blk + 64 * L, table), c1 = load_codes(blk + 64 * L + 32, table);
      each_m([&](auto mc) {
        constexpr int m = decltype(mc)::value;
        fma_tokens<C, m>(part, code_floats<m>(c0), code_floats<m>(c1), x, g * 32 + col_of(L, m));
      }, std::make_integer_sequence<int, 8>{});
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = scales8(tile, g, h, t.e8m0);
      for (int c = 0; c < C; ++c) acc[c][h] = add_group(part[c][h], s, acc[c][h]);
    }
  }
  for (int c = 0; c < C; ++c) store_rows(acc[c], nr, out + c * os);
}

// C tokens over decoded groups [g0, g0 + n): w holds, per group, L and m, the two halves' 8 codes as
// floats; acc [C][16] the tokens' running sums, updated group after group.
template <int C>
void block_avx2(const Tiles& t, const uint8_t* tile, const float* w, int64_t g0, int64_t n, const float* const* x,
                float* acc) {
  for (int64_t gi = 0; gi < n; ++gi) {
    const int64_t g = g0 + gi;
    const float* wg = w + gi * 512;
    __m256 part[C][2][2];
    for (int c = 0; c < C; ++c) part[c][0][0] = part[c][0][1] = part[c][1][0] = part[c][1][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      each_m([&](auto mc) {
        constexpr int m = decltype(mc)::value;
        const float* wm = wg + (L * 8 + m) * 16;
        fma_tokens<C, m>(part, _mm256_load_ps(wm), _mm256_load_ps(wm + 8), x, g * 32 + col_of(L, m));
      }, std::make_integer_sequence<int, 8>{});
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = scales8(tile, g, h, t.e8m0);
      for (int c = 0; c < C; ++c) {
        float* a = acc + c * 16 + 8 * h;
        _mm256_store_ps(a, add_group(part[c][h], s, _mm256_load_ps(a)));
      }
    }
  }
}

// Several tokens: decode a chunk of groups once, run every token block over it.
void rows_avx2(const Tiles& t, const uint8_t* tile, int nr, const float* const* x, int nc, float* out, int64_t os) {
  thread_local std::vector<float, AlignedAlloc<float>> w, acc;
  if (w.size() < kChunkGroups * 512) w.resize(kChunkGroups * 512);
  if (acc.size() < static_cast<size_t>(nc) * 16) acc.resize(static_cast<size_t>(nc) * 16);
  std::fill(acc.begin(), acc.begin() + static_cast<int64_t>(nc) * 16, 0.0f);
  const __m256i table = code_table(t.e8m0);
  const uint8_t* codes = tile + t.scale_block;
  for (int64_t g0 = 0; g0 < t.groups; g0 += kChunkGroups) {
    const int64_t n = std::min<int64_t>(kChunkGroups, t.groups - g0);
    for (int64_t gi = 0; gi < n; ++gi) {
      const uint8_t* blk = codes + (g0 + gi) * 256;
      float* wg = w.data() + gi * 512;
      for (int L = 0; L < 4; ++L) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + kAheadAvx2 + 64 * L), _MM_HINT_T0);
        const Codes c0 = load_codes(blk + 64 * L, table), c1 = load_codes(blk + 64 * L + 32, table);
        each_m([&](auto mc) {
          constexpr int m = decltype(mc)::value;
          _mm256_store_ps(wg + (L * 8 + m) * 16, code_floats<m>(c0));
          _mm256_store_ps(wg + (L * 8 + m) * 16 + 8, code_floats<m>(c1));
        }, std::make_integer_sequence<int, 8>{});
      }
    }
    // the next chunk's codes start coming in while this one is multiplied (the decode loop's own
    // prefetches run only while it decodes, and the tokens' blocks can take longer than the read)
    const uint8_t* next = codes + (g0 + n) * 256;
    for (int64_t i = 0; i < kChunkGroups * 256 && g0 + n < t.groups; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
    token_blocks<3>(nc, [&](auto c, int c0) {
      block_avx2<decltype(c)::value>(t, tile, w.data(), g0, n, x + c0, acc.data() + c0 * 16);
    });
  }
  for (int c = 0; c < nc; ++c) std::memcpy(out + c * os, acc.data() + c * 16, sizeof(float) * nr);
}

}  // namespace

void tile_dot_avx2(const Tiles& t, int64_t tile, int nr, const float* const* x, int nc, float* out, int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  if (nc == 1)
    row_avx2<1>(t, p, nr, x, out, os);
  else if (nc == 2)
    row_avx2<2>(t, p, nr, x, out, os);
  else
    rows_avx2(t, p, nr, x, nc, out, os);
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- portable
// The same sums in plain loops (the build's -ffp-contract=off keeps a * b + c two roundings, like the
// FMA paths' products of exact codes and activations, which need no rounding in the first place only
// for bf16 activations: float32 ones may differ from the vector paths in the last bits).
void tile_dot_scalar(const Tiles& t, int64_t tile, int nr, const float* const* x, int nc, float* out, int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  const uint8_t* codes = p + t.scale_block;
  const float* lut = t.e8m0 ? kE2M1Lut : kInt4Lut;
  for (int c = 0; c < nc; ++c)
    for (int r = 0; r < nr; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < t.groups; ++g) {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int L = 0; L < 4; ++L)
          for (int m = 0; m < 8; ++m) {
            const int j = m & 3, parity = m >> 2;
            const uint8_t byte = codes[g * 256 + 64 * L + 2 * (2 * r + parity) + j / 2];
            const float w = lut[(byte >> (4 * (j & 1))) & 15];
            part[m & 3] += w * x[c][g * 32 + 8 * L + 2 * j + parity];
          }
        acc += ((part[0] + part[1]) + (part[2] + part[3])) * scale_at(p, g * kTileRows + r, t.e8m0);
      }
      out[c * os + r] = acc;
    }
}

}  // namespace cpu_quant_moe
