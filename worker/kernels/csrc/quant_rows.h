// What the quantized-weight kernels share (quant_gemm.cpp for the 32-weight GGUF blocks, quant_gemm_k.cpp for
// the k-quants): the rows of x rounded to int8 blocks of 32, the int8 dot product, and the loop that walks
// W's rows in tiles over torch's threads.
//
// x is quantized per block of 32 as llama.cpp's q8 activations, and then once more: a = max |x|,
// e = a / 127, q = round(x / e), and the remainder r = x - e q (|r| <= e / 2) as q' = round(r * 256 / e)
// clamped to [-127, 127], so x = e (q + q' / 256) within e / 256 (llama.cpp's q8 alone leaves e / 2: on
// SmolLM2 that flips greedy near-ties, 0.08 logits apart, that the float model keeps). Each block keeps
// e / 256, s = e (sum(q) + sum(q') / 256), and s over each half of 16 values (Q6_K's offset).
//
// Threads: W's rows are split over torch's intra-op threads in tiles of kRowsPerTile rows, at least
// kMinWeightsPerTask products (weights x rows of x) a task: 64K, tens of microseconds, so that even a small
// model's projection splits at one row (SmolLM2's four projections of a layer at one row, two threads, best of
// 300: 149 us with a 1M floor, 108 us with 64K; one thread 193 us).

#pragma once

#include <torch/extension.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace redserve_quant {

constexpr int64_t kBlock = 32;  // values of x a block (and weights of a 32-weight GGUF block)
constexpr int64_t kRowsPerTile = 4;
constexpr int64_t kMinWeightsPerTask = 1 << 16;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// The rows of x as int8 blocks: q and the remainder's q' [M, K], e / 256 and s [M, K / 32], s16 [M, K / 16].
// `pair_blocks` adds q and q' with each pair of blocks (b, b + 1; b even) reordered as [b's values 0..15, b + 1's
// 0..15, b's 16..31, b + 1's 16..31]: the order of two 4-bit blocks' codes in one 512-bit vector (quant_gemm.cpp).
struct QuantizedRows {
  std::vector<int8_t> q, rest, q_paired, rest_paired;
  std::vector<float> e, s, s16;
  int64_t k = 0, blocks = 0;
  const int8_t* qrow(int64_t row, int64_t b) const { return q.data() + row * k + b * kBlock; }
  const int8_t* rest_row(int64_t row, int64_t b) const { return rest.data() + row * k + b * kBlock; }
  const int8_t* qpair(int64_t row, int64_t b) const { return q_paired.data() + row * k + b * kBlock; }
  const int8_t* rest_pair(int64_t row, int64_t b) const { return rest_paired.data() + row * k + b * kBlock; }
  float scale(int64_t row, int64_t b) const { return e[row * blocks + b]; }
  float sum(int64_t row, int64_t b) const { return s[row * blocks + b]; }
  const float* scales(int64_t row, int64_t b) const { return e.data() + row * blocks + b; }
  const float* sums(int64_t row, int64_t b) const { return s.data() + row * blocks + b; }
  const float* sums16(int64_t row, int64_t b) const { return s16.data() + 2 * (row * blocks + b); }
};

template <typename T>
void quantize_rows(QuantizedRows& out, const T* x, int64_t m, int64_t k) {
  out.k = k;
  out.blocks = k / kBlock;
  out.q.resize(m * k);
  out.rest.resize(m * k);
  out.e.resize(m * out.blocks);
  out.s.resize(m * out.blocks);
  out.s16.resize(2 * m * out.blocks);
  at::parallel_for(0, m * out.blocks, 256, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const T* src = x + i * kBlock;  // block i of the flattened rows: K is a multiple of 32
      float v[kBlock], amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) {
        v[j] = to_float(src[j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      const float e = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t *q = out.q.data() + i * kBlock, *rest = out.rest.data() + i * kBlock;
      int sum[2] = {0, 0};
      for (int64_t j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        const float r = std::nearbyint((v[j] - e * q[j]) * inv * 256.f);
        rest[j] = static_cast<int8_t>(std::clamp(r, -127.f, 127.f));
        sum[j / 16] += 256 * q[j] + rest[j];
      }
      out.e[i] = e / 256.f;
      out.s[i] = e / 256.f * static_cast<float>(sum[0] + sum[1]);
      out.s16[2 * i] = e / 256.f * static_cast<float>(sum[0]);
      out.s16[2 * i + 1] = e / 256.f * static_cast<float>(sum[1]);
    }
  });
}

// q_paired and rest_paired from q and rest (an odd last block is left out: read it from q and rest).
inline void pair_blocks(QuantizedRows& x, int64_t m) {
  x.q_paired.resize(x.q.size());
  x.rest_paired.resize(x.rest.size());
  constexpr int64_t kHalf = kBlock / 2;
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t b = 0; b + 1 < x.blocks; b += 2) {
      const int64_t at = row * x.k + b * kBlock;
      for (int64_t part = 0; part < 4; ++part) {  // b low, b + 1 low, b high, b + 1 high
        const int64_t from = at + (part & 1) * kBlock + (part >> 1) * kHalf;
        std::memcpy(x.q_paired.data() + at + part * kHalf, x.q.data() + from, kHalf);
        std::memcpy(x.rest_paired.data() + at + part * kHalf, x.rest.data() + from, kHalf);
      }
    }
  }
}

// Whether a `Tile` (below) reads x's paired blocks: its `kPairedX` where it declares one.
template <class Tile, class = void>
struct reads_paired_x : std::false_type {};
template <class Tile>
struct reads_paired_x<Tile, std::void_t<decltype(Tile::kPairedX)>> : std::bool_constant<Tile::kPairedX> {};

#if defined(__AVX2__) && defined(__FMA__)
// Sums of u8 x s8 products, 4 a lane, as 8 int32 lanes: AVX-512 VNNI / AVX-VNNI vpdpbusd (no saturation),
// else AVX2 vpmaddubsw + vpmaddwd (the callers keep each pair of products within int16).
inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// The shape, dtype and layout checks of a quantized linear: x [M, K] float32 or bfloat16, K a multiple of the
// format's `block_weights`; blocks uint8 [N, K / block_weights * block_bytes]; out [M, N] and bias [N] of x's dtype.
inline void check_linear_args(const char* name, const torch::Tensor& out, const torch::Tensor& x,
                              const torch::Tensor& blocks, int64_t block_weights, int64_t block_bytes,
                              const c10::optional<torch::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && out.scalar_type() == dtype,
              name, ": x and out float32 or bfloat16, one dtype");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8, name, ": blocks must be uint8");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2 && out.dim() == 2, name, ": x [M, K], blocks [N, B], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && blocks.is_contiguous() && out.is_contiguous(), name, ": contiguous tensors only");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % block_weights == 0, name, ": K (", k, ") must be a multiple of ", block_weights);
  TORCH_CHECK(blocks.size(1) == k / block_weights * block_bytes, name, ": blocks hold ", blocks.size(1),
              " bytes a row, K = ", k, " needs ", k / block_weights * block_bytes);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, name, ": out must be [M, N]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n,
                name, ": bias [N] of x's dtype");
  }
}

template <typename T>
inline void store(T* out, int64_t n, int64_t row, int64_t col, const float* sums, int64_t cols, const T* bias) {
  for (int64_t r = 0; r < cols; ++r)
    out[row * n + col + r] = static_cast<T>(sums[r] + (bias ? to_float(bias[col + r]) : 0.f));
}

// Output columns [first, last) of every row of x; `Tile::template dot<ROWS, XS>(out, w, row_bytes, x, x0)`
// writes out[j * ROWS + r] = row r of the tile . row x0 + j of x.
template <class Tile, typename T>
void columns(T* out, const QuantizedRows& x, const uint8_t* w, const T* bias, int64_t m, int64_t n,
             int64_t row_bytes, int64_t first, int64_t last) {
  float tile[2 * kRowsPerTile];
  int64_t col = first;
  for (; col + kRowsPerTile <= last; col += kRowsPerTile) {
    const uint8_t* rows = w + col * row_bytes;
    int64_t row = 0;
    for (; row + 2 <= m; row += 2) {  // two rows of x per pass over the tile: 8 accumulators
      Tile::template dot<kRowsPerTile, 2>(tile, rows, row_bytes, x, row);
      store(out, n, row, col, tile, kRowsPerTile, bias);
      store(out, n, row + 1, col, tile + kRowsPerTile, kRowsPerTile, bias);
    }
    for (; row < m; ++row) {
      Tile::template dot<kRowsPerTile, 1>(tile, rows, row_bytes, x, row);
      store(out, n, row, col, tile, kRowsPerTile, bias);
    }
  }
  for (; col < last; ++col) {
    for (int64_t row = 0; row < m; ++row) {
      Tile::template dot<1, 1>(tile, w + col * row_bytes, row_bytes, x, row);
      store(out, n, row, col, tile, 1, bias);
    }
  }
}

// out = x W^T (+ bias) over W's rows in tiles on torch's threads; `Tile` as in `columns`.
template <class Tile, typename T>
void run_rows(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks, const T* bias) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  QuantizedRows xq;
  quantize_rows(xq, x.data_ptr<T>(), m, k);
  if constexpr (reads_paired_x<Tile>::value) pair_blocks(xq, m);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  const int64_t tiles = (n + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(1, kRowsPerTile * k * m));
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    columns<Tile>(o, xq, w, bias, m, n, row_bytes, first * kRowsPerTile, std::min(n, last * kRowsPerTile));
  });
}

}  // namespace redserve_quant
