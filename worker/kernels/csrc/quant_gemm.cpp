// y = x W^T (+ b) with W [N, K] kept as GGUF blocks of 32 weights (Q8_0, Q4_0, Q4_1, Q5_0), the dequantization in
// registers. Each row of W is its K / 32 blocks back to back, in the file's own layout:
//   Q8_0  34 bytes: fp16 d, 32 int8 q                 w = d * q
//   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles       w = d * (q - 8)
//   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes nibbles  w = d * q + m
//   Q5_0  22 bytes: fp16 d, 4 bytes high bits, 16 bytes nibbles   w = d * (q - 16), q = nibble | bit j << 4
// (a nibble byte j holds weight j in its low half and weight j + 16 in its high half).
//
// The rows of x are first quantized to int8 blocks of 32 plus an int8 remainder (quant_rows.h: x = e (q + q' / 256)
// within e / 256, s = e (sum(q) + sum(q') / 256)). A block's dot product is then integer sums over
// 32 int8 x int8 (Q8_0) or uint4 x int8 (Q4) products, 256 sum(qw q) + sum(qw q') (exact in int32), scaled
// by d * e / 256:
//   Q8_0: d e' sum      Q4_1: d e' sum + m s      Q4_0, Q5_0 as Q4_1 with m = -8 d, -16 d      (e' = e / 256)
// The integer sums: AVX-512 VNNI vpdpbusd (unsigned x signed bytes into int32, no saturation); else AVX2
// vpmaddubsw + vpmaddwd (int16 pairs cannot saturate here: |qw| <= 127 after the sign trick or <= 15, |qx| <= 127);
// else the plain loop. Which path a build takes follows the CPU it is built for (-march=native; the build
// cache is keyed by the CPU's flags), as small_gemm.cpp. W's rows go over torch's threads as quant_rows.h says.
//
// Rules: x [M, K] float32 or bfloat16 contiguous, K a multiple of 32; blocks uint8 [N, K / 32 * block bytes]
// contiguous; out [M, N] of x's dtype; bias [N] of x's dtype or none. The error against the float product of
// the dequantized weights is the activation rounding above: at most sum over blocks of e / 256 * sum |w|, plus
// float32 rounding (the bound is derived in tests/test_quant_gemm.py).

#include <torch/extension.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define REDSERVE_QUANT_AVX2 1
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "bf16_rows.h"
#include "q8_matmul.h"
#include "quant_rows.h"

namespace {

using namespace redserve_quant;

enum class Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8 };  // GGML's type ids

int64_t block_bytes(Format f) {
  switch (f) {
    case Format::kQ8_0: return 34;
    case Format::kQ4_0: return 18;
    case Format::kQ4_1: return 20;
    case Format::kQ5_0: return 22;
  }
  return 0;
}

template <Format F>
constexpr int64_t bytes_of() {
  return F == Format::kQ8_0 ? 34 : F == Format::kQ4_1 ? 20 : F == Format::kQ5_0 ? 22 : 18;
}

// Where a 4- or 5-bit block's nibbles start, and its min: w = d q + min (Q4_0: -8 d, Q5_0: -16 d).
template <Format F>
constexpr int64_t nibbles_at() { return F == Format::kQ4_1 ? 4 : F == Format::kQ5_0 ? 6 : 2; }

template <Format F>
inline float block_min(const uint8_t* p, float d) {
  return F == Format::kQ4_1 ? half_to_float(p + 2) : F == Format::kQ5_0 ? -16.f * d : -8.f * d;
}

// Q5_0's fifth bits: bit j of the block's 32-bit qh belongs to weight j.
inline uint32_t high_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p + 2, 4);
  return qh;
}

// ---- one block's integer dot product ---------------------------------------------------------------------

#if defined(REDSERVE_QUANT_AVX2)
// A block's weights as the unsigned operand of dot_u8_i8, and how to turn x's int8 into the signed one.
struct Q8Block {
  __m256i w;
  static constexpr bool kHasMin = false;
  float d, m = 0.f;
  explicit Q8Block(const uint8_t* p) : w(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))),
                                       d(half_to_float(p)) {}
  // int8 x int8: |w| as the unsigned operand, x with w's sign as the signed one.
  __m256i dot(__m256i x) const { return dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
  __m256i dot2(__m256i q, __m256i rest) const { return _mm256_add_epi32(_mm256_slli_epi32(dot(q), 8), dot(rest)); }
};

inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);  // low halves: 0..15, high: 16..31
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// A 4- or 5-bit block's 32 unsigned codes, one a byte in weight order. Q5_0's fifth bits: byte j takes the qh byte
// that holds bit j (a shuffle within each 128-bit lane of qh broadcast), keeps bit j % 8, and sets 16 where it is on.
template <Format F>
inline __m256i block_codes(const uint8_t* p) {
  const __m256i nibbles = unpack_nibbles(p + nibbles_at<F>());
  if constexpr (F != Format::kQ5_0) {
    return nibbles;
  } else {
    const __m256i qh = _mm256_set1_epi32(static_cast<int>(high_bits(p)));
    const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(nibbles, _mm256_and_si256(on, _mm256_set1_epi8(0x10)));
  }
}

template <Format F>
struct Q4Block {
  __m256i w;
  static constexpr bool kHasMin = true;
  float d, m;
  explicit Q4Block(const uint8_t* p) : w(block_codes<F>(p)), d(half_to_float(p)), m(block_min<F>(p, d)) {}
  __m256i dot(__m256i x) const { return dot_u8_i8(w, x); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // 256 sum(w q) + sum(w q'): the second sum accumulated onto the first, shifted, by one vpdpbusd.
  __m256i dot2(__m256i q, __m256i rest) const {
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(dot_u8_i8(w, q), 8), w, rest);
  }
#else
  __m256i dot2(__m256i q, __m256i rest) const { return _mm256_add_epi32(_mm256_slli_epi32(dot(q), 8), dot(rest)); }
#endif
};

template <Format F>
struct BlockOf { using type = Q4Block<F>; };
template <>
struct BlockOf<Format::kQ8_0> { using type = Q8Block; };

// out[j * ROWS + r] = row r of the tile . row j of x, for ROWS rows of W and XS rows of x.
template <Format F, int ROWS, int XS>
inline void dot_tile(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
  using Block = typename BlockOf<F>::type;
  constexpr int64_t kBytes = bytes_of<F>();
  __m256 acc[XS][ROWS];
  float mins[XS][ROWS] = {};
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i xq[XS], xr[XS];
    float xe[XS];
    for (int j = 0; j < XS; ++j) {
      xq[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qrow(x0 + j, b)));
      xr[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.rest_row(x0 + j, b)));
      xe[j] = x.scale(x0 + j, b);
    }
    for (int r = 0; r < ROWS; ++r) {
      const uint8_t* p = w + r * row_bytes + b * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(p + ROWS * row_bytes), _MM_HINT_T0);  // the next tile
      const Block blk(p);
      for (int j = 0; j < XS; ++j) {
        const __m256i sum = blk.dot2(xq[j], xr[j]);
        const __m256 prod = _mm256_cvtepi32_ps(sum);
        acc[j][r] = _mm256_fmadd_ps(prod, _mm256_set1_ps(blk.d * xe[j]), acc[j][r]);
        if constexpr (Block::kHasMin) mins[j][r] += blk.m * x.sum(x0 + j, b);
      }
    }
  }
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r) out[j * ROWS + r] = hsum(acc[j][r]) + mins[j][r];
}
#else
// The plain loop: one block's weights widened to int, the same sums as the SIMD path.
template <Format F, int ROWS, int XS>
inline void dot_tile(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
  const int64_t bytes = block_bytes(F);
  for (int j = 0; j < XS; ++j) {
    for (int r = 0; r < ROWS; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < x.blocks; ++b) {
        const uint8_t* p = w + r * row_bytes + b * bytes;
        const int8_t *q = x.qrow(x0 + j, b), *rest = x.rest_row(x0 + j, b);
        int32_t dot = 0;
        float d = half_to_float(p), m = 0.f;
        if constexpr (F == Format::kQ8_0) {
          for (int i = 0; i < kBlock; ++i) dot += static_cast<int8_t>(p[2 + i]) * (256 * q[i] + rest[i]);
        } else {
          const uint8_t* nib = p + nibbles_at<F>();
          const uint32_t qh = F == Format::kQ5_0 ? high_bits(p) : 0u;
          m = block_min<F>(p, d);
          for (int i = 0; i < kBlock / 2; ++i) {
            const int lo = (nib[i] & 0x0F) | ((qh >> i & 1u) << 4), hi = (nib[i] >> 4) | ((qh >> (i + 16) & 1u) << 4);
            dot += lo * (256 * q[i] + rest[i]) + hi * (256 * q[i + 16] + rest[i + 16]);
          }
        }
        total += d * x.scale(x0 + j, b) * static_cast<float>(dot) + m * x.sum(x0 + j, b);
      }
      out[j * ROWS + r] = total;
    }
  }
}
#endif

#if defined(REDSERVE_QUANT_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define REDSERVE_QUANT_ZMM 1
// ---- AVX-512: two blocks a vector (Q4_0, Q4_1, Q5_0, Q8_0) -------------------------------------------------
//
// The 256-bit tile above spends ~17 instructions on a block of a row of W (its nibbles unpacked, its fp16 scale
// and min converted and broadcast one by one, two sums, a conversion and an FMA), and at one row of x that, not
// the memory, sets the pace. Here a 512-bit vector holds two blocks' codes in x's own order, [b's low nibbles,
// b's high nibbles, b + 1's low, b + 1's high] (two 16-byte loads, a lane shuffle, a shift of lanes 1 and 3
// under a mask, an and; an order that made x be reordered a call, and Q5_0's qh bits be cut and spliced in
// scalar code, cost 5-10% at one row); the scales and mins of 16 blocks come in one 32-bit gather (a block's first four
// bytes: d, and Q4_1's m; Q4_0's min is -8 d, Q5_0's -16 d), are multiplied by x's scales once, and each pair of blocks takes
// its two with one permute. Per pair of blocks and row of W: two vpdpbusd (x's int8 and its remainder, as
// above), a conversion, a permute, an FMA; the mins m * s go into the same accumulator, once per 16 blocks. W's
// rows are prefetched two tiles ahead. The sums are the 256-bit tile's, exact; only the float32 summation order
// differs. An odd last block goes through the 256-bit path. Q8_0: its two blocks' 64 signed codes in their own
// order against x's natural order, as |w| and x with w's sign (AVX-512 has no vpsignb: x negated under the mask
// of w's sign bits), so the sums stay exact. Q5_0: the nibbles as Q4's, plus 16 where the two blocks' qh bits
// (one 64-bit mask: b's 32 bits, then b + 1's) say so.
// Q8_0 also asks for the whole tile four tiles ahead into L2 as a tile starts: without the software prefetch the
// walk is latency-bound (0.65-0.75x), the hardware prefetcher does not carry a tile's four interleaved row streams,
// and Q8_0's rows (612 bytes at K = 576) outrun the per-pair prefetch. Every SmolLM2 weight once in Q8_0 at one row
// (benchmarks/bench_quant_kernel.py --rev, 2-core AMD EPYC, Zen 4, 6 Dec 2026, three runs, a noisy VM): one thread
// 18.3 -> 12.0 ms, two 9.5 -> 6.6, 11.8 -> 8.0, 9.3 -> 6.9 ms (1.24-1.53x); 2 rows 1.06-1.18x, 4 rows level. The same
// for Q4_1 was level and for Q5_0 0.87-0.89x, so only Q8_0 takes it. Unmeasured on the AMX Xeon.
template <Format F, int ROWS, int XS>
inline void dot_tile_zmm(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
  constexpr int64_t kBytes = bytes_of<F>(), kNibbles = nibbles_at<F>();
  const int64_t paired = x.blocks & ~int64_t{1};
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(kBytes)));
  __m512 acc[XS][ROWS];
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm512_setzero_ps();
  if constexpr (F == Format::kQ8_0) {  // the tile four tiles ahead, whole, into L2 (see the comment above)
    const char* ahead = reinterpret_cast<const char*>(w + 4 * ROWS * row_bytes);
    for (int64_t off = 0; off < ROWS * row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
  }
  for (int64_t b0 = 0; b0 < paired; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, paired - b0);
    const auto live = static_cast<__mmask16>((1u << n) - 1u);
    __m512 scale[XS][ROWS];  // d * x's e for each of the 16 blocks
    for (int r = 0; r < ROWS; ++r) {
      const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets,
                                                      w + r * row_bytes + b0 * kBytes, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      for (int j = 0; j < XS; ++j) scale[j][r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(live, x.scales(x0 + j, b0)));
      if constexpr (F != Format::kQ8_0) {
        const __m512 m = F == Format::kQ4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)))
                                            : _mm512_mul_ps(d, _mm512_set1_ps(F == Format::kQ5_0 ? -16.f : -8.f));
        for (int j = 0; j < XS; ++j)
          acc[j][r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(live, x.sums(x0 + j, b0)), acc[j][r]);
      }
    }
    for (int64_t g = 0; g < n; g += 2) {
      const __m512i lanes = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(static_cast<int>(g)));
      __m512i xq[XS], xr[XS];
      for (int j = 0; j < XS; ++j) {
        xq[j] = _mm512_loadu_si512(x.qrow(x0 + j, b0 + g));
        xr[j] = _mm512_loadu_si512(x.rest_row(x0 + j, b0 + g));
      }
      for (int r = 0; r < ROWS; ++r) {
        const uint8_t* p = w + r * row_bytes + (b0 + g) * kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(p + 2 * ROWS * row_bytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + 2 * ROWS * row_bytes + 2 * kBytes - 1), _MM_HINT_T0);
        __m512i codes;
        __mmask64 negative = 0;
        if constexpr (F == Format::kQ8_0) {
          const __m512i q = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kBytes + 2)), 1);
          negative = _mm512_movepi8_mask(q);
          codes = _mm512_abs_epi8(q);
        } else {
          const __m256i v = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kNibbles))),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBytes + kNibbles)), 1);
          const __m512i twice = _mm512_shuffle_i64x2(_mm512_castsi256_si512(v), _mm512_castsi256_si512(v),
                                                     _MM_SHUFFLE(1, 1, 0, 0));  // b, b, b + 1, b + 1
          codes = _mm512_and_si512(_mm512_mask_srli_epi16(twice, 0xFF00FF00u, twice, 4), low);
          if constexpr (F == Format::kQ5_0) {  // the fifth bits: qh's bit i is weight i's
            const __mmask64 fifth = static_cast<uint64_t>(high_bits(p)) | static_cast<uint64_t>(high_bits(p + kBytes)) << 32;
            codes = _mm512_mask_add_epi8(codes, fifth, codes, _mm512_set1_epi8(16));
          }
        }
        for (int j = 0; j < XS; ++j) {
          __m512i q = xq[j], rest = xr[j];
          if constexpr (F == Format::kQ8_0) {
            q = _mm512_mask_sub_epi8(q, negative, _mm512_setzero_si512(), q);
            rest = _mm512_mask_sub_epi8(rest, negative, _mm512_setzero_si512(), rest);
          }
          __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, q);
          sum = _mm512_dpbusd_epi32(_mm512_slli_epi32(sum, 8), codes, rest);
          acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_permutexvar_ps(lanes, scale[j][r]), acc[j][r]);
        }
      }
    }
  }
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r) out[j * ROWS + r] = _mm512_reduce_add_ps(acc[j][r]);
  if (paired < x.blocks) {  // the odd last block, by the 256-bit path
    using Block = typename BlockOf<F>::type;
    for (int r = 0; r < ROWS; ++r) {
      const Block blk(w + r * row_bytes + paired * kBytes);
      for (int j = 0; j < XS; ++j) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qrow(x0 + j, paired)));
        const __m256i xr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.rest_row(x0 + j, paired)));
        const float sum = hsum(_mm256_cvtepi32_ps(blk.dot2(xq, xr)));
        out[j * ROWS + r] += blk.d * x.scale(x0 + j, paired) * sum + blk.m * x.sum(x0 + j, paired);
      }
    }
  }
}
#endif

template <Format F>
struct Tile {
  template <int ROWS, int XS>
  static void dot(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
#if defined(REDSERVE_QUANT_ZMM)
    dot_tile_zmm<F, ROWS, XS>(out, w, row_bytes, x, x0);
#else
    dot_tile<F, ROWS, XS>(out, w, row_bytes, x, x0);
#endif
  }
};

template <typename T>
void run(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks, const T* bias, Format f) {
  switch (f) {
    case Format::kQ8_0: return run_rows<Tile<Format::kQ8_0>>(out, x, blocks, bias);
    case Format::kQ4_0: return run_rows<Tile<Format::kQ4_0>>(out, x, blocks, bias);
    case Format::kQ4_1: return run_rows<Tile<Format::kQ4_1>>(out, x, blocks, bias);
    case Format::kQ5_0: return run_rows<Tile<Format::kQ5_0>>(out, x, blocks, bias);
  }
}

void check_linear_args(const char* name, const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks,
                       Format f, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(f == Format::kQ8_0 || f == Format::kQ4_0 || f == Format::kQ4_1 || f == Format::kQ5_0,
              name, ": GGML type ", static_cast<int64_t>(f), " is not Q8_0, Q4_0, Q4_1 or Q5_0");
  redserve_quant::check_linear_args(name, out, x, blocks, kBlock, block_bytes(f), bias);
}

void quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                  c10::optional<torch::Tensor> bias) {
  const auto f = static_cast<Format>(ggml_type);
  check_linear_args("quant_linear", out, x, blocks, f, bias);
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), n = blocks.size(0);
  if (m == 0 || n == 0) return;
  if (dtype == torch::kBFloat16) {
    run<at::BFloat16>(out, x, blocks, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, f);
  } else {
    run<float>(out, x, blocks, bias.has_value() ? bias->data_ptr<float>() : nullptr, f);
  }
}

// One block's 32 weights as float32: the gguf package's values (Q4_1's d * q + m within one rounding: one FMA
// where numpy rounds twice). A plain loop per format that the compiler vectorises.
template <Format F>
inline void dequantize_block(float* w, const uint8_t* p) {
  const float d = half_to_float(p);
#if defined(REDSERVE_QUANT_AVX2)
  // 8 weights at a time: bytes widened to int32, converted, scaled (Q4: one FMA with the block's min).
  const __m256i q = F == Format::kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))
                                       : block_codes<F>(p);
  const __m256 dv = _mm256_set1_ps(d);
  const __m256 mv = _mm256_set1_ps(F == Format::kQ8_0 ? 0.f : block_min<F>(p, d));
  for (int part = 0; part < 4; ++part) {
    const __m128i bytes = part < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    const __m128i eight = (part & 1) ? _mm_srli_si128(bytes, 8) : bytes;
    if constexpr (F == Format::kQ8_0) {
      _mm256_storeu_ps(w + 8 * part, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), dv));
    } else {
      _mm256_storeu_ps(w + 8 * part, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)), dv, mv));
    }
  }
#else
  if constexpr (F == Format::kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int64_t j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(q[j]);
  } else {
    const uint8_t* nib = p + nibbles_at<F>();
    const uint32_t qh = F == Format::kQ5_0 ? high_bits(p) : 0u;
    const float m = block_min<F>(p, d);
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      w[j] = std::fma(static_cast<float>((nib[j] & 0x0F) | ((qh >> j & 1u) << 4)), d, m);
      w[j + 16] = std::fma(static_cast<float>((nib[j] >> 4) | ((qh >> (j + 16) & 1u) << 4)), d, m);
    }
  }
#endif
}

// fn.template operator()<F>() for the format f names (the dispatch of a kernel templated on the format).
template <class Fn>
void with_format(Format f, Fn&& fn) {
  switch (f) {
    case Format::kQ8_0: return fn.template operator()<Format::kQ8_0>();
    case Format::kQ4_0: return fn.template operator()<Format::kQ4_0>();
    case Format::kQ4_1: return fn.template operator()<Format::kQ4_1>();
    case Format::kQ5_0: return fn.template operator()<Format::kQ5_0>();
  }
}


// out[r] = the weights of blocks row r, as float32 or bfloat16 (rounded once from the float32 weights): for many
// rows of x, where a float GEMM on the dequantized weight beats the int8 path and the AMX tiles (quantized_linear.py).
void dequantize_rows(torch::Tensor out, torch::Tensor blocks, int64_t ggml_type) {
  const auto f = static_cast<Format>(ggml_type);
  TORCH_CHECK(f == Format::kQ8_0 || f == Format::kQ4_0 || f == Format::kQ4_1 || f == Format::kQ5_0,
              "dequantize_rows: GGML type ", ggml_type, " is not Q8_0, Q4_0, Q4_1 or Q5_0");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 &&
                  (out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16) && blocks.dim() == 2 &&
                  out.dim() == 2 && blocks.is_contiguous() && out.is_contiguous(),
              "dequantize_rows: uint8 blocks [N, B] and float32 or bfloat16 out [N, K], contiguous");
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1), bytes = block_bytes(f);
  const int64_t nb = row_bytes / bytes, k = nb * kBlock;
  TORCH_CHECK(row_bytes % bytes == 0 && out.size(0) == n && out.size(1) == k, "dequantize_rows: shape mismatch");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  auto run = [&]<typename DstT>(DstT* dst) {
    at::parallel_for(0, n * nb, 4096, [&](int64_t first, int64_t last) {
      with_format(f, [&]<Format F>() {
        dequantize_blocks_to(dst, first, last, kBlock,
                             [&](float* w, int64_t i) { dequantize_block<F>(w, src + i * bytes_of<F>()); });
      });
    });
  };
  if (out.scalar_type() == torch::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<at::BFloat16>());
  }
}


// ---- many rows: the weights decoded once a call, x packed with its rows across the vector lanes -------------
//
// From a few dozen rows on, the int8 path above does more work per product than a float GEMM (two dots, a
// conversion and a scale for every block of every (row, column) pair), and quantizing x is no longer where the
// time goes. `quant_matmul` instead decodes kColsPerBlock columns of W at a time into a small buffer (kept in L2
// for every row of x) and multiplies with x packed so that one vector holds one k of L consecutive rows:
//   float32 x: W decoded to the float32 weights (the gguf package's values), y += x[rows, k] * w[k] by FMA,
//              L = 16 (AVX-512F) or 8 (AVX2) rows a vector; x in bfloat16 is widened first (exact).
//   bfloat16 x on a CPU with AVX-512 BF16: W decoded to bfloat16 (each weight rounded once, as a dequantized
//              bfloat16 model's), then AMX tiles (amx_tiles.h) where the CPU has them, else vdpbf16ps over pairs
//              of k into float32 (bf16_rows.h; every product exact). Below, `dot_matmul`.
// The float32 result is the dequantized product to float32 rounding (bfloat16 x: plus the weights' bfloat16
// rounding). A float micro-tile is kColsPerTile columns by two vectors of rows (8 accumulators): per k, two loads
// of x, four broadcasts of w, eight products.
// Threads split the column blocks.

constexpr int64_t kColsPerTile = 4;   // with two vectors of rows; eight with one
constexpr int64_t kColsPerBlock = 64;  // decoded together: 64 x K floats stay in L2 while every row passes
constexpr int64_t kRowVectors = 2;     // vectors of rows in a micro-tile

template <Format F>
void dequantize_row(float* w, const uint8_t* p, int64_t blocks) {
  constexpr int64_t kBytes = bytes_of<F>();
  for (int64_t b = 0; b < blocks; ++b) dequantize_block<F>(w + b * kBlock, p + b * kBytes);
}

#if defined(REDSERVE_QUANT_AVX2)
#if defined(__AVX512F__)
struct FloatVec {
  static constexpr int64_t L = 16;
  __m512 v;
  static FloatVec zero() { return {_mm512_setzero_ps()}; }
  static FloatVec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static FloatVec bcast(const float* p) { return {_mm512_set1_ps(*p)}; }
  void fma(FloatVec a, FloatVec b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#else
struct FloatVec {
  static constexpr int64_t L = 8;
  __m256 v;
  static FloatVec zero() { return {_mm256_setzero_ps()}; }
  static FloatVec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static FloatVec bcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
  void fma(FloatVec a, FloatVec b) { v = _mm256_fmadd_ps(a.v, b.v, v); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
};
#endif
constexpr int64_t kLanes = FloatVec::L;

// acc[c * MV * L + i] += sum over k in [k0, k1) of xp[k][i] * w[c][k], for NC columns and MV vectors
// of rows (xp already offset to the tile's first row).
template <int MV, int NC = kColsPerTile * kRowVectors / MV>
inline void float_tile(float* acc_io, const float* xp, int64_t stride, const float* w, int64_t k, int64_t k0, int64_t k1) {
  FloatVec acc[NC][MV];
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < MV; ++j) acc[c][j] = FloatVec::load(acc_io + (c * MV + j) * kLanes);
  for (int64_t i = k0; i < k1; ++i) {
    FloatVec xv[MV];
    for (int j = 0; j < MV; ++j) {
      xv[j] = FloatVec::load(xp + i * stride + j * kLanes);
      asm("" : "+v"(xv[j].v));  // keep x in a register: the compiler would fold a load into every FMA instead
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const FloatVec wv = FloatVec::bcast(w + c * k + i);
      for (int j = 0; j < MV; ++j) acc[c][j].fma(xv[j], wv);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < MV; ++j) acc[c][j].store(acc_io + (c * MV + j) * kLanes);
}
#else
constexpr int64_t kLanes = 8;
template <int MV, int NC = kColsPerTile * kRowVectors / MV>
inline void float_tile(float* acc_io, const float* xp, int64_t stride, const float* w, int64_t k, int64_t k0, int64_t k1) {
  for (int c = 0; c < NC; ++c)
    for (int64_t i = 0; i < MV * kLanes; ++i)
      for (int64_t j = k0; j < k1; ++j) acc_io[c * MV * kLanes + i] += xp[j * stride + i] * w[c * k + j];
}
#endif

constexpr int64_t kFloatChunk = 64;  // k a pass: the tile's rows of x (8 KiB) and the block's w (16 KiB) stay in L1

// The tile's sums (column c, row i at tile[c * stride + i]) into out, plus the bias.
template <typename T>
inline void store_tile(T* out, int64_t n, const float* tile, int64_t stride, int64_t row0, int64_t rows,
                       int64_t col0, int64_t cols, const T* bias) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c)
      out[(row0 + i) * n + col0 + c] = static_cast<T>(tile[c * stride + i] + (bias ? to_float(bias[col0 + c]) : 0.f));
}

// x [M, K] as tiles of kRowVectors * kLanes rows, each [K][rows] float32 (rows past M are zeros): one k of a
// tile's rows is one or two vectors, and consecutive k's are adjacent (a stride of the matrix's row count
// would map a pass's k's onto a few cache sets once M reaches a few hundred).
template <typename T>
std::vector<float> pack_rows_float(const T* x, int64_t m, int64_t k, int64_t tiles) {
  constexpr int64_t kTileRows = kRowVectors * kLanes;
  std::vector<float> xp(tiles * k * kTileRows, 0.f);
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      for (int64_t r = t * kTileRows; r < std::min(m, (t + 1) * kTileRows); ++r)
        for (int64_t i = 0; i < k; ++i) xp[(t * k + i) * kTileRows + r % kTileRows] = to_float(x[r * k + i]);
  });
  return xp;
}

template <Format F, typename T>
void float_matmul(T* out, const T* x, const uint8_t* blocks, const T* bias, int64_t m, int64_t k, int64_t n,
                  int64_t row_bytes) {
  constexpr int64_t kTileRows = kRowVectors * kLanes;
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const std::vector<float> xp = pack_rows_float(x, m, k, tiles);
  const int64_t col_blocks = (n + kColsPerBlock - 1) / kColsPerBlock;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(1, kColsPerBlock * k * m));
  at::parallel_for(0, col_blocks, grain, [&](int64_t first, int64_t last) {
    std::vector<float> w(kColsPerBlock * k), acc(kColsPerBlock * kRowVectors * kLanes);
    for (int64_t cb = first; cb < last; ++cb) {
      const int64_t c0 = cb * kColsPerBlock, cols = std::min(kColsPerBlock, n - c0);
      const int64_t padded = (cols + 2 * kColsPerTile - 1) / (2 * kColsPerTile) * (2 * kColsPerTile);
      for (int64_t c = 0; c < cols; ++c) dequantize_row<F>(w.data() + c * k, blocks + (c0 + c) * row_bytes, k / kBlock);
      std::fill(w.begin() + cols * k, w.begin() + padded * k, 0.f);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = t * kTileRows, rows = std::min(kTileRows, m - r0);
        const int64_t vectors = rows > kLanes ? kRowVectors : 1, lanes = vectors * kLanes;
        const float* xt = xp.data() + t * k * kTileRows;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k0 = 0; k0 < k; k0 += kFloatChunk) {
          const int64_t k1 = std::min(k, k0 + kFloatChunk);
          const int64_t step = vectors == kRowVectors ? kColsPerTile : 2 * kColsPerTile;
          for (int64_t c = 0; c < padded; c += step) {
            if (vectors == kRowVectors) {
              float_tile<kRowVectors>(acc.data() + c * lanes, xt, kTileRows, w.data() + c * k, k, k0, k1);
            } else {
              float_tile<1>(acc.data() + c * lanes, xt, kTileRows, w.data() + c * k, k, k0, k1);
            }
          }
        }
        store_tile(out, n, acc.data(), lanes, r0, rows, c0, cols, bias);
      }
    }
  });
}

#if defined(REDSERVE_BF16_ROWS)
#define REDSERVE_QUANT_BF16_ROWS 1
// ---- many bfloat16 rows: AMX tiles (amx_tiles.h) or AVX-512 BF16 dot products (bf16_rows.h) ---------------------
//
// `redserve_amx::matmul` or `redserve_bf16::matmul` with W's rows dequantized to bfloat16: d q + m to float32 as
// `dequantize_block`, then rounded once to the nearest bfloat16 (what a dequantized bfloat16 model multiplies by).
//
// Without AMX this replaced a vdpbf16ps path on the integer codes (a block's sums scaled by d and m every 32 k:
// exact weights, but an FMA per 8 dot products and 6 loads per 8). SmolLM2's weights once (its projections and
// LM head, Q4_1), two threads, old and new interleaved (benchmarks/bench_quant_kernel.py --op quant_matmul;
// 2-core AMD EPYC, Zen 4, avx512_bf16 without AMX, 6 Dec 2026): 16 rows 25.1 / 27.5 -> 25.5 / 27.9 ms (level),
// 32 rows 37.7 -> 29.7, 64 rows 62.7-75.5 -> 49.2-55.5 (1.14-1.36x), 256 rows 229 -> 180 (1.27x). Tried: decoding
// the next block between the dot products (as the tiles do): 0.74-0.82x at 16 rows, level at 64.

// One block's 32 weights as bfloat16: `dequantize_block`'s float32 values (the same multiply or FMA) rounded to
// the nearest bfloat16, 16 at a time.
template <Format F>
inline void dequantize_block_bf16(uint16_t* out, const uint8_t* p) {
  __m512 lo, hi;
  const __m512 d = _mm512_set1_ps(half_to_float(p));
  if constexpr (F == Format::kQ8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d);
  } else {  // a nibble byte j: weight j in its low half, j + 16 in its high half (Q5_0: bits j, j + 16 of qh on top)
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + nibbles_at<F>())));
    __m512i qlo = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), qhi = _mm512_srli_epi32(bytes, 4);
    if constexpr (F == Format::kQ5_0) {
      const __m512i qh = _mm512_set1_epi32(static_cast<int>(high_bits(p)));
      const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i bit = _mm512_set1_epi32(1);
      qlo = _mm512_or_si512(qlo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(qh, lanes), bit), 4));
      qhi = _mm512_or_si512(qhi, _mm512_slli_epi32(
                                     _mm512_and_si512(_mm512_srlv_epi32(qh, _mm512_add_epi32(lanes, _mm512_set1_epi32(16))), bit), 4));
    }
    const __m512 m = _mm512_set1_ps(block_min<F>(p, half_to_float(p)));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qlo), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qhi), d, m);
  }
  _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// Decodes W's row col, blocks [first, last), to bfloat16 (the matmuls' `decode`).
template <Format F>
struct Bf16Rows {
  const uint8_t* blocks;
  int64_t n, row_bytes;
  void operator()(int64_t col, uint16_t* w, int64_t first, int64_t last) const {
    if (first == 0) redserve_bf16::prefetch_next_block_row(blocks, col, n, row_bytes);
    const uint8_t* p = blocks + col * row_bytes;
    for (int64_t b = first; b < last; ++b) dequantize_block_bf16<F>(w + b * kBlock, p + b * bytes_of<F>());
  }
};

template <Format F>
void dot_matmul(at::BFloat16* out, const at::BFloat16* x, const uint8_t* blocks, const at::BFloat16* bias,
                int64_t m, int64_t k, int64_t n, int64_t row_bytes) {
#if defined(REDSERVE_AMX_BF16)
  if (redserve_amx::permitted()) {
    return redserve_amx::matmul(out, x, bias, m, k, n, kBlock, Bf16Rows<F>{blocks, n, row_bytes});
  }
#endif
  redserve_bf16::matmul(out, x, bias, m, k, n, kBlock, Bf16Rows<F>{blocks, n, row_bytes});
}
#endif

#if defined(REDSERVE_QUANT_Q8_MATMUL)
// quant_matmul_q8 (q8_matmul.h): one row of W as unsigned byte codes (natural k order) and each block's d and min.
template <Format F>
struct U8Codes {
  static void row(uint8_t* u, float* d, float* mn, const uint8_t* p, int64_t k) {
    constexpr int64_t kBytes = bytes_of<F>();
    for (int64_t b = 0; b < k / kBlock; ++b, p += kBytes) {
      d[b] = half_to_float(p);
      __m256i codes;
      if constexpr (F == Format::kQ8_0) {
        codes = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), _mm256_set1_epi8(-128));
        mn[b] = -128.f * d[b];
      } else {
        codes = block_codes<F>(p);
        mn[b] = block_min<F>(p, d[b]);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + b * kBlock), codes);
    }
  }
};

template <typename T>
void q8_dispatch(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks, const T* bias, Format f) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  const T* xd = x.data_ptr<T>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  switch (f) {
    case Format::kQ8_0: return redserve_q8::matmul<U8Codes<Format::kQ8_0>>(o, xd, w, bias, m, k, n, row_bytes);
    case Format::kQ4_0: return redserve_q8::matmul<U8Codes<Format::kQ4_0>>(o, xd, w, bias, m, k, n, row_bytes);
    case Format::kQ4_1: return redserve_q8::matmul<U8Codes<Format::kQ4_1>>(o, xd, w, bias, m, k, n, row_bytes);
    case Format::kQ5_0: return redserve_q8::matmul<U8Codes<Format::kQ5_0>>(o, xd, w, bias, m, k, n, row_bytes);
  }
}
#endif

void quant_matmul_q8(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                     c10::optional<torch::Tensor> bias) {
  const auto f = static_cast<Format>(ggml_type);
  check_linear_args("quant_matmul_q8", out, x, blocks, f, bias);
#if defined(REDSERVE_QUANT_Q8_MATMUL)
  if (x.size(0) == 0 || blocks.size(0) == 0) return;
  if (x.scalar_type() == torch::kBFloat16) {
    q8_dispatch<at::BFloat16>(out, x, blocks, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, f);
  } else {
    q8_dispatch<float>(out, x, blocks, bias.has_value() ? bias->data_ptr<float>() : nullptr, f);
  }
#else
  TORCH_CHECK(false, "quant_matmul_q8: this build has no AVX-512 VNNI");
#endif
}

template <typename T>
void matmul_dispatch(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks, const T* bias, Format f) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  const T* xd = x.data_ptr<T>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
#if defined(REDSERVE_QUANT_BF16_ROWS)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return with_format(f, [&]<Format F>() { dot_matmul<F>(o, xd, w, bias, m, k, n, row_bytes); });
  }
#endif
  with_format(f, [&]<Format F>() { float_matmul<F>(o, xd, w, bias, m, k, n, row_bytes); });
}

void quant_matmul(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                  c10::optional<torch::Tensor> bias) {
  const auto f = static_cast<Format>(ggml_type);
  check_linear_args("quant_matmul", out, x, blocks, f, bias);
  if (x.size(0) == 0 || blocks.size(0) == 0) return;
  if (x.scalar_type() == torch::kBFloat16) {
    matmul_dispatch<at::BFloat16>(out, x, blocks, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, f);
  } else {
    matmul_dispatch<float>(out, x, blocks, bias.has_value() ? bias->data_ptr<float>() : nullptr, f);
  }
}

// Whether quant_matmul multiplies bfloat16 x on AMX tiles (this build has them and the process may use them).
bool amx_matmul_used() {
#if defined(REDSERVE_QUANT_BF16_ROWS) && defined(REDSERVE_AMX_BF16)
  return redserve_amx::permitted();
#else
  return false;
#endif
}

bool native_bf16_matmul() {
#if defined(REDSERVE_QUANT_BF16_ROWS)
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "out = x @ dequantize(blocks).T (+ bias), GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 blocks");
  m.def("quant_matmul", &quant_matmul,
        "out = x @ dequantize(blocks).T (+ bias) for many rows of x: the weights decoded once a call, x in its own dtype");
  m.def("quant_matmul_q8", &quant_matmul_q8,
        "out = x @ dequantize(blocks).T (+ bias) for many rows of x, x rounded to int8 per block (llama.cpp's q8)");
  m.def("q8_matmul", &q8_matmul_built, "whether this build has quant_matmul_q8 (AVX-512 VNNI)");
  m.def("amx_matmul", &amx_matmul_used,
        "whether quant_matmul multiplies bfloat16 x on AMX tiles (the weights rounded to bfloat16 first)");
  m.def("native_bf16_matmul", &native_bf16_matmul,
        "whether quant_matmul multiplies bfloat16 x natively, the weights rounded to bfloat16 first (AMX tiles or "
        "AVX-512 BF16 dot products)");
  m.def("dequantize_rows", &dequantize_rows, "out = the float32 or bfloat16 weights of GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 block rows");
}
