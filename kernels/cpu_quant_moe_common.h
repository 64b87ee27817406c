// Types shared by cpu_quant_moe.cpp (the MoE call) and cpu_quant_moe_isa.cpp (its per-instruction-set
// kernels): one expert matrix in its packed layout, per-thread scratch, and the tile sizes.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace cpu_quant_moe {

// One expert's weight matrix [N, K] in its checkpoint layout: rows of packed bytes, per-group scales.
struct QMat {
  const uint8_t* data;   // row r starts at data + r * row_bytes
  int64_t row_bytes;     // INT4: 4 * ceil(K / 8); MXFP4: K / 2
  const uint8_t* scale;  // bf16 (INT4) or E8M0 bytes (MXFP4); row r's first at index r * scale_row
  int64_t scale_row;     // scales per row
  bool e8m0;
  int64_t group;         // columns per scale, a multiple of 32
  int64_t K;
  const float* lut;      // nibble -> value, 16 entries
};

extern float g_e8m0[256];  // E8M0 byte -> 2^(b - 127), 255 -> NaN (filled when the module loads)

inline float group_scale(const QMat& m, int64_t r, int64_t k0) {
  const int64_t i = r * m.scale_row + k0 / m.group;
  if (m.e8m0) return g_e8m0[m.scale[i]];
  uint16_t b;
  std::memcpy(&b, m.scale + 2 * i, 2);
  const uint32_t bits = static_cast<uint32_t>(b) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Scratch {  // one per thread
  std::vector<float> wbuf, abuf;
};

constexpr int kTileRows = 16;        // weight rows per work item
constexpr int64_t kChunkGroups = 16; // tiled path: 32-column groups dequantised at a time (512 columns)
constexpr int kTokenBlock = 128;     // tiled path: tokens sharing one dequantised chunk
constexpr int kFusedMaxTokens = 16;  // tokens of one expert up to which weights are dequantised in registers

// out[c * ostride + r] = <weight row r0 + r, xs[c]> for r < nr <= kTileRows, c < nc; xs rows hold
// ceil(K / 32) * 32 floats (zeros past K) in the column order of the instruction set's width (see
// activation_position in cpu_quant_moe.cpp).
using RowsDot = void (*)(const QMat&, int64_t, int, const float* const*, int, float*, int64_t, Scratch&);
void rows_dot_avx512(const QMat&, int64_t, int, const float* const*, int, float*, int64_t, Scratch&);
void rows_dot_avx2(const QMat&, int64_t, int, const float* const*, int, float*, int64_t, Scratch&);
void rows_dot_scalar(const QMat&, int64_t, int, const float* const*, int, float*, int64_t, Scratch&);

}  // namespace cpu_quant_moe
