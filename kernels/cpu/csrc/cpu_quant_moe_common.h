// Types shared by cpu_quant_moe.cpp (the MoE call) and cpu_quant_moe_isa.cpp (its per-instruction-set
// kernels): one expert matrix in the tile layout of kernels/cpu/quant_moe_layout.py, and the kernels'
// signature.
#pragma once

#include <cstdint>
#include <type_traits>

namespace cpu_quant_moe {

constexpr int kTileRows = 16;

// One expert's matrix [N, K] as tiles of 16 rows: tile t starts at data + t * tile_bytes with its
// scale block (scale_block bytes: groups x 16 scales, bf16 or E8M0), then groups x 256 code bytes.
struct Tiles {
  const uint8_t* data;
  int64_t tile_bytes;
  int64_t scale_block;
  int64_t groups;  // ceil(K / 32)
  bool e8m0;       // MXFP4 (E2M1 codes, E8M0 scales); else INT4 (offset-8 codes, bf16 scales)
};

// out[c * ostride + r] = <row 16 * tile + r, x[c]> for r < nr <= 16, c < nc. x rows hold groups * 32
// activations, zero past K: float32 (TileDotF32) or bf16 bits (TileDotBf16, pairs read as uint32).
using TileDotF32 = void (*)(const Tiles&, int64_t tile, int nr, const float* const* x, int nc, float* out,
                            int64_t ostride);
using TileDotBf16 = void (*)(const Tiles&, int64_t tile, int nr, const uint16_t* const* x, int nc, float* out,
                             int64_t ostride);
// The AMX-BF16 kernel (cpu_quant_moe_amx.cpp): the same out as TileDotBf16, but the nc activation rows
// are x, x + xs bytes, ... (one strided tile load per 16 tokens). Call only where best_isa()
// (cpu_quant_moe.cpp) found AMX usable.
extern const bool kAmxBuilt;  // whether this build has the AMX kernel
void tile_dot_amx_bf16(const Tiles&, int64_t tile, int nr, const uint16_t* x, int64_t xs, int nc, float* out,
                       int64_t os);
void tile_dot_avx512bf16(const Tiles&, int64_t, int, const uint16_t* const*, int, float*, int64_t);
void tile_dot_avx512(const Tiles&, int64_t, int, const float* const*, int, float*, int64_t);
void tile_dot_avx2(const Tiles&, int64_t, int, const float* const*, int, float*, int64_t);
void tile_dot_scalar(const Tiles&, int64_t, int, const float* const*, int, float*, int64_t);

// nibble -> code value: INT4 stores q + 8; E2M1 (bit 3 the sign) as in the OCP MX spec.
extern const float kInt4Lut[16];
extern const float kE2M1Lut[16];
extern float g_e8m0[256];  // E8M0 byte -> 2^(b - 127), 255 -> NaN (filled when the module loads)

// W4A8 (cpu_quant_moe_w4a8.cpp): an activation row quantised to int8 per 32-column group. q holds
// groups x 8 words of 4 int8 values each, in the order the tile layout's lanes pair them with codes;
// d the groups' float32 scales, asum the sums of each group's int8 values.
struct Q8Row {
  const int32_t* q;
  const float* d;
  const int32_t* asum;
};
// out[c * ostride + r] = the W4A8 product of row 16 * tile + r and x[c], for r < nr <= 16, c < nc.
using TileDotQ8 = void (*)(const Tiles&, int64_t tile, int nr, const Q8Row* x, int nc, float* out, int64_t ostride);
void tile_dot_q8_avx512vnni(const Tiles&, int64_t, int, const Q8Row*, int, float*, int64_t);
void tile_dot_q8_avxvnni(const Tiles&, int64_t, int, const Q8Row*, int, float*, int64_t);
void tile_dot_q8_scalar(const Tiles&, int64_t, int, const Q8Row*, int, float*, int64_t);
// One row of K activations (float32 or bf16 bits) -> groups x (8 words q, d, asum); zero past K.
void quantize_q8(const float* x, int64_t K, int64_t groups, int32_t* q, float* d, int32_t* asum);
void quantize_q8(const uint16_t* x, int64_t K, int64_t groups, int32_t* q, float* d, int32_t* asum);

// The tile kernels' token blocking (cpu_quant_moe_isa.cpp, cpu_quant_moe_w4a8.cpp): a block's token
// count is a compile-time constant, so its accumulators stay in registers.
// f(integral_constant<n>) for a runtime n in [1, N].
template <int N, class F>
inline void with_count(int n, F&& f) {
  if constexpr (N > 0) {
    if (n == N)
      f(std::integral_constant<int, N>{});
    else
      with_count<N - 1>(n, f);
  }
}

// block(integral_constant<C>, c0) over tokens [0, nc) in blocks of up to Cmax.
template <int Cmax, class F>
inline void token_blocks(int nc, F&& block) {
  int c0 = 0;
  for (; c0 + Cmax <= nc; c0 += Cmax) block(std::integral_constant<int, Cmax>{}, c0);
  if (c0 < nc) with_count<Cmax - 1>(nc - c0, [&](auto c) { block(c, c0); });
}

}  // namespace cpu_quant_moe
