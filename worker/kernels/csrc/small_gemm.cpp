// y = x W^T (+ b) for a few rows of x (decode at small batch), float32, W [N, K] row-major as nn.Linear
// keeps it. At one to a few rows the product is a matrix-vector product bound by reading W once from
// memory; the BLAS torch calls (MKL on an AMD CPU) reaches about 60% of the read bandwidth there. This
// kernel streams four rows of W at a time, each row read once for every row of x while it sits in L1,
// with 8-wide FMAs (AVX2) or the compiler's vectorisation of the plain loop elsewhere.
//
// Threads: W's rows are split over torch's intra-op threads in blocks of at least kMinBytesPerTask of W,
// so a small matrix stays on one thread (a barrier costs more than it saves) while a large model's layers
// use every core's share of the memory bandwidth, as F.linear does.
//
// bfloat16 (x, W, out and bias all bfloat16) streams half the bytes: on a CPU with AVX-512 BF16 each step is
// one vdpbf16ps over 32 pairs (products exact in float32, summed in float32); elsewhere 8 values at a time are
// widened to float32 (a 16-bit shift) and multiplied with FMAs (AVX2), or the plain loop. The sum is rounded
// to bfloat16 once, after the bias, as F.linear does. Which path a build takes follows the CPU it is built
// for (-march=native; the build cache is keyed by the CPU's flags).
//
// Rules: float32 or bfloat16, contiguous x [M, K], W [N, K], out [M, N] and bias [N] (optional), one dtype
// for all; the Python side checks and sends anything else to F.linear. Results agree with F.linear to
// summation order (bfloat16: to one rounding of a float32 sum).

#include <torch/extension.h>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRowsPerBlock = 4;
constexpr int64_t kMinBytesPerTask = 1 << 20;  // of W per thread: smaller products stay on one thread

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r] = dot(w + r * k, x) for r < 4.
inline void dot4(float* out, const float* w, const float* x, int64_t k) {
  const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  // The next block of rows follows this one in memory: ask for it, two cache lines per step, while
  // this one is summed (the hardware prefetcher ramps up too slowly on rows of a few KB).
  const char* next = reinterpret_cast<const char*>(w + kRowsPerBlock * k);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    _mm_prefetch(next + i * 16, _MM_HINT_T0);
    _mm_prefetch(next + i * 16 + 64, _MM_HINT_T0);
    const __m256 xv = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
  }
  float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
  for (; i < k; ++i) {
    s0 += w0[i] * x[i];
    s1 += w1[i] * x[i];
    s2 += w2[i] * x[i];
    s3 += w3[i] * x[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

inline float dot1(const float* w, const float* x, int64_t k) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a);
  float s = hsum(a);
  for (; i < k; ++i) s += w[i] * x[i];
  return s;
}
#else
inline float dot1(const float* w, const float* x, int64_t k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < k; ++i) s += w[i] * x[i];
  return s;
}

inline void dot4(float* out, const float* w, const float* x, int64_t k) {
  for (int64_t r = 0; r < kRowsPerBlock; ++r) out[r] = dot1(w + r * k, x, k);
}
#endif


// ---- bfloat16 -------------------------------------------------------------------------------------------

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX512BF16__)
inline __m512bh load_bf16(const uint16_t* p, int64_t n) {  // n < 32 zero-fills the rest
  const __m512i v = n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
  return (__m512bh)v;
}

// out[j * rows + r] = dot(w + r * k, x + j * k) for r < ROWS rows of W and j < XS rows of x: ROWS * XS
// accumulators in registers, each W and x load used XS or ROWS times; 32 pairs a step with vdpbf16ps.
template <int ROWS, int XS>
inline void dot_tile_bf16(float* out, const uint16_t* w, const uint16_t* x, int64_t k) {
  __m512 acc[XS][ROWS];
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm512_setzero_ps();
  const char* next = reinterpret_cast<const char*>(w + ROWS * k);
  for (int64_t i = 0; i < k; i += 32) {
    for (int r = 0; r < ROWS; ++r)  // the next block of W, as many lines as this step reads of this one
      _mm_prefetch(next + (i * ROWS + r * 32) * 2, _MM_HINT_T0);
    __m512bh xv[XS];
    for (int j = 0; j < XS; ++j) xv[j] = load_bf16(x + j * k + i, k - i);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh wv = load_bf16(w + r * k + i, k - i);
      for (int j = 0; j < XS; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv, xv[j]);
    }
  }
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < ROWS; ++r) out[j * ROWS + r] = _mm512_reduce_add_ps(acc[j][r]);
}

// out[r] = dot(w + r * k, x) for r < rows (at most 4).
inline void dot_rows_bf16(float* out, const uint16_t* w, const uint16_t* x, int64_t k, int64_t rows) {
  if (rows == kRowsPerBlock) return dot_tile_bf16<kRowsPerBlock, 1>(out, w, x, k);
  for (int64_t r = 0; r < rows; ++r) dot_tile_bf16<1, 1>(out + r, w + r * k, x, k);
}

#define REDSERVE_BF16_TILES 1
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 widen8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline void dot_rows_bf16(float* out, const uint16_t* w, const uint16_t* x, int64_t k, int64_t rows) {
  __m256 acc[kRowsPerBlock] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 xv = widen8(x + i);
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_fmadd_ps(widen8(w + r * k + i), xv, acc[r]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float s = hsum(acc[r]);
    for (int64_t j = i; j < k; ++j) s += bf16_to_float(w[r * k + j]) * bf16_to_float(x[j]);
    out[r] = s;
  }
}
#else
inline void dot_rows_bf16(float* out, const uint16_t* w, const uint16_t* x, int64_t k, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < k; ++j) s += bf16_to_float(w[r * k + j]) * bf16_to_float(x[j]);
    out[r] = s;
  }
}
#endif

void columns_bf16(at::BFloat16* out, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
                  int64_t n, int64_t k, int64_t first, int64_t last) {
  float block[2 * kRowsPerBlock];
  auto store = [&](int64_t row, int64_t col, const float* sums, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r)
      out[row * n + col + r] = at::BFloat16(sums[r] + (bias ? bf16_to_float(bias[col + r]) : 0.f));
  };
  for (int64_t col = first; col < last; col += kRowsPerBlock) {
    const int64_t rows = std::min<int64_t>(kRowsPerBlock, last - col);
    int64_t row = 0;
#if defined(REDSERVE_BF16_TILES)
    if (rows == kRowsPerBlock) {  // two rows of x per pass over the block: 8 accumulators
      for (; row + 2 <= m; row += 2) {
        dot_tile_bf16<kRowsPerBlock, 2>(block, w + col * k, x + row * k, k);
        store(row, col, block, rows);
        store(row + 1, col, block + kRowsPerBlock, rows);
      }
    }
#endif
    for (; row < m; ++row) {
      dot_rows_bf16(block, w + col * k, x + row * k, k, rows);
      store(row, col, block, rows);
    }
  }
}

// Output columns [first, last) of every row of x.
void columns(float* out, const float* x, const float* w, const float* bias, int64_t m, int64_t n, int64_t k,
             int64_t first, int64_t last) {
  float block[kRowsPerBlock];
  int64_t col = first;
  for (; col + kRowsPerBlock <= last; col += kRowsPerBlock) {
    for (int64_t row = 0; row < m; ++row) {
      dot4(block, w + col * k, x + row * k, k);
      for (int64_t r = 0; r < kRowsPerBlock; ++r) out[row * n + col + r] = block[r] + (bias ? bias[col + r] : 0.f);
    }
  }
  for (; col < last; ++col) {
    for (int64_t row = 0; row < m; ++row) out[row * n + col] = dot1(w + col * k, x + row * k, k) + (bias ? bias[col] : 0.f);
  }
}

void small_linear(torch::Tensor out, torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && w.scalar_type() == dtype &&
                  out.scalar_type() == dtype, "small_linear: float32 or bfloat16, one dtype for x, w and out");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "small_linear: x [M, K], w [N, K], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "small_linear: contiguous tensors only");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && out.size(0) == m && out.size(1) == n, "small_linear: shape mismatch");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n,
                "small_linear: bias [N] of x's dtype");
  }
  const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t block_bytes = kRowsPerBlock * k * static_cast<int64_t>(w.element_size());
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, block_bytes));
  if (dtype == torch::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    const auto* b = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
    auto* o = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
      columns_bf16(o, xp, wp, b, m, n, k, first * kRowsPerBlock, std::min(n, last * kRowsPerBlock));
    });
    return;
  }
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    columns(o, xp, wp, b, m, n, k, first * kRowsPerBlock, std::min(n, last * kRowsPerBlock));
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "out = x @ w.T (+ bias) for a few rows of x, float32 or bfloat16");
}
