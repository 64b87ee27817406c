// AMX pieces shared by the two extensions that run tile instructions: the packed-expert kernels
// (cpu_quant_moe_amx.cpp) and the bf16 dense-expert product of the few-row kernels (cpu_moe_amx.cpp).
// Nothing here is an AMX instruction: the tile code itself sits under each file's own `#pragma GCC
// target`, and runs only after amx_bf16_usable() said yes.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kimitui_amx {

// The operand of _tile_loadconfig (palette 1): bytes per row and rows of tiles 0-15.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// AMX tiles may be used: the CPU has AMX-TILE and AMX-BF16 (cpuid leaf 7: EDX bits 24, 22), the OS
// saves the tile state (XCR0 bits 17, 18) and, on Linux, grants this process the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 18: the permission covers every thread of
// the process; asking again is harmless). Any refusal: false. Call before the first tile instruction.
inline bool amx_bf16_usable() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv is allowed
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace kimitui_amx
