// AMX tiles for bfloat16 products (Sapphire Rapids and later): what quant_gemm.cpp's many-row path needs.
//
// A tile register holds up to 16 rows of 64 bytes; `tdpbf16ps C, A, B` adds to C [16 x 16 float32] the
// products of A [16 x 32 bfloat16] and B, whose row p holds pairs (2p, 2p + 1) of the 32 for 16 columns
// (the "VNNI" layout): 8,192 multiply-adds an instruction, against 32 for AVX-512 BF16's vdpbf16ps.
//
// Linux hands the tiles' 8 KiB of state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); without it the first tile instruction is an invalid opcode. `permitted()` asks once a
// process and says whether it may; each thread then sets its own tile shapes (`configure`) before its first
// tile instruction and lets the state go (`_tile_release`) when it is done.
//
// Rules: compiled only where the compiler targets AMX-TILE, AMX-BF16 and AVX-512 BF16 (-march=native on such a
// CPU: REDSERVE_AMX_BF16); the caller checks `permitted()` and keeps another path for when it is false.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define REDSERVE_AMX_BF16 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace redserve_amx {

constexpr int64_t kRows = 16;      // rows a tile
constexpr int64_t kPairBytes = 64;  // bytes a tile row: 32 bfloat16, or 16 float32

inline bool permitted() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles 0-7, each 16 rows of 64 bytes.
inline void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kPairBytes;
    config.rows[t] = kRows;
  }
  asm volatile("" : : "r"(&config) : "memory");  // the stores above are read by ldtilecfg, which GCC cannot see
  _tile_loadconfig(&config);
}

}  // namespace redserve_amx

#endif
