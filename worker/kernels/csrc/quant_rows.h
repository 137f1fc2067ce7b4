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

// out[i] = v[i] rounded to the nearest bfloat16 (ties to even, as torch's float -> bfloat16); AVX-512 BF16 rounds
// 8 at a time (vcvtneps2bf16 rounds the same way, and NaN stays NaN). 8, not 16: the decoders write v in 8-float
// stores, and a 16-float load of two of them waits for both to retire (a failed store forward: 3x the time).
inline void round_to_bf16(at::BFloat16* out, const float* v, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(_mm256_loadu_ps(v + i))));
#endif
  for (; i < n; ++i) out[i] = at::BFloat16(v[i]);
}

// Decodes blocks [first, last) of a [rows, blocks a row] matrix into dst as DstT (float32, or bfloat16 rounded
// once from the float32 weights): `decode(w, i)` writes block i's `weights` float32 values to w.
template <typename DstT, class Decode>
inline void dequantize_blocks_to(DstT* dst, int64_t first, int64_t last, int64_t weights, const Decode& decode) {
  if constexpr (std::is_same_v<DstT, float>) {
    for (int64_t i = first; i < last; ++i) decode(dst + i * weights, i);
  } else {
    alignas(64) float w[256];  // a block: 32 or 256 weights
    for (int64_t i = first; i < last; ++i) {
      decode(w, i);
      round_to_bf16(dst + i * weights, w, weights);
    }
  }
}

// The rows of x as int8 blocks: q and the remainder's q' [M, K], e / 256 and s [M, K / 32], s16 [M, K / 16].
struct QuantizedRows {
  std::vector<int8_t> q, rest;
  std::vector<float> e, s, s16;
  int64_t k = 0, blocks = 0;
  const int8_t* qrow(int64_t row, int64_t b) const { return q.data() + row * k + b * kBlock; }
  const int8_t* rest_row(int64_t row, int64_t b) const { return rest.data() + row * k + b * kBlock; }
  float scale(int64_t row, int64_t b) const { return e[row * blocks + b]; }
  float sum(int64_t row, int64_t b) const { return s[row * blocks + b]; }
  const float* scales(int64_t row, int64_t b) const { return e.data() + row * blocks + b; }
  const float* sums(int64_t row, int64_t b) const { return s.data() + row * blocks + b; }
  const float* sums16(int64_t row, int64_t b) const { return s16.data() + 2 * (row * blocks + b); }
};

// One block of 32 values: q, q' and the sums of 256 q + q' over each half (x = e (q + q' / 256), the header);
// returns e. Vectors of 8 where the build has AVX2 (17 ns a block, against 180 ns for the plain loop on a
// Xeon: a decode step's x of 576 to 1536 values took 3 to 9 us a call, 0.5 ms of a SmolLM2 step at one row).
// The remainder is one fused multiply-add, x - e q rounded once, in both paths below, so they give the same bits.
struct BlockRounding {
  float e;       // a / 127
  float inv;     // 127 / a (0 for a block of zeros)
};

inline BlockRounding block_rounding(float amax) {
  return {amax / 127.f, amax > 0.f ? 127.f / amax : 0.f};
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 values of x as float32.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Four vectors of 8 int32 (each within int8) as 32 int8 in order.
inline void store_int8(int8_t* out, const __m256i (&v)[4]) {
  const __m256i words = _mm256_packs_epi32(v[0], v[1]), words2 = _mm256_packs_epi32(v[2], v[3]);
  const __m256i bytes = _mm256_packs_epi16(words, words2);  // lanes interleaved by 32 bits: put them back
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

template <typename T>
inline float quantize_block(const T* src, int8_t* q, int8_t* rest, int* sums) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(src + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const BlockRounding b = block_rounding(_mm_cvtss_f32(m4));
  const __m256 e = _mm256_set1_ps(b.e), inv = _mm256_set1_ps(b.inv), k256 = _mm256_set1_ps(256.f);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i qi[4], ri[4], total[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int i = 0; i < 4; ++i) {
    const __m256 qf = _mm256_round_ps(_mm256_mul_ps(v[i], inv), kRound);
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_fnmadd_ps(e, qf, v[i]), inv), k256), kRound);
    qi[i] = _mm256_cvtps_epi32(qf);
    ri[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    total[i / 2] = _mm256_add_epi32(total[i / 2], _mm256_add_epi32(_mm256_slli_epi32(qi[i], 8), ri[i]));
  }
  store_int8(q, qi);
  store_int8(rest, ri);
  sums[0] = hsum_epi32(total[0]);
  sums[1] = hsum_epi32(total[1]);
  return b.e;
}
#else
template <typename T>
inline float quantize_block(const T* src, int8_t* q, int8_t* rest, int* sums) {
  float v[kBlock], amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) {
    v[j] = to_float(src[j]);
    amax = std::max(amax, std::fabs(v[j]));
  }
  const BlockRounding b = block_rounding(amax);
  sums[0] = sums[1] = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float qf = std::nearbyint(v[j] * b.inv);
    q[j] = static_cast<int8_t>(qf);
    const float r = std::nearbyint(std::fma(-b.e, qf, v[j]) * b.inv * 256.f);
    rest[j] = static_cast<int8_t>(std::clamp(r, -127.f, 127.f));
    sums[j / 16] += 256 * q[j] + rest[j];
  }
  return b.e;
}
#endif

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
      int sum[2];
      const float e = quantize_block(src, out.q.data() + i * kBlock, out.rest.data() + i * kBlock, sum) / 256.f;
      out.e[i] = e;
      out.s[i] = e * static_cast<float>(sum[0] + sum[1]);
      out.s16[2 * i] = e * static_cast<float>(sum[0]);
      out.s16[2 * i + 1] = e * static_cast<float>(sum[1]);
    }
  });
}

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
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  const int64_t tiles = (n + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(1, kRowsPerTile * k * m));
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    columns<Tile>(o, xq, w, bias, m, n, row_bytes, first * kRowsPerTile, std::min(n, last * kRowsPerTile));
  });
}

}  // namespace redserve_quant
