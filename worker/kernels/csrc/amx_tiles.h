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


constexpr int64_t kK = 32;             // k a tile row: 32 bfloat16
constexpr int64_t kColsPerBlock = 64;  // W's rows decoded together (a multiple of the micro-tile's 32), at most

// W's rows a column block: 64, or 32 for up to 32 rows of x where the 64-row blocks would not split evenly over
// the threads (a thread with one block more than the other waits for it at the end: SmolLM2's 576-row o and down
// projections are 9 blocks of 64, 5 against 4 on two threads, and 18 of 32). SmolLM2's weights once, two threads
// (2-core Xeon VM with AMX, 5 Dec 2026): 16 rows 14.9 -> 13.1 ms; at 64 rows 32-row blocks were 4% slower.
inline int64_t block_cols(int64_t n, int64_t m) {
  const int64_t threads = at::get_num_threads(), blocks = (n + kColsPerBlock - 1) / kColsPerBlock;
  return m <= 2 * kRows && threads > 1 && blocks % threads != 0 ? kColsPerBlock / 2 : kColsPerBlock;
}
constexpr int64_t kMinProductsPerTask = 1 << 16;

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

// Into L2: the raw bytes of W's row col + kColsPerBlock (the same thread's next column block, or the one after
// with 32-row blocks), for a decode_row to call on row col. The tiles touch no memory beyond L2, so nothing else
// brings the next block's weights in: with it, every weight of SmolLM2 once (its projections and LM head) at 64 bfloat16
// rows 30.6-31.7 -> 28.0-28.3 ms (Q4_1), 35.1 -> 28.5 (Q8_0); 16 rows 19.2 -> 16.5, 128 rows 47.9 -> 44.1 (Q4_1;
// 2-core Xeon VM with AMX, 5 Dec 2026; into L1 instead: the same). The k-quants: no change (their decoding, not
// the memory, is what holds them up: Q4_K 22.4 -> 22.0 ms, Q6_K 36.4 -> 36.6).
inline void prefetch_next_block_row(const uint8_t* blocks, int64_t col, int64_t n, int64_t row_bytes) {
  if (col + kColsPerBlock >= n) return;
  const char* ahead = reinterpret_cast<const char*>(blocks + (col + kColsPerBlock) * row_bytes);
  for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
}

// out[k] = column k of a 16 x 16 float32 tile stored row by row (t[i * 16 + k]): 64 shuffles where 16 gathers
// were. Rows in pairs (unpack of 32-bit, then of 64-bit halves) leave, in 128-bit lane L of u[g][j], rows 4g..4g+3
// at column 4L + j; a 4 x 4 transpose of lanes across u[0..3][j] then puts column 4L + j together.
inline void transpose16(const __m512 r[16], __m512 out[16]) {
  __m512 p[16];
  for (int i = 0; i < 8; ++i) {
    p[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    p[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[4][4];  // u[g][j]
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(p[4 * g]), b = _mm512_castps_pd(p[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(p[4 * g + 2]), d = _mm512_castps_pd(p[4 * g + 3]);
    u[g][0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[g][1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[g][2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[g][3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 ab01 = _mm512_shuffle_f32x4(u[0][j], u[1][j], 0x44), ab23 = _mm512_shuffle_f32x4(u[0][j], u[1][j], 0xEE);
    const __m512 cd01 = _mm512_shuffle_f32x4(u[2][j], u[3][j], 0x44), cd23 = _mm512_shuffle_f32x4(u[2][j], u[3][j], 0xEE);
    out[j] = _mm512_shuffle_f32x4(ab01, cd01, 0x88);
    out[4 + j] = _mm512_shuffle_f32x4(ab01, cd01, 0xDD);
    out[8 + j] = _mm512_shuffle_f32x4(ab23, cd23, 0x88);
    out[12 + j] = _mm512_shuffle_f32x4(ab23, cd23, 0xDD);
  }
}

inline void transpose16(const float* t, __m512 out[16]) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(t + 16 * i);
  transpose16(r, out);
}

// x [M, K] as tiles of 16 rows: xp[t][K / 2][16] 32-bit pairs (k even, k + 1) of row 16 t + i; rows past M zero.
// Each 16 rows x 16 pairs is one 16 x 16 transpose of 32-bit lanes (transpose16), on the calling thread: a few
// microseconds at 64 rows, less than a parallel region's start (it was a 4-byte copy a pair over threads).
using PackedRows = std::unique_ptr<uint32_t[], decltype(&std::free)>;

inline PackedRows pack_pairs(const at::BFloat16* x, int64_t m, int64_t k, int64_t tiles) {
  const int64_t pairs = k / 2;  // a multiple of 16: the buffer's size is one of 64 bytes
  PackedRows xp(static_cast<uint32_t*>(std::aligned_alloc(64, tiles * pairs * kRows * sizeof(uint32_t))), &std::free);
  TORCH_CHECK(xp, "out of memory packing x for the AMX tiles");
  const auto* rows = reinterpret_cast<const uint32_t*>(x);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t live = std::min(kRows, m - t * kRows);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512 in[16], out[16];
      for (int64_t i = 0; i < 16; ++i)
        in[i] = i < live ? _mm512_castsi512_ps(_mm512_loadu_si512(rows + (t * kRows + i) * pairs + p0)) : _mm512_setzero_ps();
      transpose16(in, out);
      for (int64_t j = 0; j < 16; ++j) _mm512_store_ps(reinterpret_cast<float*>(xp.get() + ((t * pairs) + p0 + j) * kRows), out[j]);
    }
  }
  return xp;
}

// One column block of W decoded into a buffer a few units at a time (`step`: an even share of the block's units
// for each of the `steps` calls), so that it can be decoded between another block's tile ops. Rows past N (up to
// the block's whole micro-tiles) are zero.
template <class Decode>
struct BlockDecoder {
  const Decode* decode;
  int64_t k = 0, unit = 0;  // a decode unit: `unit` weights of a row
  int64_t block_cols = kColsPerBlock;
  int64_t c0 = 0, cols = 0, row = 0, at = 0, per_step = 1;
  uint16_t* w = nullptr;

  void start(int64_t block, int64_t n, uint16_t* buffer, int64_t steps) {
    constexpr int64_t kMicroCols = 2 * kRows;
    c0 = block * block_cols, cols = std::min(block_cols, n - c0), row = 0, at = 0, w = buffer;
    const int64_t units = cols * (k / unit);
    per_step = std::max<int64_t>(1, (units + steps - 1) / std::max<int64_t>(1, steps));
    const int64_t padded = (cols + kMicroCols - 1) / kMicroCols * kMicroCols;
    std::fill(w + cols * k, w + padded * k, uint16_t{0});
  }
  void step() {
    const int64_t units = k / unit;
    for (int64_t left = per_step; left > 0 && row < cols;) {
      const int64_t take = std::min(left, units - at);
      (*decode)(c0 + row, w + row * k, at, at + take);
      at += take, left -= take;
      if (at == units) at = 0, ++row;
    }
  }
  void finish() {
    while (row < cols) step();
  }
};

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
            const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + col)), 16))
                                  : _mm512_setzero_ps();
            for (int64_t j = 0; j < xt; ++j) {
              const int64_t row0 = (t + j) * R;
              __m512 columns[16];
              transpose16(c + (2 * half + j) * R * R, columns);
              for (int64_t r = 0; r < std::min(R, m - row0); ++r) {
                const __m512 v = _mm512_add_ps(columns[r], b);
                _mm256_mask_storeu_epi16(out + (row0 + r) * n + col, live,
                                         reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
              }
            }
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
