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
// `matmul`: out = x W^T (+ bias) for bfloat16 x and out, W given a row at a time as bfloat16 by the caller (the
// quantized-weight kernels dequantize it: quant_gemm.cpp, quant_gemm_k.cpp). W's rows are decoded 64 at a time
// into a buffer that stays in L2, and the tiles compute W x^T: W's rows as A (natural layout, 32 weights a tile
// row), x packed once a call as B (`pack_pairs`: pairs of k for 16 rows of x a tile row). A micro-tile is 32 rows
// of W by 32 rows of x: four float32 accumulator tiles, two loads of W and two of x per 32 k. Each accumulator
// tile goes out through a small buffer, transposed in registers (`transpose16`: its columns are out's rows), plus
// the bias, rounded once. The transpose replaced a gather down each column: bit-identical, SmolLM2's weights
// once at 64 bfloat16 rows 6-8% faster (Q8_0 30.4 -> 28.6 ms, Q4_1 28.9 -> 26.6), 128 rows 9%, 16 rows 1.5%,
// Q4_K 64 rows 2.6% (interleaved A/B, 2-core Xeon VM with AMX, 5 Dec 2026). x is packed on the calling thread with
// the same transpose (16 rows by 16 pairs at a time): it was a 4-byte copy a pair, split over threads in a parallel
// region of its own, and took a quarter of the call at 64 rows: SmolLM2's weights once, bit-identical, 64 rows
// 31.3 -> 24.0 ms (Q4_1), 33.6 -> 25.6 (Q8_0), 128 rows 53.0 -> 45.2 (Q8_0), Q4_K 64 rows 19.7 -> 18.9, 16 rows
// unchanged. Column blocks split over torch's threads; each output is one thread's sum in one k order, so the
// bits do not depend on the thread count.
//
// Rules: compiled only where the compiler targets AMX-TILE, AMX-BF16 and AVX-512 BF16, BW, VL (-march=native on such a
// CPU: REDSERVE_AMX_BF16); the caller checks `permitted()` and keeps another path for when it is false. K is a
// multiple of 32; x, out contiguous [M, K], [M, N]; bias [N] or null.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__linux__)
#define REDSERVE_AMX_BF16 1

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16_rows.h"

namespace redserve_amx {

using namespace redserve_bf16;  // kRows, kK, pack_pairs, transpose16, BlockDecoder, ...
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


// Tiles: 0 = (W rows 0-15, x tile 0), 1 = (0-15, x tile 1), 2 = (16-31, 0), 3 = (16-31, 1); 4, 5 W; 6, 7 x.
// `between()` runs once per 32 k, after that step's tile ops are issued: the caller's decoding of the next column
// block, which the core runs on its vector units while the tile unit works through them (see `matmul`).
template <int XT, class Between>
inline void micro_tile(float* c, const uint16_t* w, int64_t k, const uint32_t* x0, const uint32_t* x1,
                       Between&& between) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (XT == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int64_t stride = k * 2;
  for (int64_t kb = 0; kb < k / kK; ++kb) {
    _tile_loadd(4, w + kb * kK, stride);
    _tile_loadd(5, w + kRows * k + kb * kK, stride);
    _tile_loadd(6, x0 + kb * (kK / 2) * kRows, kPairBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (XT == 2) {
      _tile_loadd(7, x1 + kb * (kK / 2) * kRows, kPairBytes);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    between();
  }
  _tile_stored(0, c, kPairBytes);
  _tile_stored(2, c + 2 * kRows * kRows, kPairBytes);
  if constexpr (XT == 2) {
    _tile_stored(1, c + kRows * kRows, kPairBytes);
    _tile_stored(3, c + 3 * kRows * kRows, kPairBytes);
  }
}

// `decode(col, w, first, last)` writes weights [first * unit, last * unit) of W's row col (bfloat16 bits) to the
// same places of w (K of them); it is called with first = 0 before any other part of a row.
//
// Each thread decodes its next column block while the tiles multiply the current one: an even share of it after
// each 32 k of the current block's tile ops (`micro_tile`'s `between`), into the other of two buffers. The
// tile unit runs beside the vector units that decode, where block after block in turn had left each idle half
// the time, and the tile unit, idle for the microseconds of a block's decoding, came back slower (measured here:
// 72 tile ops cost ~1,650 cycles back to back and ~3,000-5,500 after 1-20 us without any). The overlap is partial:
// while a tile op runs, the decoding's 512-bit ops get one vector port of two (about 4 Q4_1 blocks of decoding
// hide behind 4 tile ops; at 64 rows there are 16). Bit-identical; SmolLM2's weights once at 64 bfloat16 rows, two
// threads, old and new interleaved in one process (2-core Xeon VM with AMX, 5 Dec 2026): Q4_1 24.1 -> 21.5 ms,
// Q8_0 29.2 -> 25.8, Q4_K 21.2 -> 19.9.
template <class Decode>
void matmul(at::BFloat16* out, const at::BFloat16* x, const at::BFloat16* bias, int64_t m, int64_t k, int64_t n,
            int64_t unit, const Decode& decode) {
  constexpr int64_t R = kRows, kMicroCols = 2 * R;
  const int64_t tiles = (m + R - 1) / R;
  const PackedRows xp = pack_pairs(x, m, k, tiles);
  const int64_t bc = block_cols(n, m), col_blocks = (n + bc - 1) / bc;
  const int64_t grain = std::max<int64_t>(1, kMinProductsPerTask / std::max<int64_t>(1, bc * k * m));
  at::parallel_for(0, col_blocks, grain, [&](int64_t first, int64_t last) {
    std::vector<uint16_t> buffers(2 * bc * k);
    alignas(64) float c[4 * R * R];
    configure();
    BlockDecoder<Decode> current{&decode, k, unit, bc}, ahead{&decode, k, unit, bc};
    current.start(first, n, buffers.data(), 1);
    current.finish();
    for (int64_t cb = first; cb < last; ++cb) {
      if (cb + 1 < last) {
        const int64_t cols = std::min(bc, n - cb * bc);
        const int64_t steps = (cols + kMicroCols - 1) / kMicroCols * ((tiles + 1) / 2) * (k / kK);
        ahead.start(cb + 1, n, buffers.data() + ((cb + 1 - first) % 2) * bc * k, steps);
      }
      const auto between = [&] { if (cb + 1 < last) ahead.step(); };
      const int64_t c0 = current.c0, cols = current.cols;
      const uint16_t* w = current.w;
      const int64_t padded = (cols + kMicroCols - 1) / kMicroCols * kMicroCols;
      for (int64_t wc = 0; wc < padded; wc += kMicroCols) {
        for (int64_t t = 0; t < tiles; t += 2) {
          const int64_t xt = std::min<int64_t>(2, tiles - t);
          const uint32_t* x0 = xp.get() + t * (k / 2) * R;
          if (xt == 2) {
            micro_tile<2>(c, w + wc * k, k, x0, x0 + (k / 2) * R, between);
          } else {
            micro_tile<1>(c, w + wc * k, k, x0, nullptr, between);
          }
          // c[(2 * half + j) * R * R + i * R + r]: W row 16 half + i (a column of out), row 16 (t + j) + r of x
          for (int64_t half = 0; half < 2; ++half) {
            const int64_t col = c0 + wc + half * R;
            if (col >= c0 + cols) break;
            const auto live = static_cast<__mmask16>((1u << std::min(R, c0 + cols - col)) - 1u);
            const __m512 b = bias_lanes(bias, col, live);
            for (int64_t j = 0; j < xt; ++j) store_transposed(out, n, c + (2 * half + j) * R * R, (t + j) * R, m, col, live, b);
          }
        }
      }
      if (cb + 1 < last) {
        ahead.finish();
        std::swap(current, ahead);
      }
    }
    _tile_release();
  });
}

}  // namespace redserve_amx

#endif
