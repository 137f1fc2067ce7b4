// Many bfloat16 rows of x times W's rows decoded to bfloat16 (AVX-512 BF16): the pieces the AMX tiles
// (amx_tiles.h) share, and `matmul` on the vector units for CPUs without tiles (Zen 4 and later, Cooper Lake).
//
// x is packed once a call as pairs of k for 16 rows (`pack_pairs`: the "VNNI" layout, 64 bytes a pair of k), and
// W's rows are decoded a column block at a time (`BlockDecoder`) into a buffer, natural layout (K bfloat16 a row).
// `matmul`'s micro-tile is 4 rows of W (columns of out) by 64 rows of x (fewer rows of x: 8 W rows by 32, 16 by
// 16): per pair of k, a 64-byte load of each 16 rows of x and a 4-byte broadcast of each W row's pair, and
// `vdpbf16ps` (16 lanes of two products) for each of the 16 accumulators: 8 loads per 16 dot products at 64 rows.
// A column block's accumulators go out through a buffer, 16 x 16 at a time transposed in registers
// (`transpose16`) into rows of out, plus the bias, rounded once.
//
// Why not quant_gemm.cpp's older vdpbf16ps path (codes times x, each 32-k block's sums scaled by d and m): per
// 32 k it zeroed and scaled its sums (an FMA per 8 dot products) and read 6 loads per 8 dot products. Measured on
// a 2-core AMD EPYC (Zen 4, avx512_bf16, no AMX; 6 Dec 2026): see quant_gemm.cpp `dot_matmul`.
//
// Rules: compiled where the compiler targets AVX-512 BF16, BW and VL (REDSERVE_BF16_ROWS). K a multiple of 32;
// x, out contiguous [M, K], [M, N]; bias [N] or null. Each output is one thread's sum in one k order, so the bits
// do not depend on the thread count. W is rounded to bfloat16 by the caller's decode: a dequantized bfloat16
// model's weights, as on the tiles.

#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define REDSERVE_BF16_ROWS 1

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace redserve_bf16 {

constexpr int64_t kRows = 16;  // rows of x a packed tile (an AMX tile's rows; a vector's lanes)

constexpr int64_t kK = 32;             // k a tile row: 32 bfloat16
constexpr int64_t kColsPerBlock = 64;  // W's rows decoded together (a multiple of the AMX micro-tile's 32), at most

// W's rows a column block: 64, or 32 for up to 32 rows of x where the 64-row blocks would not split evenly over
// the threads (a thread with one block more than the other waits for it at the end: SmolLM2's 576-row o and down
// projections are 9 blocks of 64, 5 against 4 on two threads, and 18 of 32). SmolLM2's weights once, two threads
// (2-core Xeon VM with AMX, 5 Dec 2026): 16 rows 14.9 -> 13.1 ms; at 64 rows 32-row blocks were 4% slower.
inline int64_t block_cols(int64_t n, int64_t m) {
  const int64_t threads = at::get_num_threads(), blocks = (n + kColsPerBlock - 1) / kColsPerBlock;
  return m <= 2 * kRows && threads > 1 && blocks % threads != 0 ? kColsPerBlock / 2 : kColsPerBlock;
}
constexpr int64_t kMinProductsPerTask = 1 << 16;

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

// The bias of out's columns [col, col + 16) where `live` (zero elsewhere, or without a bias), as float32 lanes.
inline __m512 bias_lanes(const at::BFloat16* bias, int64_t col, __mmask16 live) {
  return bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + col)), 16))
              : _mm512_setzero_ps();
}

// A 16 x 16 float32 tile of sums, t[i * 16 + r] for out's column col + i and row row0 + r, into out (rows past
// m and columns outside `live` untouched): transposed in registers, plus the bias lanes, rounded once.
inline void store_transposed(at::BFloat16* out, int64_t n, const float* t, int64_t row0, int64_t m, int64_t col,
                             __mmask16 live, __m512 b) {
  __m512 rows[16];
  transpose16(t, rows);
  for (int64_t r = 0; r < std::min(kRows, m - row0); ++r) {
    const __m512 v = _mm512_add_ps(rows[r], b);
    _mm256_mask_storeu_epi16(out + (row0 + r) * n + col, live, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
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

// acc[c][j] (c < NC rows of W, j < MV tiles of x): sum over k of W[c][k] x[16 j + lane][k], over all K.
template <int MV, int NC>
inline void dot_tile(float* c_out, const uint16_t* w, int64_t k, const uint32_t* xp, int64_t tile_stride) {
  __m512 acc[NC][MV];
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < MV; ++j) acc[c][j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh xv[MV];
    for (int j = 0; j < MV; ++j)
      xv[j] = reinterpret_cast<__m512bh>(_mm512_load_si512(xp + j * tile_stride + p * kRows));
    for (int c = 0; c < NC; ++c) {
      uint32_t pair;
      std::memcpy(&pair, w + c * k + 2 * p, 4);
      const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int j = 0; j < MV; ++j) acc[c][j] = _mm512_dpbf16_ps(acc[c][j], xv[j], wv);
    }
  }
  // c_out[j][c][lane]: tile j's 16 x kColsPerBlock block of out, column-major (a W row's 16 sums together)
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < MV; ++j) _mm512_store_ps(c_out + (j * kColsPerBlock + c) * kRows, acc[c][j]);
}

constexpr int64_t kDotTiles = 4;  // tiles of x (16 rows each) a micro-tile, at most

// A column block (its W rows padded with zeros to a multiple of 16) against MV tiles of x: 16 accumulators a
// micro-tile (16 / MV W rows), enough independent sums to cover vdpbf16ps's latency at any MV.
template <int MV>
constexpr int64_t dot_cols() { return MV == 1 ? 16 : MV == 2 ? 8 : 4; }

template <int MV>
inline void dot_block(float* c, const uint16_t* w, int64_t cols, int64_t k, const uint32_t* xp, int64_t tile_stride) {
  constexpr int NC = dot_cols<MV>();
  for (int64_t wc = 0; wc < cols; wc += NC) dot_tile<MV, NC>(c + wc * kRows, w + wc * k, k, xp, tile_stride);
}

// `decode(col, w, first, last)` as for `redserve_amx::matmul`. Each thread decodes a column block, then runs every
// tile of x over it; out rows are written 16 columns at a time. Column blocks as `block_cols`, split evenly over
// torch's threads. Tried: threads taking blocks from a shared counter (32-column blocks wherever 64 split
// unevenly), in case a thread preempted by the API's processes held the call up: served SmolLM2 Q4_1 at c=64
// level (436.2 against 437.4 / 436.8 tok/s), and level offline.
template <class Decode>
void matmul(at::BFloat16* out, const at::BFloat16* x, const at::BFloat16* bias, int64_t m, int64_t k, int64_t n,
            int64_t unit, const Decode& decode) {
  constexpr int64_t R = kRows;
  const int64_t tiles = (m + R - 1) / R;
  const PackedRows xp = pack_pairs(x, m, k, tiles);
  const int64_t tile_stride = (k / 2) * R;
  const int64_t bc = block_cols(n, m), col_blocks = (n + bc - 1) / bc;
  const int64_t grain = std::max<int64_t>(1, kMinProductsPerTask / std::max<int64_t>(1, bc * k * m));
  at::parallel_for(0, col_blocks, grain, [&](int64_t first, int64_t last) {
    std::vector<uint16_t> buffer(bc * k);
    std::unique_ptr<float[], decltype(&std::free)> c(
        static_cast<float*>(std::aligned_alloc(64, kDotTiles * kColsPerBlock * R * sizeof(float))), &std::free);
    BlockDecoder<Decode> block{&decode, k, unit, bc};
    for (int64_t cb = first; cb < last; ++cb) {
      block.start(cb, n, buffer.data(), 1);
      block.finish();
      const int64_t c0 = block.c0, cols = block.cols;
      const int64_t padded = (cols + R - 1) / R * R;
      const uint16_t* w = block.w;
      for (int64_t t = 0; t < tiles; t += kDotTiles) {
        const int64_t mv = std::min<int64_t>(kDotTiles, tiles - t);
        const uint32_t* x0 = xp.get() + t * tile_stride;
        switch (mv) {
          case 4: dot_block<4>(c.get(), w, padded, k, x0, tile_stride); break;
          case 3: dot_block<3>(c.get(), w, padded, k, x0, tile_stride); break;
          case 2: dot_block<2>(c.get(), w, padded, k, x0, tile_stride); break;
          default: dot_block<1>(c.get(), w, padded, k, x0, tile_stride); break;
        }
        for (int64_t h = 0; h < cols; h += R) {
          const int64_t col = c0 + h;
          const auto live = static_cast<__mmask16>((1u << std::min(R, cols - h)) - 1u);
          const __m512 b = bias_lanes(bias, col, live);
          for (int64_t j = 0; j < mv; ++j)
            store_transposed(out, n, c.get() + (j * kColsPerBlock + h) * R, (t + j) * R, m, col, live, b);
        }
      }
    }
  });
}

}  // namespace redserve_bf16

#endif
