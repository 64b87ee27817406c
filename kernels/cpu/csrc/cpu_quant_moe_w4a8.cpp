// W4A8 tile kernels of cpu_quant_moe.cpp's moe_w4a8: 4-bit codes (INT4 or E2M1) times activations
// quantised to int8 per 32-column group (as llama.cpp's Q8_0, with a float32 scale), summed with
// int8 dot-product instructions, one path per instruction set under its own `#pragma GCC target`
// (the build passes no -march flag): AVX-512 VNNI (vpdpbusd zmm), AVX-VNNI (vpdpbusd ymm) and a
// portable one.
//
// The maths, every path (kernels/cpu/quant_moe_w4a8.py's reference is its specification):
// - an activation row x, per 32-column group: amax = max |x|, d = amax / 127, q = round-half-even(x *
//   (127 / amax)) (0 where amax is 0), asum = the sum of the group's q;
// - a code as an unsigned byte u: INT4 its stored nibble (q + 8), E2M1 twice its value plus 12
//   (0..24), so vpdpbusd's u8 x s8 product needs no sign handling: the group's integer sum is
//   sum(u * q) - off * asum (off 8 or 12), exact in int32 whatever the split into partial sums;
// - per (row, token), group after group in float32 without fused multiply-adds:
//   acc = acc + float(isum) * (w_scale * d); E2M1 rows end times 0.5 (their codes come doubled).
// So a token's result never depends on the path, the batch or the token blocking.
//
// Against the tile layout (kernels/cpu/quant_moe_layout.py) a 32-bit lane of a 64-byte block is one
// row: its bytes hold columns (0, 2), (4, 6), (1, 3), (5, 7) of the block as (low, high) nibbles. So
// the low nibbles pair with activations of columns 0, 4, 1, 5 and the high ones with 2, 6, 3, 7:
// quantize_q8 stores each group's int8 values in that order, two 32-bit words per block.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cpu_quant_moe_common.h"

namespace cpu_quant_moe {

// E2M1 nibble -> 2 x value + 12 (bit 3 the sign)
alignas(16) const uint8_t kE2M1Offset[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

namespace {

constexpr int kAhead = 4096, kAheadL2 = 16384;  // prefetch distances, as the float paths'
// position of column c (0..31) of a group in its quantised words: block L = c / 8, word 2L + hi, byte
constexpr int kSlot[8] = {0, 2, 4 + 0, 4 + 2, 1, 3, 4 + 1, 4 + 3};  // column c % 8 -> 4 * hi + byte

template <class T>
inline float as_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

template <class T>
void quantize_row(const T* x, int64_t K, int64_t groups, int32_t* q, float* d, int32_t* asum) {
  for (int64_t g = 0; g < groups; ++g) {
    float v[32];
    float amax = 0.0f;
    for (int c = 0; c < 32; ++c) {
      const int64_t col = g * 32 + c;
      v[c] = col < K ? as_float(x[col]) : 0.0f;
      amax = std::max(amax, std::fabs(v[c]));
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t b[32];
    int32_t s = 0;
    for (int c = 0; c < 32; ++c) {
      const int qi = static_cast<int>(std::nearbyint(v[c] * inv));  // round half to even (default mode)
      s += qi;
      b[(c / 8) * 8 + kSlot[c % 8]] = static_cast<int8_t>(qi);
    }
    std::memcpy(q + g * 8, b, 32);
    d[g] = amax / 127.0f;
    asum[g] = s;
  }
}

}  // namespace

void quantize_q8(const float* x, int64_t K, int64_t groups, int32_t* q, float* d, int32_t* asum) {
  quantize_row(x, K, groups, q, d, asum);
}
void quantize_q8(const uint16_t* x, int64_t K, int64_t groups, int32_t* q, float* d, int32_t* asum) {
  quantize_row(x, K, groups, q, d, asum);
}

// ---------------------------------------------------------------------------------------------- AVX-512 VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma")
#include "cpu_quant_moe_avx512.h"  // scales16
namespace {

template <int C, bool kE8M0>
void q8_block_avx512(const Tiles& t, const uint8_t* tile, int nr, const Q8Row* x, float* out, int64_t os) {
  const uint8_t* codes = tile + t.scale_block;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i table =
      _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Offset)));  // E2M1 only
  const int32_t off = kE8M0 ? 12 : 8;
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* blk = codes + g * 256;
    __m512i part[C][4];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < 4; ++p) part[c][p] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + 64 * L + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + 64 * L + kAheadL2), _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(blk + 64 * L);
      __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      if (kE8M0) {
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const int32_t* qa = x[c].q + g * 8 + 2 * L;
        part[c][(L & 1) * 2] = _mm512_dpbusd_epi32(part[c][(L & 1) * 2], lo, _mm512_set1_epi32(qa[0]));
        part[c][(L & 1) * 2 + 1] = _mm512_dpbusd_epi32(part[c][(L & 1) * 2 + 1], hi, _mm512_set1_epi32(qa[1]));
      }
    }
    const __m512 s = scales16<kE8M0>(tile, g);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m512i isum = _mm512_add_epi32(_mm512_add_epi32(part[c][0], part[c][1]), _mm512_add_epi32(part[c][2], part[c][3]));
      isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(off * x[c].asum[g]));
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x[c].d[g]));
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), sd));
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
  for (int c = 0; c < C; ++c) {
    const __m512 r = kE8M0 ? _mm512_mul_ps(acc[c], _mm512_set1_ps(0.5f)) : acc[c];
    _mm512_mask_storeu_ps(out + c * os, keep, r);
  }
}

}  // namespace

void tile_dot_q8_avx512vnni(const Tiles& t, int64_t tile, int nr, const Q8Row* x, int nc, float* out, int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  token_blocks<4>(nc, [&](auto c, int c0) {
    if (t.e8m0)
      q8_block_avx512<decltype(c)::value, true>(t, p, nr, x + c0, out + c0 * os, os);
    else
      q8_block_avx512<decltype(c)::value, false>(t, p, nr, x + c0, out + c0 * os, os);
  });
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- AVX-VNNI
// The same sums with 256-bit vectors: each 64-byte block as two halves of 8 rows.
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
namespace {

inline __m256 scales8_q8(const uint8_t* s, int64_t g, int h, bool e8m0) {
  if (e8m0) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16 * g + 8 * h)));
    __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(b, 23));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(0x1p-127f), _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256())));
    return _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_set1_epi32(255))));
  }
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32 * g + 16 * h)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

template <int C, bool kE8M0>
void q8_block_avx2(const Tiles& t, const uint8_t* tile, int nr, const Q8Row* x, float* out, int64_t os) {
  const uint8_t* codes = tile + t.scale_block;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Offset)));
  const int32_t off = kE8M0 ? 12 : 8;
  __m256 acc[C][2];
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* blk = codes + g * 256;
    __m256i part[C][2][2];
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) part[c][h][0] = part[c][h][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + 64 * L + kAhead), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * L + 32 * h));
        __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        if (kE8M0) {
          lo = _mm256_shuffle_epi8(table, lo);
          hi = _mm256_shuffle_epi8(table, hi);
        }
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const int32_t* qa = x[c].q + g * 8 + 2 * L;
          part[c][h][0] = _mm256_dpbusd_avx_epi32(part[c][h][0], lo, _mm256_set1_epi32(qa[0]));
          part[c][h][1] = _mm256_dpbusd_avx_epi32(part[c][h][1], hi, _mm256_set1_epi32(qa[1]));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = scales8_q8(tile, g, h, kE8M0);
      for (int c = 0; c < C; ++c) {
        __m256i isum = _mm256_add_epi32(part[c][h][0], part[c][h][1]);
        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(off * x[c].asum[g]));
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x[c].d[g]));
        acc[c][h] = _mm256_add_ps(acc[c][h], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), sd));
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    alignas(32) float row[16];
    for (int h = 0; h < 2; ++h)
      _mm256_store_ps(row + 8 * h, kE8M0 ? _mm256_mul_ps(acc[c][h], _mm256_set1_ps(0.5f)) : acc[c][h]);
    std::memcpy(out + c * os, row, sizeof(float) * nr);
  }
}

}  // namespace

void tile_dot_q8_avxvnni(const Tiles& t, int64_t tile, int nr, const Q8Row* x, int nc, float* out, int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  token_blocks<3>(nc, [&](auto c, int c0) {
    if (t.e8m0)
      q8_block_avx2<decltype(c)::value, true>(t, p, nr, x + c0, out + c0 * os, os);
    else
      q8_block_avx2<decltype(c)::value, false>(t, p, nr, x + c0, out + c0 * os, os);
  });
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- portable
void tile_dot_q8_scalar(const Tiles& t, int64_t tile, int nr, const Q8Row* x, int nc, float* out, int64_t os) {
  const uint8_t* p = t.data + tile * t.tile_bytes;
  const uint8_t* codes = p + t.scale_block;
  const int32_t off = t.e8m0 ? 12 : 8;
  for (int c = 0; c < nc; ++c)
    for (int r = 0; r < nr; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < t.groups; ++g) {
        const auto* qa = reinterpret_cast<const int8_t*>(x[c].q + g * 8);
        int32_t isum = 0;
        for (int L = 0; L < 4; ++L)
          for (int b = 0; b < 4; ++b) {
            const uint8_t byte = codes[g * 256 + 64 * L + 4 * r + b];
            const uint8_t lo = byte & 15, hi = byte >> 4;
            const int32_t ul = t.e8m0 ? kE2M1Offset[lo] : lo, uh = t.e8m0 ? kE2M1Offset[hi] : hi;
            isum += ul * qa[8 * L + b] + uh * qa[8 * L + 4 + b];
          }
        isum -= off * x[c].asum[g];
        float s;
        if (t.e8m0) {
          s = g_e8m0[p[g * kTileRows + r]];  // byte 0: 2^-127, as scales16's patch
        } else {
          uint16_t b;
          std::memcpy(&b, p + 2 * (g * kTileRows + r), 2);
          const uint32_t bits = static_cast<uint32_t>(b) << 16;
          std::memcpy(&s, &bits, 4);
        }
        acc = acc + static_cast<float>(isum) * (s * x[c].d[g]);
      }
      out[c * os + r] = t.e8m0 ? acc * 0.5f : acc;
    }
}

}  // namespace cpu_quant_moe
