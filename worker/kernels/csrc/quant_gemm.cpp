// y = x W^T (+ b) with W [N, K] kept as GGUF blocks of 32 weights (Q8_0, Q4_0, Q4_1), the dequantization in
// registers. Each row of W is its K / 32 blocks back to back, in the file's own layout:
//   Q8_0  34 bytes: fp16 d, 32 int8 q                 w = d * q
//   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles       w = d * (q - 8)
//   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes nibbles  w = d * q + m
// (a nibble byte j holds weight j in its low half and weight j + 16 in its high half).
//
// The rows of x are first quantized to int8 per block of 32, as llama.cpp's q8 activations, and then once
// more: a = max |x|, e = a / 127, q = round(x / e), and the remainder r = x - e q (|r| <= e / 2) as
// q' = round(r * 256 / e) clamped to [-127, 127], so x = e (q + q' / 256) within e / 256 (llama.cpp's q8
// alone leaves e / 2: on SmolLM2 that flips greedy near-ties, 0.08 logits apart, that the float model keeps).
// Each block also keeps s = e (sum(q) + sum(q') / 256). A block's dot product is then integer sums over
// 32 int8 x int8 (Q8_0) or uint4 x int8 (Q4) products, 256 sum(qw q) + sum(qw q') (exact in int32), scaled
// by d * e / 256:
//   Q8_0: d e' sum      Q4_1: d e' sum + m s      Q4_0 as Q4_1 with m = -8 d      (e' = e / 256)
// The integer sums: AVX-512 VNNI vpdpbusd (unsigned x signed bytes into int32, no saturation); else AVX2
// vpmaddubsw + vpmaddwd (int16 pairs cannot saturate here: |qw| <= 127 after the sign trick or <= 15, |qx| <= 127);
// else the plain loop. Which path a build takes follows the CPU it is built for (-march=native; the build
// cache is keyed by the CPU's flags), as small_gemm.cpp.
//
// Threads: W's rows are split over torch's intra-op threads in tiles of kRowsPerTile rows, at least
// kMinWeightsPerTask weights a task, so a small layer stays on one thread.
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
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTile = 4;
constexpr int64_t kMinWeightsPerTask = 1 << 20;

enum class Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // GGML's type ids

int64_t block_bytes(Format f) {
  switch (f) {
    case Format::kQ8_0: return 34;
    case Format::kQ4_0: return 18;
    case Format::kQ4_1: return 20;
  }
  return 0;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// The rows of x as int8 blocks: q and the remainder's q' [M, K], e / 256 and s [M, K / 32].
struct QuantizedRows {
  std::vector<int8_t> q, rest;
  std::vector<float> e, s;
  int64_t k = 0, blocks = 0;
  const int8_t* qrow(int64_t row, int64_t b) const { return q.data() + row * k + b * kBlock; }
  const int8_t* rest_row(int64_t row, int64_t b) const { return rest.data() + row * k + b * kBlock; }
  float scale(int64_t row, int64_t b) const { return e[row * blocks + b]; }
  float sum(int64_t row, int64_t b) const { return s[row * blocks + b]; }
};

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

template <typename T>
void quantize_rows(QuantizedRows& out, const T* x, int64_t m, int64_t k) {
  out.k = k;
  out.blocks = k / kBlock;
  out.q.resize(m * k);
  out.rest.resize(m * k);
  out.e.resize(m * out.blocks);
  out.s.resize(m * out.blocks);
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
      int sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        const float r = std::nearbyint((v[j] - e * q[j]) * inv * 256.f);
        rest[j] = static_cast<int8_t>(std::clamp(r, -127.f, 127.f));
        sum += 256 * q[j] + rest[j];
      }
      out.e[i] = e / 256.f;
      out.s[i] = e / 256.f * static_cast<float>(sum);
    }
  });
}

// ---- one block's integer dot product ---------------------------------------------------------------------

#if defined(REDSERVE_QUANT_AVX2)
// sum of u8 x i8 products as 8 int32 lanes.
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

// A block's weights as the unsigned operand of dot_u8_i8, and how to turn x's int8 into the signed one.
struct Q8Block {
  __m256i w;
  static constexpr bool kHasMin = false;
  float d, m = 0.f;
  explicit Q8Block(const uint8_t* p) : w(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))),
                                       d(half_to_float(p)) {}
  // int8 x int8: |w| as the unsigned operand, x with w's sign as the signed one.
  __m256i dot(__m256i x) const { return dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
};

inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);  // low halves: 0..15, high: 16..31
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

template <Format F>
struct Q4Block {
  __m256i w;
  static constexpr bool kHasMin = true;
  float d, m;
  explicit Q4Block(const uint8_t* p)
      : w(unpack_nibbles(p + (F == Format::kQ4_1 ? 4 : 2))),
        d(half_to_float(p)),
        m(F == Format::kQ4_1 ? half_to_float(p + 2) : -8.f * half_to_float(p)) {}
  __m256i dot(__m256i x) const { return dot_u8_i8(w, x); }
};

template <Format F>
struct BlockOf { using type = Q4Block<F>; };
template <>
struct BlockOf<Format::kQ8_0> { using type = Q8Block; };

// out[j * ROWS + r] = row r of the tile . row j of x, for ROWS rows of W and XS rows of x.
template <Format F, int ROWS, int XS>
inline void dot_tile(float* out, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t x0) {
  using Block = typename BlockOf<F>::type;
  constexpr int64_t kBytes = F == Format::kQ8_0 ? 34 : (F == Format::kQ4_1 ? 20 : 18);
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
        const __m256i sum = _mm256_add_epi32(_mm256_slli_epi32(blk.dot(xq[j]), 8), blk.dot(xr[j]));
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
          const uint8_t* nib = p + (F == Format::kQ4_1 ? 4 : 2);
          m = F == Format::kQ4_1 ? half_to_float(p + 2) : -8.f * d;
          for (int i = 0; i < kBlock / 2; ++i) {
            dot += (nib[i] & 0x0F) * (256 * q[i] + rest[i]) + (nib[i] >> 4) * (256 * q[i + 16] + rest[i + 16]);
          }
        }
        total += d * x.scale(x0 + j, b) * static_cast<float>(dot) + m * x.sum(x0 + j, b);
      }
      out[j * ROWS + r] = total;
    }
  }
}
#endif

template <typename T>
inline void store(T* out, int64_t n, int64_t row, int64_t col, const float* sums, int64_t cols, const T* bias) {
  for (int64_t r = 0; r < cols; ++r)
    out[row * n + col + r] = static_cast<T>(sums[r] + (bias ? to_float(bias[col + r]) : 0.f));
}

// Output columns [first, last) of every row of x.
template <Format F, typename T>
void columns(T* out, const QuantizedRows& x, const uint8_t* w, const T* bias, int64_t m, int64_t n,
             int64_t row_bytes, int64_t first, int64_t last) {
  float tile[2 * kRowsPerTile];
  int64_t col = first;
  for (; col + kRowsPerTile <= last; col += kRowsPerTile) {
    const uint8_t* rows = w + col * row_bytes;
    int64_t row = 0;
    for (; row + 2 <= m; row += 2) {  // two rows of x per pass over the tile: 8 accumulators
      dot_tile<F, kRowsPerTile, 2>(tile, rows, row_bytes, x, row);
      store(out, n, row, col, tile, kRowsPerTile, bias);
      store(out, n, row + 1, col, tile + kRowsPerTile, kRowsPerTile, bias);
    }
    for (; row < m; ++row) {
      dot_tile<F, kRowsPerTile, 1>(tile, rows, row_bytes, x, row);
      store(out, n, row, col, tile, kRowsPerTile, bias);
    }
  }
  for (; col < last; ++col) {
    for (int64_t row = 0; row < m; ++row) {
      dot_tile<F, 1, 1>(tile, w + col * row_bytes, row_bytes, x, row);
      store(out, n, row, col, tile, 1, bias);
    }
  }
}

template <typename T>
void run(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blocks, const T* bias, Format f) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  QuantizedRows xq;
  quantize_rows(xq, x.data_ptr<T>(), m, k);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  const int64_t tiles = (n + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / std::max<int64_t>(1, kRowsPerTile * k * m));
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    const int64_t c0 = first * kRowsPerTile, c1 = std::min(n, last * kRowsPerTile);
    switch (f) {
      case Format::kQ8_0: return columns<Format::kQ8_0>(o, xq, w, bias, m, n, row_bytes, c0, c1);
      case Format::kQ4_0: return columns<Format::kQ4_0>(o, xq, w, bias, m, n, row_bytes, c0, c1);
      case Format::kQ4_1: return columns<Format::kQ4_1>(o, xq, w, bias, m, n, row_bytes, c0, c1);
    }
  });
}

void quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                  c10::optional<torch::Tensor> bias) {
  const auto f = static_cast<Format>(ggml_type);
  TORCH_CHECK(f == Format::kQ8_0 || f == Format::kQ4_0 || f == Format::kQ4_1,
              "quant_linear: GGML type ", ggml_type, " is not Q8_0, Q4_0 or Q4_1");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && out.scalar_type() == dtype,
              "quant_linear: x and out float32 or bfloat16, one dtype");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8, "quant_linear: blocks must be uint8");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2 && out.dim() == 2, "quant_linear: x [M, K], blocks [N, B], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && blocks.is_contiguous() && out.is_contiguous(), "quant_linear: contiguous tensors only");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % kBlock == 0, "quant_linear: K (", k, ") must be a multiple of 32");
  TORCH_CHECK(blocks.size(1) == k / kBlock * block_bytes(f), "quant_linear: blocks hold ", blocks.size(1),
              " bytes a row, K = ", k, " needs ", k / kBlock * block_bytes(f));
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "quant_linear: out must be [M, N]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n,
                "quant_linear: bias [N] of x's dtype");
  }
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
                                       : unpack_nibbles(p + (F == Format::kQ4_1 ? 4 : 2));
  const __m256 dv = _mm256_set1_ps(d);
  const __m256 mv = _mm256_set1_ps(F == Format::kQ4_1 ? half_to_float(p + 2) : -8.f * d);
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
    const uint8_t* nib = p + (F == Format::kQ4_1 ? 4 : 2);
    const float m = F == Format::kQ4_1 ? half_to_float(p + 2) : -8.f * d;
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      w[j] = std::fma(static_cast<float>(nib[j] & 0x0F), d, m);
      w[j + 16] = std::fma(static_cast<float>(nib[j] >> 4), d, m);
    }
  }
#endif
}

template <Format F>
void dequantize_range(float* dst, const uint8_t* src, int64_t first, int64_t last) {
  constexpr int64_t kBytes = F == Format::kQ8_0 ? 34 : (F == Format::kQ4_1 ? 20 : 18);
  for (int64_t i = first; i < last; ++i) dequantize_block<F>(dst + i * kBlock, src + i * kBytes);
}

// out[r] = the weights of blocks row r, as float32 (for many rows of x, where a float GEMM beats the int8 path).
void dequantize_rows(torch::Tensor out, torch::Tensor blocks, int64_t ggml_type) {
  const auto f = static_cast<Format>(ggml_type);
  TORCH_CHECK(f == Format::kQ8_0 || f == Format::kQ4_0 || f == Format::kQ4_1,
              "dequantize_rows: GGML type ", ggml_type, " is not Q8_0, Q4_0 or Q4_1");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && out.scalar_type() == torch::kFloat && blocks.dim() == 2 &&
                  out.dim() == 2 && blocks.is_contiguous() && out.is_contiguous(),
              "dequantize_rows: uint8 blocks [N, B] and float32 out [N, K], contiguous");
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1), bytes = block_bytes(f);
  const int64_t nb = row_bytes / bytes, k = nb * kBlock;
  TORCH_CHECK(row_bytes % bytes == 0 && out.size(0) == n && out.size(1) == k, "dequantize_rows: shape mismatch");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n * nb, 4096, [&](int64_t first, int64_t last) {
    switch (f) {
      case Format::kQ8_0: return dequantize_range<Format::kQ8_0>(dst, src, first, last);
      case Format::kQ4_0: return dequantize_range<Format::kQ4_0>(dst, src, first, last);
      case Format::kQ4_1: return dequantize_range<Format::kQ4_1>(dst, src, first, last);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "out = x @ dequantize(blocks).T (+ bias), GGUF Q8_0 / Q4_0 / Q4_1 blocks");
  m.def("dequantize_rows", &dequantize_rows, "out = the float32 weights of GGUF Q8_0 / Q4_0 / Q4_1 block rows");
}
