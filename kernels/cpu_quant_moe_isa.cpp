// The vector kernels of cpu_quant_moe.cpp, compiled three times under `#pragma GCC target`: AVX-512,
// AVX2 + FMA and a portable path, from cpu_quant_moe_kernels.h, each behind its own namespace with its
// vector primitives. The build passes no -march flag, so only the chosen path's instructions run and
// the portable one runs on any x86-64 CPU.
//
// INT4 (compressed-tensors pack-quantized: int32 words of 8 offset-8 nibbles, lowest nibble = lowest
// column) and MXFP4 (bytes of two E2M1 codes, low nibble = even column) are, on a little-endian CPU,
// both bytes whose low nibble is the even column: one decoder serves both, nibble -> 16-entry table
// (q - 8, or the E2M1 values) -> times the group scale.
#include "cpu_quant_moe_common.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the INT4 decoder reads int32 words as little-endian bytes"
#endif

// ---------------------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace isa_avx512 {
using namespace cpu_quant_moe;
constexpr int W = 16;
// One token: 4 rows per block (4 weight + 4 scale streams per thread) measured faster than 8 at batch 1.
constexpr int kFusedR1 = 4, kFusedR = 4, kFusedC = 4, kMicroR = 4, kMicroC = 6;
using Vec = __m512;
using Lut = __m512;
inline Lut make_lut(const float* t) { return _mm512_loadu_ps(t); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Lut scale_lut(const Lut& lut, float s) { return _mm512_mul_ps(lut, _mm512_set1_ps(s)); }
// 16 bytes -> out[0] = their low nibbles' values (even columns), out[1] = their high nibbles' (odd).
inline void dequant32(const uint8_t* b, const Lut& lut, Vec* out) {
  const __m512i by = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  out[0] = _mm512_permutexvar_ps(_mm512_and_si512(by, _mm512_set1_epi32(15)), lut);
  out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(by, 4), lut);
}
#include "cpu_quant_moe_kernels.h"
}  // namespace isa_avx512
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace isa_avx2 {
using namespace cpu_quant_moe;
constexpr int W = 8;
// 16 ymm registers: R x C accumulators plus the weight / activation vectors must fit.
constexpr int kFusedR1 = 4, kFusedR = 4, kFusedC = 2, kMicroR = 4, kMicroC = 3;
using Vec = __m256;
struct Lut {
  __m256 lo, hi;  // entries 0-7 and 8-15
};
inline Lut make_lut(const float* t) { return {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)}; }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
// A 16-entry lookup from two 8-entry permutes; bit 3 of the index (moved to the sign bit) picks one.
inline Vec lookup(__m256i idx, const Lut& lut) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut.lo, idx), _mm256_permutevar8x32_ps(lut.hi, idx), mask);
}
inline Lut scale_lut(const Lut& lut, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  return {_mm256_mul_ps(lut.lo, sv), _mm256_mul_ps(lut.hi, sv)};
}
// Bytes 8c..8c+7 -> out[2c] = their low nibbles' values, out[2c + 1] = their high nibbles'.
inline void dequant32(const uint8_t* b, const Lut& lut, Vec* out) {
  const __m256i fifteen = _mm256_set1_epi32(15);
  for (int c = 0; c < 2; ++c) {
    const __m256i by = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * c)));
    out[2 * c] = lookup(_mm256_and_si256(by, fifteen), lut);
    out[2 * c + 1] = lookup(_mm256_srli_epi32(by, 4), lut);
  }
}
#include "cpu_quant_moe_kernels.h"
}  // namespace isa_avx2
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------- portable
namespace isa_scalar {
using namespace cpu_quant_moe;
constexpr int W = 16;  // same column order as AVX-512; plain loops the compiler may vectorise (SSE2)
constexpr int kFusedR1 = 4, kFusedR = 2, kFusedC = 2, kMicroR = 2, kMicroC = 2;
struct Vec {
  float v[W];
};
struct Lut {
  float t[16];
};
inline Lut make_lut(const float* t) {
  Lut l;
  std::memcpy(l.t, t, sizeof(l.t));
  return l;
}
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void vstore(float* p, const Vec& v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Vec vfma(const Vec& a, const Vec& b, Vec c) {
  for (int i = 0; i < W; ++i) c.v[i] += a.v[i] * b.v[i];  // two roundings (-ffp-contract=off)
  return c;
}
inline float vsum(const Vec& v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v.v[i];
  return s;
}
inline Lut scale_lut(Lut lut, float s) {
  for (float& v : lut.t) v *= s;
  return lut;
}
inline void dequant32(const uint8_t* b, const Lut& lut, Vec* out) {
  for (int i = 0; i < 16; ++i) {
    out[0].v[i] = lut.t[b[i] & 15];
    out[1].v[i] = lut.t[b[i] >> 4];
  }
}
#include "cpu_quant_moe_kernels.h"
}  // namespace isa_scalar

namespace cpu_quant_moe {
// The entry points cpu_quant_moe.cpp calls through RowsDot; W fixes the activation layout.
void rows_dot_avx512(const QMat& m, int64_t r0, int nr, const float* const* xs, int nc, float* out, int64_t os,
                     Scratch& s) {
  isa_avx512::rows_dot(m, r0, nr, xs, nc, out, os, s);
}
void rows_dot_avx2(const QMat& m, int64_t r0, int nr, const float* const* xs, int nc, float* out, int64_t os,
                   Scratch& s) {
  isa_avx2::rows_dot(m, r0, nr, xs, nc, out, os, s);
}
void rows_dot_scalar(const QMat& m, int64_t r0, int nr, const float* const* xs, int nc, float* out, int64_t os,
                     Scratch& s) {
  isa_scalar::rows_dot(m, r0, nr, xs, nc, out, os, s);
}
}  // namespace cpu_quant_moe
