// AVX-512 pieces shared by the tile kernels of cpu_quant_moe_isa.cpp and cpu_quant_moe_amx.cpp: the
// group scales of a tile and the nibble -> bf16 code table. Include it inside namespace cpu_quant_moe
// and inside a `#pragma GCC target` region with avx512f (the build passes no -march flag): it defines
// its functions in an unnamed namespace, so each file compiles its own copy for its own target.
// Needs <immintrin.h>, <cmath> and <cstring> included first.

namespace {

// The 16 scales (rows) of group g as float32: bf16 widened, or E8M0 as an exponent (0 and 255, the
// denormal 2^-127 and NaN, patched).
template <bool kE8M0>
inline __m512 scales16(const uint8_t* s, int64_t g) {
  if (kE8M0) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * g)));
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(b, 23));
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()), _mm512_set1_ps(0x1p-127f));
    return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(255)), _mm512_set1_ps(NAN));
  }
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32 * g)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

// nibble -> bf16 bits of its code, 32 entries (entry i = code of i & 15): vpermw reads 5 index bits, so
// a word shifted by 4j needs no mask.
inline __m512i bf16_table(const float* lut) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &lut[i & 15], 4);
    t[i] = static_cast<uint16_t>(bits >> 16);  // exact: every code has at most 3 significant bits
  }
  return _mm512_load_si512(t);
}

}  // namespace
