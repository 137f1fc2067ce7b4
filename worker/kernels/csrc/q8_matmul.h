// Many rows of x against quantized weights with llama.cpp's q8 activations (quant_gemm.cpp's and
// quant_gemm_k.cpp's `quant_matmul_q8`): each block of 32 values of a row of x rounded once to int8 (e = max |x|
// / 127, q = round(x / e); no remainder, so each value is within e / 2, where quant_linear's second byte leaves
// e / 512); W decoded once a call, 64 columns at a time, to unsigned byte codes u with a scale d and a min per
// 32 weights (`Decoder::row`: Q8_0 q + 128 and min -128 d; Q4_0 -8 d; Q5_0 -16 d; Q4_1 its m; Q4_K d sc and
// -dmin m of each sub-block), so that a block of row i and column c is d e sum(u q) + min e sum(q); the sums by
// vpdpbusd, 64 byte products an instruction against vdpbf16ps's 32.
// Layout as quant_gemm.cpp's bf16_matmul: a tile's rows in the lanes (16 a vector, two vectors a tile), 4
// consecutive k of one row an int32 lane, xq[tile][k / 4][rows]; each block's e and e sum(q) as xe, xs
// [tile][K / 32][rows]. Column blocks over torch's threads; each output written once, so the bits do not
// depend on the thread count.

#pragma once

#include "quant_rows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define REDSERVE_QUANT_Q8_MATMUL 1

namespace redserve_q8 {

using namespace redserve_quant;

constexpr int64_t kLanes = 16;
constexpr int64_t kVectors = 2;                 // vectors of rows in a tile
constexpr int64_t kTileRows = kVectors * kLanes;
constexpr int64_t kColsPerTile = 4;              // with two vectors of rows; eight with one
constexpr int64_t kColsPerBlock = 64;            // decoded together: 64 x K bytes stay in L2 while every row passes
constexpr int64_t kQuads = kBlock / 4;
constexpr int64_t kChunkBlocks = 4;              // blocks a pass: the tile's x (4 KiB) and the column block's codes

template <typename T>
void pack_rows(std::vector<int32_t>& xq, std::vector<float>& xe, std::vector<float>& xs, const T* x, int64_t m,
               int64_t k, int64_t tiles) {
  const int64_t nb = k / kBlock;
  xq.assign(tiles * (k / 4) * kTileRows, 0);
  xe.assign(tiles * nb * kTileRows, 0.f);
  xs.assign(tiles * nb * kTileRows, 0.f);
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (int64_t r = t * kTileRows; r < std::min(m, (t + 1) * kTileRows); ++r) {
        const int64_t lane = r % kTileRows;
        for (int64_t b = 0; b < nb; ++b) {
          const T* src = x + r * k + b * kBlock;
          float v[kBlock], amax = 0.f;
          for (int64_t j = 0; j < kBlock; ++j) {
            v[j] = to_float(src[j]);
            amax = std::max(amax, std::fabs(v[j]));
          }
          const float e = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
          alignas(4) int8_t q[kBlock];
          int sum = 0;
          for (int64_t j = 0; j < kBlock; ++j) {
            q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
            sum += q[j];
          }
          for (int64_t i = 0; i < kQuads; ++i) std::memcpy(&xq[(t * (k / 4) + b * kQuads + i) * kTileRows + lane], q + 4 * i, 4);
          xe[(t * nb + b) * kTileRows + lane] = e;
          xs[(t * nb + b) * kTileRows + lane] = e * static_cast<float>(sum);
        }
      }
    }
  });
}

// acc[c * MV * 16 + i] += sum over blocks b in [b0, b1) of d[c][b] xe[b][i] sum(u[c] q[i]) + mn[c][b] xs[b][i].
template <int MV, int NC = kColsPerTile * kVectors / MV>
inline void tile(float* acc_io, const int32_t* xq, const float* xe, const float* xs, const uint8_t* u, const float* d,
                 const float* mn, int64_t k, int64_t b0, int64_t b1) {
  const int64_t blocks = k / kBlock;
  __m512 acc[NC][MV];
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < MV; ++j) acc[c][j] = _mm512_loadu_ps(acc_io + (c * MV + j) * kLanes);
  for (int64_t b = b0; b < b1; ++b) {
    __m512i sum[NC][MV];
    for (auto& col : sum)
      for (auto& s : col) s = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t i = 0; i < kQuads; ++i) {
      const int64_t kq = b * kQuads + i;
      __m512i xv[MV];
      for (int j = 0; j < MV; ++j) {
        xv[j] = _mm512_loadu_si512(xq + kq * kTileRows + j * kLanes);
        asm("" : "+v"(xv[j]));  // one load of x a quad: folded into every vpdpbusd it would be loaded NC times
      }
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        int32_t quad;
        std::memcpy(&quad, u + c * k + 4 * kq, 4);
        const __m512i wv = _mm512_set1_epi32(quad);
        for (int j = 0; j < MV; ++j) sum[c][j] = _mm512_dpbusd_epi32(sum[c][j], wv, xv[j]);
      }
    }
    __m512 ev[MV], sv[MV];
    for (int j = 0; j < MV; ++j) {
      ev[j] = _mm512_loadu_ps(xe + b * kTileRows + j * kLanes);
      sv[j] = _mm512_loadu_ps(xs + b * kTileRows + j * kLanes);
    }
    for (int c = 0; c < NC; ++c) {
      const __m512 dv = _mm512_set1_ps(d[c * blocks + b]), mv = _mm512_set1_ps(mn[c * blocks + b]);
      for (int j = 0; j < MV; ++j) {
        acc[c][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[c][j]), _mm512_mul_ps(ev[j], dv), acc[c][j]);
        acc[c][j] = _mm512_fmadd_ps(sv[j], mv, acc[c][j]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < MV; ++j) _mm512_storeu_ps(acc_io + (c * MV + j) * kLanes, acc[c][j]);
}

// out = x W^T (+ bias); `Decoder::row(u, d, mn, w_row, k)` writes one row of W's K codes and K / 32 scales and mins.
template <class Decoder, typename T>
void matmul(T* out, const T* x, const uint8_t* blocks, const T* bias, int64_t m, int64_t k, int64_t n,
            int64_t row_bytes) {
  const int64_t nb = k / kBlock, tiles = (m + kTileRows - 1) / kTileRows;
  std::vector<int32_t> xq;
  std::vector<float> xe, xs;
  pack_rows(xq, xe, xs, x, m, k, tiles);
  const int64_t col_blocks = (n + kColsPerBlock - 1) / kColsPerBlock;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(1, kColsPerBlock * k * m));
  at::parallel_for(0, col_blocks, grain, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> u(kColsPerBlock * k);
    std::vector<float> d(kColsPerBlock * nb), mn(kColsPerBlock * nb), acc(kColsPerBlock * kTileRows);
    for (int64_t cb = first; cb < last; ++cb) {
      const int64_t c0 = cb * kColsPerBlock, cols = std::min(kColsPerBlock, n - c0);
      const int64_t padded = (cols + 2 * kColsPerTile - 1) / (2 * kColsPerTile) * (2 * kColsPerTile);
      for (int64_t c = 0; c < cols; ++c)
        Decoder::row(u.data() + c * k, d.data() + c * nb, mn.data() + c * nb, blocks + (c0 + c) * row_bytes, k);
      std::fill(u.begin() + cols * k, u.begin() + padded * k, uint8_t{0});
      std::fill(d.begin() + cols * nb, d.begin() + padded * nb, 0.f);
      std::fill(mn.begin() + cols * nb, mn.begin() + padded * nb, 0.f);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = t * kTileRows, rows = std::min(kTileRows, m - r0);
        const int64_t vectors = rows > kLanes ? kVectors : 1, lanes = vectors * kLanes;
        const int32_t* xt = xq.data() + t * (k / 4) * kTileRows;
        const float *et = xe.data() + t * nb * kTileRows, *st = xs.data() + t * nb * kTileRows;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t b0 = 0; b0 < nb; b0 += kChunkBlocks) {
          const int64_t b1 = std::min(nb, b0 + kChunkBlocks);
          const int64_t step = vectors == kVectors ? kColsPerTile : 2 * kColsPerTile;
          for (int64_t c = 0; c < padded; c += step) {
            const uint8_t* uc = u.data() + c * k;
            const float *dc = d.data() + c * nb, *mc = mn.data() + c * nb;
            if (vectors == kVectors) {
              tile<kVectors>(acc.data() + c * lanes, xt, et, st, uc, dc, mc, k, b0, b1);
            } else {
              tile<1>(acc.data() + c * lanes, xt, et, st, uc, dc, mc, k, b0, b1);
            }
          }
        }
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < cols; ++c)
            out[(r0 + i) * n + c0 + c] = static_cast<T>(acc[c * lanes + i] + (bias ? to_float(bias[c0 + c]) : 0.f));
      }
    }
  });
}

}  // namespace redserve_q8
#endif

// Whether this build has `redserve_q8::matmul` (both modules' `q8_matmul()`).
inline bool q8_matmul_built() {
#if defined(REDSERVE_QUANT_Q8_MATMUL)
  return true;
#else
  return false;
#endif
}
