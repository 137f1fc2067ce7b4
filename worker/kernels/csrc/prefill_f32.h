// Prefill attention for a float32 cache with AVX2 and FMA: prefill_bf16.h's tile (several queries of one sequence,
// one KV head, every query head of its GQA group) on 8-lane FMAs, for the CPUs where float32 is the dtype served
// (AVX2 without native bfloat16).
//
// Layout: the tile's keys are packed once per KV head into a thread's scratch as groups of 8 keys, dim-major
// (`Kp[group][dim][8 keys]`, 8 x 8 transposes); values are read in place from the cache, one row per key. Then
// 4 query rows at a time walk the keys 16 at a time: scores for 2 x 8 keys (a broadcast of the query's dim
// against a key group's dim vector), the mask (causal, and the window), the online softmax on those lanes
// (exp_avx2), and O += P . V, 16 dims at a time: 4 rows x 2 vectors of accumulators loaded from the rows' output
// buffer with the rescale folded into the load, 16 keys of (2 value loads, 4 broadcasts, 8 FMAs), stored back.
//
// Rules: head dims a multiple of 16 (`serves_f32`); no softcap; keys [lo, pos] as in prefill_bf16.h. Scores, sums
// and outputs in float32 throughout: within float rounding of a float64 reference.

#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define REDSERVE_PREFILL_F32 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <vector>

#include "simd_exp.h"

namespace redserve_prefill_f32 {

// One tile: queries [0, count) of a sequence at positions first_pos + i, their heads kv_head * group + h.
struct Tile {
  const float* q;  // query i, head hq at q + i * q_row + hq * q_head
  int64_t q_row, q_head;
  float* out;
  int64_t out_row, out_head;
  const float* k;  // key position pos of this KV head at slot(pos) * kv_slot + kv_head * kv_stride
  const float* v;
  int64_t kv_slot, kv_stride;
  const int32_t* table;
  int64_t block_size, first_pos, count, kv_head, group, dim, window;
  float scale;
};

inline bool serves_f32(int64_t dim) { return dim % 16 == 0 && dim <= 512; }

constexpr int kRows = 4;       // query rows a pass
constexpr int64_t kKeys = 16;  // keys a step: two groups of 8 lanes

// A thread's packed keys, its value row pointers and its rows' outputs (64-byte aligned); grows, never shrinks.
struct Scratch {
  float* keys = nullptr;
  size_t key_floats = 0;
  const float** values = nullptr;
  size_t value_rows = 0;
  float* acc = nullptr;
  size_t acc_floats = 0;
  template <typename P>
  static void grow(P*& p, size_t& have, size_t need) {
    if (need <= have) return;
    std::free(p);
    have = (need + 15) / 16 * 16;
    p = static_cast<P*>(std::aligned_alloc(64, have * sizeof(P)));
    if (!p) throw std::bad_alloc();
  }
  ~Scratch() { std::free(keys), std::free(values), std::free(acc); }
};

inline int64_t slot_of(const Tile& t, int64_t pos) {
  return static_cast<int64_t>(t.table[pos / t.block_size]) * t.block_size + pos % t.block_size;
}

// 8 rows of 8 floats transposed in registers.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Keys [base, base + steps * 16) into Kp, dim-major per group of 8, and their value rows; positions outside [lo, hi)
// are zero keys and a row of zeros.
inline void pack(const Tile& t, int64_t base, int64_t steps, int64_t lo, int64_t hi, float* kp, const float** vrows,
                 const float* zeros) {
  const int64_t d = t.dim;
  for (int64_t g = 0; g < 2 * steps; ++g) {
    const float* rows[8];
    for (int i = 0; i < 8; ++i) {
      const int64_t pos = base + g * 8 + i;
      const bool live = pos >= lo && pos < hi;
      const int64_t at = live ? slot_of(t, pos) * t.kv_slot + t.kv_head * t.kv_stride : 0;
      rows[i] = live ? t.k + at : zeros;
      vrows[g * 8 + i] = live ? t.v + at : zeros;
    }
    for (int64_t e = 0; e < d; e += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + e);
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_store_ps(kp + (g * d + e + j) * 8, r[j]);
    }
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One row group's state through the walk: rows [i0, i0 + 4) of query head h (rows past count repeat the last and are
// not stored), their running maxima and sums, and their accumulators (4 x d floats) in the thread's scratch.
struct Rows {
  const float* q[kRows];
  int64_t pos[kRows], lo[kRows];
  float* m;
  float* l;
  float* acc;
  int64_t i0, hq;
  int nr;
};

inline Rows rows_of(const Tile& t, int64_t h, int64_t i0, float* state) {
  Rows g;
  g.i0 = i0, g.hq = t.kv_head * t.group + h;
  g.nr = static_cast<int>(std::min<int64_t>(kRows, t.count - i0));
  g.m = state, g.l = state + kRows, g.acc = state + 2 * kRows;
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = i0 + std::min(r, g.nr - 1);
    g.q[r] = t.q + i * t.q_row + g.hq * t.q_head;
    g.pos[r] = t.first_pos + i;
    g.lo[r] = t.window > 0 ? std::max<int64_t>(0, g.pos[r] - t.window + 1) : 0;
    g.m[r] = -std::numeric_limits<float>::infinity(), g.l[r] = 0.f;
  }
  std::fill_n(g.acc, kRows * t.dim, 0.f);
  return g;
}

// Step kb of the walk (keys base + 16 kb ..) for one row group.
inline void attend_step(const Tile& t, Rows& g, int64_t kb, int64_t base, const float* kp, const float* const* vrows) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t d = t.dim;
  float correction[kRows];
  alignas(32) float prob[kRows][kKeys];
  __m256 s[kRows][2];
  for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
  const float* k0 = kp + 2 * kb * d * 8;
  const float* k1 = k0 + d * 8;
  for (int64_t e = 0; e < d; ++e) {
    const __m256 a = _mm256_load_ps(k0 + e * 8), b = _mm256_load_ps(k1 + e * 8);
    for (int r = 0; r < kRows; ++r) {
      const __m256 qe = _mm256_broadcast_ss(g.q[r] + e);
      s[r][0] = _mm256_fmadd_ps(a, qe, s[r][0]);
      s[r][1] = _mm256_fmadd_ps(b, qe, s[r][1]);
    }
  }
  const __m256 scale = _mm256_set1_ps(t.scale), neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i key0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base + kb * kKeys)),
                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i key1 = _mm256_add_epi32(key0, _mm256_set1_epi32(8));
  for (int r = 0; r < kRows; ++r) {
    const __m256i top = _mm256_set1_epi32(static_cast<int>(g.pos[r]) + 1);
    const __m256i bottom = _mm256_set1_epi32(static_cast<int>(g.lo[r]) - 1);
    // live: bottom < key < top, as all-ones lanes
    const __m256 live0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(top, key0), _mm256_cmpgt_epi32(key0, bottom)));
    const __m256 live1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(top, key1), _mm256_cmpgt_epi32(key1, bottom)));
    const __m256 s0 = _mm256_mul_ps(s[r][0], scale), s1 = _mm256_mul_ps(s[r][1], scale);
    const float top_score = hmax(_mm256_max_ps(_mm256_blendv_ps(neg_inf, s0, live0), _mm256_blendv_ps(neg_inf, s1, live1)));
    const float m_new = std::max(g.m[r], top_score);
    if (m_new == kNegInf) {  // no live key yet: nothing to add
      correction[r] = 1.f;
      std::fill_n(prob[r], kKeys, 0.f);
      continue;
    }
    correction[r] = g.m[r] == kNegInf ? 0.f : std::exp(g.m[r] - m_new);
    const __m256 shift = _mm256_set1_ps(m_new);
    const __m256 p0 = _mm256_and_ps(live0, redserve_simd::exp_avx2(_mm256_sub_ps(s0, shift)));
    const __m256 p1 = _mm256_and_ps(live1, redserve_simd::exp_avx2(_mm256_sub_ps(s1, shift)));
    g.l[r] = g.l[r] * correction[r] + hsum(_mm256_add_ps(p0, p1));
    g.m[r] = m_new;
    _mm256_store_ps(prob[r], p0);
    _mm256_store_ps(prob[r] + 8, p1);
  }
  const float* const* vr = vrows + kb * kKeys;
  float* acc = g.acc;
  for (int64_t e = 0; e < d; e += 16) {
    __m256 o[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      const __m256 c = _mm256_set1_ps(correction[r]);
      o[r][0] = _mm256_mul_ps(_mm256_load_ps(acc + r * d + e), c);
      o[r][1] = _mm256_mul_ps(_mm256_load_ps(acc + r * d + e + 8), c);
    }
    for (int64_t j = 0; j < kKeys; ++j) {
      const __m256 va = _mm256_loadu_ps(vr[j] + e), vb = _mm256_loadu_ps(vr[j] + e + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 p = _mm256_broadcast_ss(prob[r] + j);
        o[r][0] = _mm256_fmadd_ps(va, p, o[r][0]);
        o[r][1] = _mm256_fmadd_ps(vb, p, o[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_store_ps(acc + r * d + e, o[r][0]);
      _mm256_store_ps(acc + r * d + e + 8, o[r][1]);
    }
  }
}

inline void finish_rows(const Tile& t, const Rows& g) {
  for (int r = 0; r < g.nr; ++r) {
    const __m256 inv = _mm256_set1_ps(1.f / g.l[r]);
    float* dst = t.out + (g.i0 + r) * t.out_row + g.hq * t.out_head;
    for (int64_t e = 0; e < t.dim; e += 8) _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_load_ps(g.acc + r * t.dim + e), inv));
  }
}

// The tile's attention into out; the caller checked `serves_f32(t.dim)`. The walk goes over the keys once, every row
// group of the tile taking each step in turn (a step's 16 keys and values stay in L1 across the groups; a group at
// a time streamed a long context's packed keys and values through L2 once per group: 2048 tokens, 1.5x slower than
// SDPA that way).
inline void attend(const Tile& t) {
  thread_local Scratch scratch;
  thread_local std::vector<Rows> rows;  // the tile's row groups (reused: no allocation a tile)
  const int64_t last_pos = t.first_pos + t.count - 1;
  const int64_t lo = t.window > 0 ? std::max<int64_t>(0, t.first_pos - t.window + 1) : 0;
  const int64_t base = lo / kKeys * kKeys, steps = (last_pos - base) / kKeys + 1;
  const int64_t groups = t.group * ((t.count + kRows - 1) / kRows), state = 2 * kRows + kRows * t.dim;
  Scratch::grow(scratch.keys, scratch.key_floats, static_cast<size_t>(steps * kKeys * t.dim + t.dim));
  Scratch::grow(scratch.values, scratch.value_rows, static_cast<size_t>(steps * kKeys));
  Scratch::grow(scratch.acc, scratch.acc_floats, static_cast<size_t>(groups * state));
  float* zeros = scratch.keys + steps * kKeys * t.dim;  // one row of zeros past the packed keys
  std::fill_n(zeros, t.dim, 0.f);
  pack(t, base, steps, lo, last_pos + 1, scratch.keys, scratch.values, zeros);
  rows.clear();
  for (int64_t h = 0; h < t.group; ++h)
    for (int64_t i0 = 0; i0 < t.count; i0 += kRows)
      rows.push_back(rows_of(t, h, i0, scratch.acc + static_cast<int64_t>(rows.size()) * state));
  for (int64_t kb = 0; kb < steps; ++kb) {
    for (Rows& g : rows) {
      if ((g.lo[0] - base) / kKeys <= kb && kb <= (g.pos[kRows - 1] - base) / kKeys) attend_step(t, g, kb, base, scratch.keys, scratch.values);
    }
  }
  for (const Rows& g : rows) finish_rows(t, g);
}

}  // namespace redserve_prefill_f32

#endif
