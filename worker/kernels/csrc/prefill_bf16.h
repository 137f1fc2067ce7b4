// Prefill attention for a bfloat16 cache on a CPU with AVX-512 BF16: a tile of queries of one sequence against
// its keys in the block-paged cache, for one KV head and every query head of its GQA group (flash attention's
// loop, on vdpbf16ps).
//
// Why: a prefill chunk took torch's SDPA (its CPU flash kernel) or the paged kernel's per-row walk, and both run
// far below the cores' bfloat16 rate at a prompt's sizes. A wave of 16 fresh 128-token prompts through one layer
// of the tiny model's heads (8 / 4, d 64), two threads of a 2-core AMD EPYC (Zen 4), 6 Dec 2026: SDPA 5.0-7.2 ms,
// the paged kernel's rows 11.7 ms (figures with this path in paged_attention.cpp's header).
//
// Layout: the tile's keys are packed once per KV head into a thread's scratch, 16 keys a group as pairs of dims
// (`Kp[group][pair][16 keys]`, 32 bits a lane: dims 2p and 2p + 1 of one key; the 16 x 16 transposes of
// bf16_rows.h), and its values as pairs of keys (`Vp[key pair][dim]`, 32 bits: keys 2j and 2j + 1 of one dim).
// Then `kRowsFor(d)` query rows at a time (positions of one head) walk the keys 32 at a time: scores
// S = q . k for 2 x 16 keys (a 4-byte broadcast of the query's dim pair against a key group's pair vector), the
// mask (causal, and the window), the online softmax on those lanes in fp32 (exp_avx512), the probabilities
// rounded to bfloat16 pairs, and O += P . V (a 4-byte broadcast of a row's key pair against the value pairs),
// with every row's d accumulators in registers for the whole walk. Scores and outputs never leave registers but
// for the 64 bytes of each row's probabilities.
//
// Rules: head dims a multiple of 32 whose accumulators fit the registers (`serves`: 32, 64, 96, 128, 256); no
// softcap (the caller's own path serves it); keys [lo, pos] for the query at pos, lo = pos - window + 1 with a
// window, else 0. The probabilities are rounded to bfloat16 before they meet the values (as a bfloat16 GEMM of
// softmax(S) by V would), the scores and sums stay fp32: results within bfloat16 rounding of a float32 reference.

#pragma once

#include "bf16_rows.h"

#if defined(REDSERVE_BF16_ROWS) && defined(__AVX512F__)
#define REDSERVE_PREFILL_BF16 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "simd_exp.h"

namespace redserve_prefill {

// One tile: queries [0, count) of a sequence at positions first_pos + i, their heads kv_head * group + h.
struct Tile {
  const uint16_t* q;  // query i, head hq at q + i * q_row + hq * q_head
  int64_t q_row, q_head;
  uint16_t* out;
  int64_t out_row, out_head;
  const uint16_t* k;  // the caches: key position pos of this KV head at slot(pos) * kv_slot + kv_head * kv_stride
  const uint16_t* v;
  int64_t kv_slot, kv_stride;
  const int32_t* table;  // the sequence's block table
  int64_t block_size, first_pos, count, kv_head, group, dim, window;
  float scale;
};

// Head dims served: a multiple of 32 (a key group's pairs are 16 x 16 transposes), 16-lane accumulators that fit.
inline bool serves(int64_t dim) { return dim == 32 || dim == 64 || dim == 96 || dim == 128 || dim == 256; }

// Query rows a pass: NR x (d / 16) accumulators, plus the d / 16 value vectors of a key pair, within 32 registers.
template <int DV>
constexpr int kRowsFor = DV <= 4 ? 4 : DV <= 8 ? 2 : 1;

constexpr int64_t kKeys = 32;  // keys a step of the walk: two groups of 16 lanes

// A thread's packed keys and values (64-byte aligned); grows, never shrinks.
struct Packed {
  uint32_t* keys = nullptr;
  uint32_t* values = nullptr;
  size_t size = 0;
  void reserve(size_t n) {
    if (n <= size) return;
    std::free(keys), std::free(values);
    size = (n + 15) / 16 * 16;
    keys = static_cast<uint32_t*>(std::aligned_alloc(64, size * sizeof(uint32_t)));
    values = static_cast<uint32_t*>(std::aligned_alloc(64, size * sizeof(uint32_t)));
    TORCH_CHECK(keys && values, "out of memory packing a prefill tile's keys");
  }
  ~Packed() { std::free(keys), std::free(values); }
};

inline int64_t slot_of(const Tile& t, int64_t pos) {
  return static_cast<int64_t>(t.table[pos / t.block_size]) * t.block_size + pos % t.block_size;
}

// Keys [base, base + blocks * 32) into Kp and Vp; positions outside [lo, hi) are zeros.
inline void pack(const Tile& t, int64_t base, int64_t blocks, int64_t lo, int64_t hi, uint32_t* kp, uint32_t* vp) {
  const int64_t d = t.dim, pairs = d / 2;
  const __m512i zero = _mm512_setzero_si512();
  // interleave the 16-bit lanes of two rows: lanes 0..15 of a with those of b (lo), then 16..31 (hi)
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(kLo), ihi = _mm512_load_si512(kHi);
  const uint16_t* krow[16];
  const uint16_t* vrow[16];
  for (int64_t g = 0; g < 2 * blocks; ++g) {
    for (int i = 0; i < 16; ++i) {
      const int64_t pos = base + g * 16 + i;
      const bool live = pos >= lo && pos < hi;
      const int64_t at = live ? slot_of(t, pos) * t.kv_slot + t.kv_head * t.kv_stride : 0;
      krow[i] = live ? t.k + at : nullptr;
      vrow[i] = live ? t.v + at : nullptr;
    }
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {  // keys: 16 keys x 16 dim pairs, transposed
      __m512 in[16], tr[16];
      for (int i = 0; i < 16; ++i)
        in[i] = krow[i] ? _mm512_castsi512_ps(_mm512_loadu_si512(krow[i] + 2 * p0)) : _mm512_setzero_ps();
      redserve_bf16::transpose16(in, tr);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(reinterpret_cast<float*>(kp + (g * pairs + p0 + j) * 16), tr[j]);
    }
    for (int i = 0; i < 16; i += 2) {  // values: key pairs (g * 16 + i, + 1), every dim
      uint32_t* dst = vp + (g * 8 + i / 2) * d;
      for (int64_t e = 0; e < d; e += 32) {
        const __m512i a = vrow[i] ? _mm512_loadu_si512(vrow[i] + e) : zero;
        const __m512i b = vrow[i + 1] ? _mm512_loadu_si512(vrow[i + 1] + e) : zero;
        _mm512_store_si512(dst + e, _mm512_permutex2var_epi16(a, ilo, b));
        _mm512_store_si512(dst + e + 16, _mm512_permutex2var_epi16(a, ihi, b));
      }
    }
  }
}

// Rows [i0, i0 + NR) (rows past count repeat the last and are not stored) of query head h against the packed keys.
template <int DV>
inline void attend_rows(const Tile& t, int64_t h, int64_t i0, int64_t base, const uint32_t* kp, const uint32_t* vp) {
  constexpr int NR = kRowsFor<DV>;
  const int64_t d = t.dim, pairs = d / 2, hq = t.kv_head * t.group + h;
  const int nr = static_cast<int>(std::min<int64_t>(NR, t.count - i0));
  const uint32_t* q[NR];
  int64_t pos[NR], lo[NR];
  for (int r = 0; r < NR; ++r) {
    const int64_t i = i0 + std::min(r, nr - 1);
    q[r] = reinterpret_cast<const uint32_t*>(t.q + i * t.q_row + hq * t.q_head);
    pos[r] = t.first_pos + i;
    lo[r] = t.window > 0 ? std::max<int64_t>(0, pos[r] - t.window + 1) : 0;
  }
  __m512 acc[NR][DV];
  float m[NR], l[NR];
  for (int r = 0; r < NR; ++r) {
    m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
    for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  alignas(64) uint32_t prob[NR][16];
  const __m512 scale = _mm512_set1_ps(t.scale), neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t first = (lo[0] - base) / kKeys, last = (pos[NR - 1] - base) / kKeys;
  for (int64_t kb = first; kb <= last; ++kb) {
    __m512 s[NR][2];
    for (int r = 0; r < NR; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    const uint32_t* k0 = kp + (2 * kb) * pairs * 16;
    const uint32_t* k1 = k0 + pairs * 16;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_load_si512(k0 + p * 16));
      const __m512bh b = reinterpret_cast<__m512bh>(_mm512_load_si512(k1 + p * 16));
      for (int r = 0; r < NR; ++r) {
        const __m512bh qb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(q[r][p])));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], a, qb);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], b, qb);
      }
    }
    const __m512i key0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base + kb * kKeys)), lanes);
    const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
    for (int r = 0; r < NR; ++r) {
      const __m512i top = _mm512_set1_epi32(static_cast<int>(pos[r])), bottom = _mm512_set1_epi32(static_cast<int>(lo[r]));
      const __mmask16 live0 = _mm512_cmple_epi32_mask(key0, top) & _mm512_cmpge_epi32_mask(key0, bottom);
      const __mmask16 live1 = _mm512_cmple_epi32_mask(key1, top) & _mm512_cmpge_epi32_mask(key1, bottom);
      const __m512 s0 = _mm512_mul_ps(s[r][0], scale), s1 = _mm512_mul_ps(s[r][1], scale);
      const float top_score = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_mask_blend_ps(live0, neg_inf, s0), _mm512_mask_blend_ps(live1, neg_inf, s1)));
      const float m_new = std::max(m[r], top_score);
      if (m_new == -std::numeric_limits<float>::infinity()) {  // no live key yet: nothing to add
        std::fill_n(prob[r], 16, 0u);
        continue;
      }
      const float correction = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[r] - m_new);
      const __m512 shift = _mm512_set1_ps(m_new);
      const __m512 p0 = _mm512_maskz_mov_ps(live0, redserve_simd::exp_avx512(_mm512_sub_ps(s0, shift)));
      const __m512 p1 = _mm512_maskz_mov_ps(live1, redserve_simd::exp_avx512(_mm512_sub_ps(s1, shift)));
      l[r] = l[r] * correction + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = m_new;
      if (correction != 1.f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], c);
      }
      _mm512_store_si512(prob[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
    }
    const uint32_t* vb = vp + kb * (kKeys / 2) * d;
    for (int64_t j = 0; j < kKeys / 2; ++j) {
      __m512bh vv[DV];
      for (int v = 0; v < DV; ++v) vv[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(vb + j * d + v * 16));
      for (int r = 0; r < NR; ++r) {
        const __m512bh pb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(prob[r][j])));
        for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], vv[v], pb);
      }
    }
  }
  for (int r = 0; r < nr; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    uint16_t* dst = t.out + (i0 + r) * t.out_row + hq * t.out_head;
    for (int v = 0; v < DV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + v * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][v], inv))));
  }
}

template <int DV>
void attend_tile(const Tile& t, Packed& scratch) {
  const int64_t last_pos = t.first_pos + t.count - 1;
  const int64_t lo = t.window > 0 ? std::max<int64_t>(0, t.first_pos - t.window + 1) : 0;
  const int64_t base = lo / kKeys * kKeys, blocks = (last_pos - base) / kKeys + 1;
  scratch.reserve(static_cast<size_t>(blocks * kKeys * t.dim / 2));
  pack(t, base, blocks, lo, last_pos + 1, scratch.keys, scratch.values);
  for (int64_t h = 0; h < t.group; ++h)
    for (int64_t i0 = 0; i0 < t.count; i0 += kRowsFor<DV>) attend_rows<DV>(t, h, i0, base, scratch.keys, scratch.values);
}

// The tile's attention into out; the caller checked `serves(t.dim)`.
inline void attend(const Tile& t) {
  thread_local Packed scratch;
  switch (t.dim / 16) {
    case 2: return attend_tile<2>(t, scratch);
    case 4: return attend_tile<4>(t, scratch);
    case 6: return attend_tile<6>(t, scratch);
    case 8: return attend_tile<8>(t, scratch);
    default: return attend_tile<16>(t, scratch);
  }
}

}  // namespace redserve_prefill

#endif
