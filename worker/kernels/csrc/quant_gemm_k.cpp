// y = x W^T (+ b) with W [N, K] kept as GGUF "k-quant" super-blocks of 256 weights (Q4_K, Q6_K), the
// dequantization in registers; the companion of quant_gemm.cpp (32-weight blocks), with the same interface
// (`quant_linear`, `dequantize_rows`) and the same activation rounding. Each row of W is its K / 256 blocks
// back to back, in the file's own layout:
//   Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] (packed, below),
//        128 bytes of nibbles. Sub-block s (32 weights) of the 8: bytes 32 (s / 2) .. +32, low halves for
//        even s, high halves for odd s.                            w = d sc_s q - dmin m_s
//        Scales: s < 4: sc = b[s] & 63, m = b[s + 4] & 63; s >= 4: sc = b[s + 4] & 15 | (b[s - 4] >> 6) << 4,
//        m = b[s + 4] >> 4 | (b[s] >> 6) << 4.
//   Q6_K 210 bytes: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 sc[16] (one a 16 weights),
//        fp16 d. Per half h (128 weights: ql[64 h ..], qh[32 h ..]), its four runs g of 32 weights take the
//        low (g < 2) or high (g >= 2) nibbles of ql[64 h + 32 (g & 1) ..] and bits 2g, 2g + 1 of the qh bytes.
//                                                                    w = d sc_{i / 16} (q - 32)
//
// x is rounded per block of 32 as in quant_gemm.cpp (quant_rows.h, shared): e = max |x| / 127, q = round(x / e),
// the remainder to int8 at e / 256, so x = e (q + q' / 256) within e / 256; s = e (sum(q) + sum(q') / 256).
// A 32-weight sub-block's dot product is integer sums, 256 sum(qw q) + sum(qw q'), scaled in float:
//   Q4_K: d sc_s e' sum - dmin m_s s        (qw the nibble, 0..15: the unsigned operand as it is)
//   Q6_K: per 16 weights, d sc e' sum - 32 d sc s16   (qw = q, 0..63, the unsigned operand as it is; s16 is s
//        over 16 values; int32 lanes 0-3 hold the first 16 weights' sums and lanes 4-7 the second's, so each
//        half takes its own scale. The -32 offset as a min term costs two FMAs a block where x with qw's
//        sign (the Q8_0 trick) cost three sign ops a 32 weights: 1.1-1.2x slower, measured)
// The integer sums: AVX-512 VNNI / AVX-VNNI vpdpbusd, else AVX2 vpmaddubsw + vpmaddwd (pairs of u8 x s8 products
// stay within int16: 2 * 63 * 127 at most), else a plain loop; chosen at compile time from the -march macros
// (the build cache is keyed by the CPU's flags). tests/test_quant_gemm_k.py builds this file a second and third
// time with -mno-avx512vnni -mno-avxvnni (the AVX2 path) and -mno-avx2 (the plain loop) and tests each.
//
// Threads: W's rows over torch's intra-op threads in tiles of kRowsPerTile rows (quant_rows.h).
//
// Rules: x [M, K] float32 or bfloat16 contiguous, K a multiple of 256; blocks uint8 [N, K / 256 * block bytes]
// contiguous; out [M, N] of x's dtype; bias [N] of x's dtype or none. The error against the float product of
// the dequantized weights is the activation rounding (at most sum over 32-blocks of e / 256 * sum |w|) plus
// float32 rounding of the decomposed terms (bound derived in tests/test_quant_gemm_k.py).

#include <torch/extension.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define REDSERVE_QUANT_K_AVX2 1
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "bf16_rows.h"
#include "q8_matmul.h"
#include "quant_rows.h"

namespace {

using namespace redserve_quant;

constexpr int64_t kSuper = 256;      // weights a k-quant block (kBlock, 32, is the activation block and Q4_K's sub-block)
constexpr int64_t kSubs = kSuper / kBlock;

enum class Format : int64_t { kQ4_K = 12, kQ6_K = 14 };  // GGML's type ids

constexpr int64_t block_bytes(Format f) { return f == Format::kQ4_K ? 144 : 210; }

// Q4_K's 8 sub-block scales and mins as d * sc and dmin * m (float32, rounded once each: gguf's values).
inline void q4k_scales(const uint8_t* p, float* ds, float* dm) {
  const float d = half_to_float(p), dmin = half_to_float(p + 2);
  const uint8_t* b = p + 4;
  for (int s = 0; s < 8; ++s) {
    const int sc = s < 4 ? b[s] & 63 : (b[s + 4] & 15) | ((b[s - 4] >> 6) << 4);
    const int m = s < 4 ? b[s + 4] & 63 : (b[s + 4] >> 4) | ((b[s] >> 6) << 4);
    ds[s] = d * static_cast<float>(sc);
    dm[s] = dmin * static_cast<float>(m);
  }
}

// Q6_K's 16 scales as d * sc.
inline void q6k_scales(const uint8_t* p, float* ds) {
  const float d = half_to_float(p + 208);
  for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(static_cast<int8_t>(p[192 + i]));
}

// Q6_K weight i (0..255) of a block as q - 32.
inline int q6k_value(const uint8_t* p, int i) {
  const int h = i / 128, g = (i % 128) / 32, l = i % 32;
  const int low = p[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1)) & 15;
  const int high = p[128 + 32 * h + l] >> (2 * g) & 3;
  return (low | high << 4) - 32;
}

#if defined(REDSERVE_QUANT_K_AVX2)
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 256 sum(u q) + sum(u q') over one 32-block of x row `row`, as 8 int32 lanes (4 weights a lane).
inline __m256i block_sum(__m256i u, const QuantizedRows& x, int64_t row, int64_t b) {
  return _mm256_add_epi32(_mm256_slli_epi32(dot_u8_i8(u, load32(x.qrow(row, b))), 8),
                          dot_u8_i8(u, load32(x.rest_row(row, b))));
}

// Q4_K's d sc and dmin m (as q4k_scales) with the 6-bit fields cut from three 32-bit words, 4 bytes at once.
inline void q4k_scales_simd(const uint8_t* p, __m256& ds, __m256& dm) {
  uint32_t w[3];
  std::memcpy(w, p + 4, 12);
  const uint32_t sc_low = w[0] & 0x3F3F3F3F, m_low = w[1] & 0x3F3F3F3F;
  const uint32_t sc_high = (w[2] & 0x0F0F0F0F) | ((w[0] >> 2) & 0x30303030);  // bits 6-7 of bytes 0-3 as 4-5
  const uint32_t m_high = ((w[2] >> 4) & 0x0F0F0F0F) | ((w[1] >> 2) & 0x30303030);
  const auto widen = [](uint32_t low, uint32_t high) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(high), static_cast<int>(low))));
  };
  ds = _mm256_mul_ps(_mm256_set1_ps(half_to_float(p)), widen(sc_low, sc_high));
  dm = _mm256_mul_ps(_mm256_set1_ps(half_to_float(p + 2)), widen(m_low, m_high));
}

// Q6_K run g (0..3) of a half: its 32 weights' q (0..63), from the half's ql[0..32], ql[32..64] and qh.
template <int G>
inline __m256i q6k_run(__m256i ql0, __m256i ql1, __m256i qh) {
  const __m256i mask4 = _mm256_set1_epi8(15), mask2 = _mm256_set1_epi8(3);
  const __m256i ql = G & 1 ? ql1 : ql0;
  const __m256i low = _mm256_and_si256(G >= 2 ? _mm256_srli_epi16(ql, 4) : ql, mask4);
  const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * G), mask2), 4);
  return _mm256_or_si256(low, high);
}

// out[j * ROWS + r] = row r of the tile . row j of x, for ROWS rows of W and XS rows of x.
template <Format F, int ROWS, int XS>
inline void dot_tile(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
  constexpr int64_t kBytes = block_bytes(F);
  __m256 acc[XS][ROWS], mins[XS][ROWS];
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r) acc[j][r] = mins[j][r] = _mm256_setzero_ps();
  const int64_t supers = x.blocks / kSubs;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const int64_t b0 = sb * kSubs;  // the first 32-block of x under this weight block
    for (int r = 0; r < ROWS; ++r) {
      const uint8_t* p = w + r * row_bytes + sb * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(p + ROWS * row_bytes), _MM_HINT_T0);  // the next tile
      _mm_prefetch(reinterpret_cast<const char*>(p + ROWS * row_bytes + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + ROWS * row_bytes + 128), _MM_HINT_T0);
      if constexpr (F == Format::kQ4_K) {
        __m256 dsv, dmv;
        q4k_scales_simd(p, dsv, dmv);
        alignas(32) float factors[XS][8];  // d sc_s e'_s for each sub-block s and row of x
        for (int j = 0; j < XS; ++j) {
          mins[j][r] = _mm256_fmadd_ps(dmv, _mm256_loadu_ps(x.sums(x0 + j, b0)), mins[j][r]);
          _mm256_store_ps(factors[j], _mm256_mul_ps(dsv, _mm256_loadu_ps(x.scales(x0 + j, b0))));
        }
        for (int pair = 0; pair < 4; ++pair) {
          const __m256i bytes = load32(p + 16 + 32 * pair);
          const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
          for (int j = 0; j < XS; ++j) {
            const int64_t b = b0 + 2 * pair;
            const __m256i s0 = block_sum(lo, x, x0 + j, b), s1 = block_sum(hi, x, x0 + j, b + 1);
            acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_broadcast_ss(&factors[j][2 * pair]), acc[j][r]);
            acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_broadcast_ss(&factors[j][2 * pair + 1]),
                                        acc[j][r]);
          }
        }
      } else {
        const __m256 d = _mm256_set1_ps(half_to_float(p + 208));
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
        const __m256 ds0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));  // as q6k_scales
        const __m256 ds1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        alignas(32) float ds[16];
        _mm256_store_ps(ds, ds0);
        _mm256_store_ps(ds + 8, ds1);
        for (int j = 0; j < XS; ++j) {  // 32 ds . s16 over the block, subtracted at the end with the mins
          const float* s16 = x.sums16(x0 + j, b0);
          mins[j][r] = _mm256_fmadd_ps(ds0, _mm256_loadu_ps(s16), mins[j][r]);
          mins[j][r] = _mm256_fmadd_ps(ds1, _mm256_loadu_ps(s16 + 8), mins[j][r]);
        }
        for (int h = 0; h < 2; ++h) {
          const __m256i ql0 = load32(p + 64 * h), ql1 = load32(p + 64 * h + 32), qh = load32(p + 128 + 32 * h);
          const __m256i runs[4] = {q6k_run<0>(ql0, ql1, qh), q6k_run<1>(ql0, ql1, qh), q6k_run<2>(ql0, ql1, qh),
                                   q6k_run<3>(ql0, ql1, qh)};
          for (int g = 0; g < 4; ++g) {
            const int s = 4 * h + g;  // the 32-block within the weight block; scales 2s (lanes 0-3), 2s + 1
            const __m256 scales = _mm256_set_m128(_mm_set1_ps(ds[2 * s + 1]), _mm_set1_ps(ds[2 * s]));
            for (int j = 0; j < XS; ++j) {
              const __m256i sum = block_sum(runs[g], x, x0 + j, b0 + s);
              acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                          _mm256_mul_ps(scales, _mm256_set1_ps(x.scale(x0 + j, b0 + s))), acc[j][r]);
            }
          }
        }
      }
    }
  }
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r)
      out[j * ROWS + r] = hsum(acc[j][r]) - (F == Format::kQ6_K ? 32.f : 1.f) * hsum(mins[j][r]);
}
#else
// The plain loop: the same integer sums and scales as the SIMD path.
template <Format F, int ROWS, int XS>
inline void dot_tile(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
  constexpr int64_t kBytes = block_bytes(F);
  for (int j = 0; j < XS; ++j) {
    for (int r = 0; r < ROWS; ++r) {
      float total = 0.f, mins = 0.f;
      for (int64_t sb = 0; sb < x.blocks / kSubs; ++sb) {
        const uint8_t* p = w + r * row_bytes + sb * kBytes;
        float ds[16], dm[8];
        if constexpr (F == Format::kQ4_K) q4k_scales(p, ds, dm); else q6k_scales(p, ds);
        for (int s = 0; s < kSubs; ++s) {
          const int64_t b = sb * kSubs + s;
          const int8_t *q = x.qrow(x0 + j, b), *rest = x.rest_row(x0 + j, b);
          int32_t dot[2] = {0, 0};
          for (int i = 0; i < kBlock; ++i) {
            const int qw = F == Format::kQ4_K ? p[16 + 32 * (s / 2) + i] >> (4 * (s & 1)) & 15 : q6k_value(p, 32 * s + i);
            dot[i / 16] += qw * (256 * q[i] + rest[i]);
          }
          if constexpr (F == Format::kQ4_K) {
            total += ds[s] * x.scale(x0 + j, b) * static_cast<float>(dot[0] + dot[1]);
            mins += dm[s] * *x.sums(x0 + j, b);
          } else {
            total += ds[2 * s] * x.scale(x0 + j, b) * static_cast<float>(dot[0]);
            total += ds[2 * s + 1] * x.scale(x0 + j, b) * static_cast<float>(dot[1]);
          }
        }
      }
      out[j * ROWS + r] = total - mins;
    }
  }
}
#endif

template <Format F>
struct Tile {
  template <int ROWS, int XS>
  static void dot(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
    dot_tile<F, ROWS, XS>(out, w, row_bytes, x, x0);
  }
};

template <typename T>
void run(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks, const T* bias, Format f) {
  if (f == Format::kQ4_K) {
    run_rows<Tile<Format::kQ4_K>>(out, x, blocks, bias);
  } else {
    run_rows<Tile<Format::kQ6_K>>(out, x, blocks, bias);
  }
}

Format checked_format(int64_t ggml_type, const char* what) {
  const auto f = static_cast<Format>(ggml_type);
  TORCH_CHECK(f == Format::kQ4_K || f == Format::kQ6_K, what, ": GGML type ", ggml_type, " is not Q4_K or Q6_K");
  return f;
}

void quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                  c10::optional<torch::Tensor> bias) {
  const Format f = checked_format(ggml_type, "quant_linear");
  check_linear_args("quant_linear", out, x, blocks, kSuper, block_bytes(f), bias);
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), n = blocks.size(0);
  if (m == 0 || n == 0) return;
  if (dtype == torch::kBFloat16) {
    run<at::BFloat16>(out, x, blocks, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, f);
  } else {
    run<float>(out, x, blocks, bias.has_value() ? bias->data_ptr<float>() : nullptr, f);
  }
}

// One block's 256 weights as float32, the gguf package's values: (d sc) q - (dmin m) and (d sc) (q - 32),
// each product and difference rounded as numpy rounds it (fp-contract=off: a compiler may fuse
// Q4_K's product and difference into one FMA, which rounds once; GCC 12 -O3 happens not to, the attribute
// makes it a rule).
template <Format F>
__attribute__((optimize("fp-contract=off"))) inline void dequantize_block(float* w, const uint8_t* p) {
  if constexpr (F == Format::kQ4_K) {
    float ds[8], dm[8];
    q4k_scales(p, ds, dm);
    for (int s = 0; s < 8; ++s) {
      const uint8_t* nib = p + 16 + 32 * (s / 2);
      const int shift = 4 * (s & 1);
      for (int i = 0; i < 32; ++i) {
        const float prod = ds[s] * static_cast<float>(nib[i] >> shift & 15);
        w[32 * s + i] = prod - dm[s];
      }
    }
  } else {
    float ds[16];
    q6k_scales(p, ds);
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
      for (int g = 0; g < 4; ++g) {
        const uint8_t* low = ql + 32 * (g & 1);
        const int shift = 4 * (g >> 1);
        for (int part = 0; part < 2; ++part) {  // one scale a 16 weights: a loop the compiler vectorises
          const float scale = ds[8 * h + 2 * g + part];
          for (int i = 16 * part; i < 16 * part + 16; ++i) {
            const int q = ((low[i] >> shift & 15) | (qh[i] >> (2 * g) & 3) << 4) - 32;
            w[128 * h + 32 * g + i] = scale * static_cast<float>(q);
          }
        }
      }
    }
  }
}

// out[r] = the weights of blocks row r, as float32 or bfloat16 (rounded once from the float32 weights): the
// float GEMM paths for many rows of x (quantized_linear.py).
void dequantize_rows(torch::Tensor out, torch::Tensor blocks, int64_t ggml_type) {
  const Format f = checked_format(ggml_type, "dequantize_rows");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 &&
                  (out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16) && blocks.dim() == 2 &&
                  out.dim() == 2 && blocks.is_contiguous() && out.is_contiguous(),
              "dequantize_rows: uint8 blocks [N, B] and float32 or bfloat16 out [N, K], contiguous");
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1), bytes = block_bytes(f);
  const int64_t nb = row_bytes / bytes;
  TORCH_CHECK(row_bytes % bytes == 0 && out.size(0) == n && out.size(1) == nb * kSuper,
              "dequantize_rows: shape mismatch");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  auto run = [&]<typename DstT>(DstT* dst) {
    at::parallel_for(0, n * nb, 512, [&](int64_t first, int64_t last) {
      if (f == Format::kQ4_K) {
        dequantize_blocks_to(dst, first, last, kSuper,
                             [&](float* w, int64_t i) { dequantize_block<Format::kQ4_K>(w, src + i * bytes); });
      } else {
        dequantize_blocks_to(dst, first, last, kSuper,
                             [&](float* w, int64_t i) { dequantize_block<Format::kQ6_K>(w, src + i * bytes); });
      }
    });
  };
  if (out.scalar_type() == torch::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<at::BFloat16>());
  }
}

#if defined(REDSERVE_QUANT_Q8_MATMUL)
// quant_matmul_q8 (q8_matmul.h) for Q4_K: a sub-block's 32 nibbles as byte codes, d sc as its scale and
// -dmin m as its min. (Q6_K's scales are per 16 weights, finer than q8_matmul.h's 32: it keeps the tiled path.)
struct Q4KCodes {
  static void row(uint8_t* u, float* d, float* mn, const uint8_t* p, int64_t k) {
    const __m256i mask = _mm256_set1_epi8(15);
    for (int64_t sb = 0; sb < k / kSuper; ++sb, p += block_bytes(Format::kQ4_K)) {
      float ds[8], dm[8];
      q4k_scales(p, ds, dm);
      for (int s = 0; s < kSubs; ++s) {
        d[sb * kSubs + s] = ds[s];
        mn[sb * kSubs + s] = -dm[s];
      }
      for (int pair = 0; pair < kSubs / 2; ++pair) {  // sub-blocks 2 pair (low nibbles) and 2 pair + 1 (high)
        const __m256i bytes = load32(p + 16 + 32 * pair);
        uint8_t* out = u + sb * kSuper + 2 * kBlock * pair;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_and_si256(bytes, mask));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kBlock), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask));
      }
    }
  }
};
#endif

void quant_matmul_q8(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                     c10::optional<torch::Tensor> bias) {
  const Format f = checked_format(ggml_type, "quant_matmul_q8");
  TORCH_CHECK(f == Format::kQ4_K, "quant_matmul_q8: Q4_K only (Q6_K's scales are per 16 weights)");
  check_linear_args("quant_matmul_q8", out, x, blocks, kSuper, block_bytes(f), bias);
#if defined(REDSERVE_QUANT_Q8_MATMUL)
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  if (m == 0 || n == 0) return;
  if (x.scalar_type() == torch::kBFloat16) {
    redserve_q8::matmul<Q4KCodes>(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), blocks.data_ptr<uint8_t>(),
                                  bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, m, k, n, row_bytes);
  } else {
    redserve_q8::matmul<Q4KCodes>(out.data_ptr<float>(), x.data_ptr<float>(), blocks.data_ptr<uint8_t>(),
                                  bias.has_value() ? bias->data_ptr<float>() : nullptr, m, k, n, row_bytes);
  }
#else
  TORCH_CHECK(false, "quant_matmul_q8: this build has no AVX-512 VNNI");
#endif
}

// quant_matmul: many bfloat16 rows on AMX tiles (amx_tiles.h) or, without them, AVX-512 BF16 dot products
// (bf16_rows.h), W's rows dequantized as `dequantize_block` does (float32) and rounded once to bfloat16. Only
// where one of them is there: elsewhere the layer takes the dequantized tiles and F.linear
// (`native_bf16_matmul()` says which; `amx_matmul()` whether the tiles run it).
bool amx_matmul_used() {
#if defined(REDSERVE_AMX_BF16)
  return redserve_amx::permitted();
#else
  return false;
#endif
}

bool native_bf16_matmul() {
#if defined(REDSERVE_BF16_ROWS)
  return true;
#else
  return false;
#endif
}

void quant_matmul(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                  c10::optional<torch::Tensor> bias) {
  const Format f = checked_format(ggml_type, "quant_matmul");
  check_linear_args("quant_matmul", out, x, blocks, kSuper, block_bytes(f), bias);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "quant_matmul: bfloat16 x only");
  TORCH_CHECK(native_bf16_matmul(), "quant_matmul: this build has neither AMX tiles nor AVX-512 BF16");
#if defined(REDSERVE_BF16_ROWS)
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  if (m == 0 || n == 0) return;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const auto decode = [&](int64_t col, uint16_t* row, int64_t first, int64_t last) {
    if (first == 0) redserve_bf16::prefetch_next_block_row(w, col, n, row_bytes);
    alignas(64) float values[kSuper];
    for (int64_t sb = first; sb < last; ++sb) {
      const uint8_t* p = w + col * row_bytes + sb * block_bytes(f);
      if (f == Format::kQ4_K) {
        dequantize_block<Format::kQ4_K>(values, p);
      } else {
        dequantize_block<Format::kQ6_K>(values, p);
      }
      for (int64_t i = 0; i < kSuper; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(values + i + 16), _mm512_load_ps(values + i));
        _mm512_storeu_si512(row + sb * kSuper + i, reinterpret_cast<__m512i>(v));
      }
    }
  };
  auto* o = out.data_ptr<at::BFloat16>();
  const auto* xd = x.data_ptr<at::BFloat16>();
  const auto* b = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
#if defined(REDSERVE_AMX_BF16)
  if (redserve_amx::permitted()) return redserve_amx::matmul(o, xd, b, m, k, n, kSuper, decode);
#endif
  redserve_bf16::matmul(o, xd, b, m, k, n, kSuper, decode);
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul,
        "out = x @ dequantize(blocks).T (+ bias) for many bfloat16 rows of x, the weights rounded to bfloat16 (AMX "
        "tiles, else AVX-512 BF16 dot products)");
  m.def("amx_matmul", &amx_matmul_used, "whether quant_matmul runs on AMX tiles here (this build and process)");
  m.def("native_bf16_matmul", &native_bf16_matmul, "whether quant_matmul runs here (AMX tiles or AVX-512 BF16)");
  m.def("quant_linear", &quant_linear, "out = x @ dequantize(blocks).T (+ bias), GGUF Q4_K / Q6_K blocks");
  m.def("dequantize_rows", &dequantize_rows, "out = the float32 or bfloat16 weights of GGUF Q4_K / Q6_K block rows");
  m.def("quant_matmul_q8", &quant_matmul_q8,
        "out = x @ dequantize(blocks).T (+ bias) for many rows of x, Q4_K, x rounded to int8 per block (llama.cpp's q8)");
  m.def("q8_matmul", &q8_matmul_built, "whether this build has quant_matmul_q8 (AVX-512 VNNI)");
}
