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
// Rules: float32, contiguous x [M, K], W [N, K], out [M, N] and bias [N] (optional); the Python side
// checks and sends anything else to F.linear. Results agree with F.linear to summation order.

#include <torch/extension.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

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
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat,
              "small_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "small_linear: x [M, K], w [N, K], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "small_linear: contiguous tensors only");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && out.size(0) == m && out.size(1) == n, "small_linear: shape mismatch");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == n,
                "small_linear: bias [N] float32");
    b = bias->data_ptr<float>();
  }
  float* o = out.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t block_bytes = kRowsPerBlock * k * static_cast<int64_t>(sizeof(float));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, block_bytes));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    columns(o, xp, wp, b, m, n, k, first * kRowsPerBlock, std::min(n, last * kRowsPerBlock));
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "out = x @ w.T (+ bias) for a few rows of x, float32");
}
