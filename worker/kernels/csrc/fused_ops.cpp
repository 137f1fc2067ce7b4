// Fused CPU ops for the decoder layers: RMSNorm (optionally with the residual add folded in) and RoPE
// applied in place to q and k. One call replaces the 5-12 torch ops (and their temporaries) each of
// these takes, which is what they cost at small batch. float32 and bfloat16 only; the Python side
// sends anything else to its torch path. SiLU-and-mul of the MLP is one pass over gate and up (exp sixteen
// lanes at a time on AVX-512, eight on AVX2), and the sampler's row-wise argmax (float32 or bfloat16) sits beside them.
//
// Rules: rounding follows the Hugging Face / PyTorch op sequence in the tensor's own dtype, so float32
// agrees with the torch path up to summation order, and bfloat16 rounds at the same points: the norm
// rounds x * rstd to the dtype before the weight multiply (Llama), or multiplies by (offset + w) in
// float32 and rounds once (Gemma, offset 1); the residual add rounds its sum; RoPE rounds each product
// and then the sum. No multiply-add contraction (the pragma), so a product and a sum round as two
// torch ops do.

#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "simd_exp.h"

namespace {

constexpr int64_t kGrainElements = 1 << 18;  // below this many elements a call stays on one thread
constexpr int64_t kSiluGrainElements = 1 << 14;  // silu_and_mul's (its exp costs ~20x a norm's work a value)

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

struct Float32 {
  using T = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
};

// Branch-free bfloat16 <-> float32 (round to nearest even, NaN kept quiet) that the compiler vectorises.
struct BFloat16 {
  using T = uint16_t;
  static inline float load(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static inline uint16_t store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return f != f ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
  }
};

template <typename S>
inline float round_to(float v) { return S::load(S::store(v)); }

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], as torch's float32 silu then mul.
#if defined(__AVX2__) && defined(__FMA__)
// Eight values of a row as float32 lanes, and back: bfloat16 widens exactly; it rounds to nearest even, a NaN
// staying a quiet NaN (BFloat16::store, eight lanes at a time).
template <typename S>
inline __m256 load8(const typename S::T* p) {
  if constexpr (std::is_same_v<S, Float32>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

inline __m256i bf16_bits8(__m256 v) {  // the rounded bfloat16 of each lane, in the low 16 bits of its 32
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

template <typename S>
inline __m256 round8(__m256 v) {  // v rounded to the dtype (float32: itself)
  if constexpr (std::is_same_v<S, Float32>) {
    return v;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
  }
}

template <typename S>
inline void store8(typename S::T* p, __m256 v) {
  if constexpr (std::is_same_v<S, Float32>) {
    _mm256_storeu_ps(p, v);
  } else {
    const __m256i packed = _mm256_packus_epi32(bf16_bits8(v), _mm256_setzero_si256());  // per 128-bit lane
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0b1000)));
  }
}
#endif

#if defined(__AVX512F__)
// The same on sixteen lanes.
template <typename S>
inline __m512 load16(const typename S::T* p) {
  if constexpr (std::is_same_v<S, Float32>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

inline __m512i bf16_bits16(__m512 v) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds to nearest even as BFloat16::store does; only a NaN's payload may differ (a NaN stays one)
  return _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
#endif
}

template <typename S>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<S, Float32>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
  }
}

template <typename S>
inline void store16(typename S::T* p, __m512 v) {
  if constexpr (std::is_same_v<S, Float32>) {
    _mm512_storeu_ps(p, v);
  } else {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
#endif
  }
}
#endif

// out = round(round(silu(gate)) * up): F.silu(gate).mul_(up) in the row's dtype (float32: no rounding).
template <typename S>
inline void silu_mul_row(typename S::T* __restrict out, const typename S::T* gate, const typename S::T* up, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one16 = _mm512_set1_ps(1.f), zero16 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16<S>(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one16, redserve_simd::exp_avx512(_mm512_sub_ps(zero16, g))));
    store16<S>(out + i, _mm512_mul_ps(round16<S>(silu), load16<S>(up + i)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 g = load8<S>(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, redserve_simd::exp_avx2(_mm256_sub_ps(zero, g))));
    store8<S>(out + i, _mm256_mul_ps(round8<S>(silu), load8<S>(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = S::load(gate[i]);
    out[i] = S::store(round_to<S>(g / (1.f + std::exp(-g))) * S::load(up[i]));
  }
}

// One row: out = norm(x) * (offset + w), rounded as the rules say. out may alias x. Sixteen lanes at a time on
// AVX-512, eight on AVX2, as silu_mul_row (GCC's own vectorisation of the plain loops took ~1.8 cycles a value for
// the add-and-norm, SmolLM2's rows at T=64).
template <typename S>
void norm_row(typename S::T* out, const typename S::T* x, const typename S::T* w, int64_t n, float eps,
              float offset) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 sum8 = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8<S>(x + i);
    sum8 = _mm256_add_ps(sum8, _mm256_mul_ps(v, v));
  }
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  sum = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#endif
  for (; i < n; ++i) sum += S::load(x[i]) * S::load(x[i]);
  const float rstd = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 r16 = _mm512_set1_ps(rstd), off16 = _mm512_set1_ps(offset);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(load16<S>(x + i), r16), wv = load16<S>(w + i);
    store16<S>(out + i, offset == 0.f ? _mm512_mul_ps(round16<S>(v), wv) : _mm512_mul_ps(v, _mm512_add_ps(off16, wv)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 r8 = _mm256_set1_ps(rstd), off8 = _mm256_set1_ps(offset);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(load8<S>(x + i), r8), wv = load8<S>(w + i);
    store8<S>(out + i, offset == 0.f ? _mm256_mul_ps(round8<S>(v), wv) : _mm256_mul_ps(v, _mm256_add_ps(off8, wv)));
  }
#endif
  for (; i < n; ++i) {
    out[i] = offset == 0.f ? S::store(round_to<S>(S::load(x[i]) * rstd) * S::load(w[i]))
                           : S::store(S::load(x[i]) * rstd * (offset + S::load(w[i])));
  }
}

// residual = x + residual, rounded to the dtype.
template <typename S>
void add_row(typename S::T* residual, const typename S::T* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16<S>(residual + i, _mm512_add_ps(load16<S>(x + i), load16<S>(residual + i)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) store8<S>(residual + i, _mm256_add_ps(load8<S>(x + i), load8<S>(residual + i)));
#endif
  for (; i < n; ++i) residual[i] = S::store(S::load(x[i]) + S::load(residual[i]));
}

// Neox-style rotation of one head's halves, in place: each product rounded, then the sum.
template <typename S>
void rotate_head(typename S::T* __restrict x1, typename S::T* __restrict x2, const typename S::T* __restrict cos,
                 const typename S::T* __restrict sin, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= half; i += 16) {
    const __m512 a = load16<S>(x1 + i), b = load16<S>(x2 + i), c = load16<S>(cos + i), s = load16<S>(sin + i);
    store16<S>(x1 + i, _mm512_sub_ps(round16<S>(_mm512_mul_ps(a, c)), round16<S>(_mm512_mul_ps(b, s))));
    store16<S>(x2 + i, _mm512_add_ps(round16<S>(_mm512_mul_ps(b, c)), round16<S>(_mm512_mul_ps(a, s))));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load8<S>(x1 + i), b = load8<S>(x2 + i), c = load8<S>(cos + i), s = load8<S>(sin + i);
    store8<S>(x1 + i, _mm256_sub_ps(round8<S>(_mm256_mul_ps(a, c)), round8<S>(_mm256_mul_ps(b, s))));
    store8<S>(x2 + i, _mm256_add_ps(round8<S>(_mm256_mul_ps(b, c)), round8<S>(_mm256_mul_ps(a, s))));
  }
#endif
  for (; i < half; ++i) {
    const float a = S::load(x1[i]), b = S::load(x2[i]), c = S::load(cos[i]), s = S::load(sin[i]);
    x1[i] = S::store(round_to<S>(a * c) - round_to<S>(b * s));
    x2[i] = S::store(round_to<S>(b * c) + round_to<S>(a * s));
  }
}

// Eight of the row's values from i, widened to float32 (exactly, for bfloat16).
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// The first index of the row's maximum; a NaN counts as the maximum (torch.argmax's rule). bfloat16 values
// widen exactly, so a bfloat16 row's answer is its float32 copy's.
template <typename S>
inline int64_t argmax_row(const typename S::T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 m = load8(x), unordered = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = load8(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float lane : lanes) best = std::max(best, lane);
    nan = _mm256_movemask_ps(unordered) != 0;
  }
#endif
  for (; i < n; ++i) {
    const float v = S::load(x[i]);
    nan = nan || std::isnan(v);
    best = std::max(best, v);
  }
  for (int64_t j = 0; j < n; ++j) {
    const float v = S::load(x[j]);
    if (nan ? std::isnan(v) : v == best) return j;
  }
  return 0;
}

struct Rows {  // a 2-D [tokens, n] or 3-D [tokens, heads, n] view with a contiguous last dim
  int64_t tokens, heads, n, token_stride, head_stride;
};

Rows rows_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, name, " must be 2-D [tokens, n] or 3-D [tokens, heads, n]");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
  const bool three = t.dim() == 3;
  return {t.size(0), three ? t.size(1) : 1, t.size(-1), t.stride(0), three ? t.stride(1) : 0};
}

template <typename S>
typename S::T* ptr(const at::Tensor& t) { return reinterpret_cast<typename S::T*>(t.data_ptr()); }

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous, of x's last size and dtype");
}

template <typename Fn>
void dispatch(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(Float32{});
  } else if (dtype == at::kBFloat16) {
    fn(BFloat16{});
  } else {
    TORCH_CHECK(false, "fused_ops supports float32 and bfloat16, got ", dtype);
  }
}

// out = norm(x) row by row; x and out 2-D or 3-D views with a contiguous last dim; out may alias x.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  const Rows xr = rows_of(x, "x"), orow = rows_of(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must match x");
  check_weight(weight, x);
  dispatch(x.scalar_type(), [&](auto s) {
    using S = decltype(s);
    auto* xp = ptr<S>(x);
    auto* op = ptr<S>(out);
    const auto* wp = ptr<S>(weight);
    at::parallel_for(0, xr.tokens, grain_rows(xr.heads * xr.n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < xr.heads; ++h)
          norm_row<S>(op + t * orow.token_stride + h * orow.head_stride, xp + t * xr.token_stride + h * xr.head_stride,
                      wp, xr.n, static_cast<float>(eps), static_cast<float>(offset));
    });
  });
}

// residual += x; x = norm(residual), both in place (contiguous [tokens, n]).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && residual.is_contiguous(),
              "x and residual must be contiguous 2-D CPU tensors");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  check_weight(weight, x);
  const int64_t tokens = x.size(0), n = x.size(1);
  dispatch(x.scalar_type(), [&](auto s) {
    using S = decltype(s);
    auto* xp = ptr<S>(x);
    auto* rp = ptr<S>(residual);
    const auto* wp = ptr<S>(weight);
    at::parallel_for(0, tokens, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        add_row<S>(rp + t * n, xp + t * n, n);
        norm_row<S>(xp + t * n, rp + t * n, wp, n, static_cast<float>(eps), static_cast<float>(offset));
      }
    });
  });
}

// q [T, Hq, d] and k [T, Hk, d] rotated in place by rows positions[t] of cos and sin [P, d / 2].
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [tokens, heads, head_dim]");
  const Rows qr = rows_of(q, "q"), kr = rows_of(k, "k");
  TORCH_CHECK(qr.tokens == kr.tokens && qr.n == kr.n && positions.numel() == qr.tokens, "q, k, positions mismatch");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.device().is_cpu(),
              "positions must be a contiguous int64 CPU tensor");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(1) * 2 == qr.n, "cos and sin must be contiguous [positions, head_dim / 2]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(), "q, k, cos and sin must share a dtype");
  const int64_t half = qr.n / 2, max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < qr.tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  dispatch(q.scalar_type(), [&](auto s) {
    using S = decltype(s);
    auto* qp = ptr<S>(q);
    auto* kp = ptr<S>(k);
    const auto* cp = ptr<S>(cos);
    const auto* sp = ptr<S>(sin);
    at::parallel_for(0, qr.tokens, grain_rows((qr.heads + kr.heads) * qr.n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto* c = cp + pos[t] * half;
        const auto* sn = sp + pos[t] * half;
        for (int64_t h = 0; h < qr.heads; ++h) {
          auto* head = qp + t * qr.token_stride + h * qr.head_stride;
          rotate_head<S>(head, head + half, c, sn, half);
        }
        for (int64_t h = 0; h < kr.heads; ++h) {
          auto* head = kp + t * kr.token_stride + h * kr.head_stride;
          rotate_head<S>(head, head + half, c, sn, half);
        }
      }
    });
  });
}

// out [T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I] (the packed gate/up projection); float32 or bfloat16
// rows with a contiguous last dim.
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && x.scalar_type() == out.scalar_type(),
              "silu_and_mul takes CPU tensors of one dtype");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "x and out must be 2-D rows");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1),
              "x must be [T, 2I] and out [T, I]");
  const int64_t tokens = x.size(0), inter = out.size(1);
  dispatch(x.scalar_type(), [&](auto s) {
    using S = decltype(s);
    const auto* xp = ptr<S>(x);
    auto* op = ptr<S>(out);
    // ~2 cycles a value (the exp): a finer grain than the memory-bound ops' (SmolLM2's MLP at T=64, bfloat16: 67 us
    // on one thread of the Xeon, where torch's two ops, split over both, took 49)
    const int64_t grain = std::max<int64_t>(1, kSiluGrainElements / x.size(1));
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto* row = xp + t * x.stride(0);
        silu_mul_row<S>(op + t * out.stride(0), row, row + inter, inter);
      }
    });
  });
}

// out[t] = argmax(x[t]) for float32 or bfloat16 x [T, V] (rows contiguous in their last dim) into int64 out [T].
void argmax_rows(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 or bfloat16 CPU tensor [T, V] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0, "argmax of an empty row");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == x.size(0) &&
                  out.is_contiguous(), "out must be a contiguous int64 CPU tensor [T]");
  const int64_t n = x.size(1);
  int64_t* op = out.data_ptr<int64_t>();
  dispatch(x.scalar_type(), [&](auto s) {
    using S = decltype(s);
    const auto* xp = ptr<S>(x);
    at::parallel_for(0, x.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) op[t] = argmax_row<S>(xp + t * x.stride(0), n);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * (offset + w); out may alias x");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual), in place");
  m.def("rotary_embedding", &rotary_embedding, "neox RoPE on q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up over x = [gate | up] (float32 or bfloat16)");
  m.def("argmax_rows", &argmax_rows, "out[t] = argmax(x[t]) (float32 or bfloat16; first maximum, NaN counts as the maximum)");
}
