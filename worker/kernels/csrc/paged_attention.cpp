// Paged attention on the CPU, straight from the block-paged KV cache (no gather copy).
//
// One call serves any mix of sequences: decodes (one query) and prefill chunks whose earlier tokens
// sit in the cache. Sequence s owns query rows [query_start[s], query_start[s] + query_lens[s]) of q,
// has context_lens[s] keys in the cache (its own new tokens included, already written), and its
// query i sits at position context_lens[s] - query_lens[s] + i. A task is (sequence, tile of up to
// kQueryTile queries, KV heads): it walks the sequence's blocks once, scores every query head of each
// GQA group against each key of its KV head, and keeps an online softmax in fp32, so each cached K/V
// row is read once per task. Rules: causal; a window W keeps keys at k > q - W; softcap c maps s to c * tanh(s / c).
//
// Decode tasks (one query) take a path of their own (run_decode_task): every row sees the same keys. In
// float32 or bfloat16 (widened to float32 as it is read) with a head dim a multiple of 8 (AVX2), each query row scores eight keys of its KV head per pass
// (eight FMA chains, one lane sum) and keeps 64 dims of its output in registers while the block's values
// stream past; the block stays in L1 across the rows of a GQA group. Measured on a 2-core AVX2 EPYC, fp32,
// tiny-model heads, one layer (benchmarks/bench_paged_attention.py, two interleaved runs): batch 64 x 128
// context 1.38 / 1.30 -> 0.92 / 0.79 ms, batch 16 x 128 0.28 / 0.24 -> 0.15 / 0.13 ms, batch 64 x 512 a wash
// (6.4-7.0 ms, bound by reading the cache from memory). bfloat16 takes the same path since 4 Dec 2026: on a
// 2-core AMD EPYC with avx512_bf16, one layer, one thread's CPU time (bench_paged_attention.py --dtypes
// bfloat16 --threads 1 --cpu-time, two alternating runs each, a shared machine): batch 16 x 128 context
// 0.41 / 0.45 -> 0.15 / 0.20 ms, 16 x 512 1.82 / 1.55 -> 1.14 / 0.69 ms, batch 1 x 512 0.12 / 0.08 -> 0.04 /
// 0.07 ms, batch 64 x 512 a wash (7-9 ms). Where a KV head serves 2 to 4 query heads, the group's rows are scored
// and accumulated together (score_keys_group, accumulate_values_group): each key and value row is loaded and
// widened once for the group (bf16, SmolLM2's 9 / 3 heads, one thread's CPU time: batch 16 x 128 0.151 -> 0.122
// ms, 16 x 512 0.61 -> 0.47, 64 x 128 0.61 -> 0.47; float32 with the tiny model's group of 2 unchanged). Other dtypes walk each block slot by slot over all
// the task's KV heads (one contiguous run of memory per slot). Both
// paths prefetch the next block's K/V rows (blocks sit anywhere in the cache) and take exp eight lanes at a
// time on AVX2 (Cephes' expf polynomial, within 2 ulp of std::exp). Measured on a 2-core AVX2 EPYC, one
// thread, fp32, tiny-model heads (benchmarks/bench_paged_attention.py --threads 1 --cpu-time): decode at
// batch 64 1.3-1.5x faster than the per-row walk with scalar exp, batch 1 unchanged.
//
// A bfloat16 cache on a CPU with AVX512-BF16 (head dim a multiple of 32, up to 16 query heads per KV head) takes a
// decode path of its own (run_decode_task_bf16): query and key rows meet in vdpbf16ps without widening, 16 keys'
// sums come out of one transpose-and-add tree, the online softmax runs on those 16 lanes in a register (each row's
// rescale folded into the next load of its accumulators) and values widen 16 lanes at a time. Measured on a 2-core
// Xeon with AMX (benchmarks/ab_paged_attention.py: a decode step over 30 or 8 layers' caches, interleaved A/B):
// SmolLM2's heads (9 / 3, d 64) batch 64 x 200 context 27.6-30.2 -> 25.6-28.6 ms for 30 layers (caches from DRAM,
// about 11 GB/s, where the step is bound), 12-17% faster with the caches in L2/L3; the tiny model's (8 / 4) 7.5 ->
// 6.6 ms for 8 layers; batch 1 x 300 1.07 -> 0.97 ms.
//
// Prefill tiles (several queries) of a float32 cache with AVX2 take prefill_f32.h's path (8-lane FMAs; faster than
// SDPA up to 512 tokens a chunk, see worker/layers/attention.py), and of a bfloat16 cache on a CPU with AVX512-BF16
// prefill_bf16.h's (flash attention on vdpbf16ps), one KV head at a time (`run_prefill_task_native`): one layer, two threads, 2-core AMD EPYC
// (Zen 4), 6 Dec 2026, against torch's SDPA on the same chunks (what served them before) and the per-row walk
// (run_task): 16 fresh chunks x 128 tokens, 8 / 4 heads, d 64: 1.55 ms, SDPA 5.1, run_task 11.7; SmolLM2's 9 / 3
// heads 1.72 ms, SDPA 5.7; 2 x 512, 32 / 8 heads, d 128: 20.3 ms, SDPA 54.8; 1 x 2048, 8 / 4, d 64: 19.3 ms, SDPA 34.7.
//
// Threads take tasks one at a time from a shared counter, the longest first (context x queries x heads), instead
// of a fixed half each: the same A/B, 2.5-3.6% faster at batch 64 with contexts alike or spread over 100-300.
//
// Prefetching, bf16 decode path: the next block's rows of a KV head are fetched a key row at a time inside the value
// loop of this block (two lines of K and two of V per row at d 64), not as one burst of 64 prefetches after the
// head's pass: a burst fills the line fill buffers and the loads of this block wait behind it. And each thread claims
// its next task before it runs this one, and fetches that task's first block into L2 (no block before it to hide
// it behind). benchmarks/ab_paged_attention.py, 2-core Xeon with AMX, SmolLM2's heads, batch 64 x 192 context
// spread, caches from DRAM: 23.3-25.1 -> 19.5-20.7 ms a step of 30 layers (12.6 -> 14.5 GB/s; 15-17%, the two
// parts 6-8% and 3%), one thread 44.2 -> 40.5 ms, caches in L2/L3 11.8 -> 11.2 ms, batch 1 x 300 0.60 -> 0.57 ms;
// the float32 path (tiny model's heads) unchanged. Two blocks ahead, or a second one into L2, was 1-3.5% slower or level.
// Since 6 Dec 2026 both decode paths also fetch the block after next into L2 (prefetcht1), a KV head at a time as
// each head's pass over this block starts, and a thread's next task brings its first two blocks into L2, not one:
// the L1 fetch of the next block alone is bounded by the core's few L1 miss buffers (~7 GB/s a thread), the L2
// fetch runs ahead of it. benchmarks/ab_paged_attention.py, 2-core AMD EPYC (Zen 4), caches from DRAM, medians of
// 15 interleaved rounds: tiny model's heads (8 / 4, 8 layers) batch 64 x 192 spread, bf16, 8.6-11.7 -> 6.5-7.8 ms
// (0.67-0.76x; one thread 0.67x), float32 17.9 -> 13.7 ms; SmolLM2's (9 / 3, 30 layers) batch 64 x 200 spread,
// bf16 26.9 -> 20.7 ms, float32 57.3 -> 42.2 ms; batch 16 x 512 0.73x; batch 1 x 300 0.96x; caches in L2/L3
// (--hot) level. Fetching the whole block after next at once was 9-11% slower than a head at a time; three
// blocks ahead 2-7% slower than two; dropping the L1 fetch of the next block 16-22% slower.
//
// Small decode batches (fewer tiles than 4 a thread, e.g. one stream) split a decode by keys instead of by heads
// (make_tasks): pieces of whole blocks over all KV heads, each keeping its rows' running max, sum and unnormalised
// accumulators in a partial that merge_splits folds into out after the pass. At SmolLM2's batch 1 one head a task
// gave 3 tasks to 2 threads and walked each block in 128-byte pieces of 384-byte rows. And a thread's scratch is
// a thread-local buffer that only grows, not vectors allocated and zeroed every call. Measured in place (the
// offline engine, SmolLM2 Q8_0, bfloat16, batch 1, 300 steps from a 192-token prompt, the 30 calls of each step
// timed, three runs of 100 steps as the context grows; 2-core AMD EPYC, Zen 4, 6 Dec 2026): 0.84 / 1.16 / 1.42 ms
// a step -> 0.66 / 0.96 / 1.12 with the scratch alone -> 0.65 / 0.80 / 0.98 with both. A call at a context of one
// block (benchmarks/ab_paged_attention.py --batch 1 --context 16 --hot): 4.7 -> 3.7 us. Batches of 4 tiles a
// thread or more (a served c=64) take neither the split nor any other change.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "prefill_bf16.h"
#include "prefill_f32.h"
#include "simd_exp.h"

namespace {

constexpr int64_t kQueryTile = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Loads as fp32. bfloat16 is read as its raw bits: GCC vectorizes the shift, not c10::BFloat16's struct.
inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(uint16_t bf16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline const float* storage(const float* p) { return p; }
inline const double* storage(const double* p) { return p; }
inline const c10::Half* storage(const c10::Half* p) { return p; }
inline const uint16_t* storage(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }

// Scores of one query row against keys [jlo, jhi) of a block, four keys per pass over the head dim
// (one query load feeds four independent FMA chains).
template <typename T>
inline void score_keys(const float* q, const T* k, int64_t key_stride, int64_t jlo, int64_t jhi, int64_t d,
                       float* scores) {
  int64_t j = jlo;
  for (; j + 4 <= jhi; j += 4) {
    const T *k0 = k + j * key_stride, *k1 = k0 + key_stride, *k2 = k1 + key_stride, *k3 = k2 + key_stride;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t e = 0; e < d; ++e) {
      const float qe = q[e];
      s0 += qe * to_float(k0[e]);
      s1 += qe * to_float(k1[e]);
      s2 += qe * to_float(k2[e]);
      s3 += qe * to_float(k3[e]);
    }
    scores[j] = s0, scores[j + 1] = s1, scores[j + 2] = s2, scores[j + 3] = s3;
  }
  for (; j < jhi; ++j) {
    const T* kj = k + j * key_stride;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < d; ++e) s += q[e] * to_float(kj[e]);
    scores[j] = s;
  }
}

// acc[e] += sum_j p[j] * v[j][e] over keys [jlo, jhi): the accumulator stays in registers across keys.
// acc += p[j] * v[j] for keys [jlo, jhi): key-outer, so each value row streams through once.
template <typename T>
inline void accumulate_values(float* acc, const float* p, const T* v, int64_t value_stride, int64_t jlo,
                              int64_t jhi, int64_t d) {
  for (int64_t j = jlo; j < jhi; ++j) {
    const T* vj = v + j * value_stride;
    const float pj = p[j];
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) acc[e] += pj * to_float(vj[e]);
  }
}

// p[j] = exp(p[j] - shift) for j in [lo, hi); returns their sum. The arguments are <= 0 (shift is the
// running max), so exp's range reduction only meets underflow, which goes to 0 as std::exp does.
inline float exp_shifted_sum(float* p, int64_t lo, int64_t hi, float shift) {
  int64_t j = lo;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(shift);
  for (; j + 8 <= hi; j += 8) {
    const __m256 e = redserve_simd::exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; j < hi; ++j) {
    p[j] = std::exp(p[j] - shift);
    sum += p[j];
  }
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// out[i] = the sum of v[i]'s eight lanes, for eight vectors at once.
inline __m256 lane_sums(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Eight cache values as float32: float32 as they are, bfloat16 widened (a 16-bit shift of each lane).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Head dim a multiple of 8: scores[j] = q . k_j for keys [0, n) at key_stride, eight keys per pass (eight
// independent FMA chains, one lane sum for the eight). E: the cache's storage (float, or bf16 bits).
template <typename E>
inline void score_keys_simd(const float* q, const E* k, int64_t key_stride, int64_t n, int64_t d,
                            float* scores) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) {
      const __m256 qv = _mm256_loadu_ps(q + e);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(k + (j + i) * key_stride + e), acc[i]);
    }
    _mm256_storeu_ps(scores + j, lane_sums(acc));
  }
  for (; j < n; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(k + j * key_stride + e), acc);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float sum = 0.f;
    for (float lane : lanes) sum += lane;
    scores[j] = sum;
  }
}

// Head dim a multiple of 8: acc += sum_j p[j] * v_j over keys [0, n) at value_stride; 64 dims at a time
// stay in eight registers while the keys stream past.
template <typename E>
inline void accumulate_values_simd(float* acc, const float* p, const E* v, int64_t value_stride, int64_t n,
                                   int64_t d) {
  int64_t e0 = 0;
  for (; e0 + 64 <= d; e0 += 64) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + e0 + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const E* vj = v + j * value_stride + e0;
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pj, load8(vj + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + e0 + 8 * c, a[c]);
  }
  for (; e0 < d; e0 += 8) {
    __m256 a = _mm256_loadu_ps(acc + e0);
    for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v + j * value_stride + e0), a);
    _mm256_storeu_ps(acc + e0, a);
  }
}

// The sums of four vectors' eight lanes, as four floats.
inline __m128 lane_sums4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The G query rows of one GQA group (rows d apart) scored against keys [0, n) of their KV head (scores of row g
// at scores + g * score_stride): each key's eight dims are loaded, and widened, once for the G rows. Four keys a
// pass: 4 G accumulators, G queries and one key in registers (16 ymm at G = 3).
template <int G, typename E>
inline void score_keys_group(const float* q, int64_t d, const E* k, int64_t key_stride, int64_t n, float* scores,
                             int64_t score_stride) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) {
      __m256 qv[G];
      for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(q + g * d + e);
      for (int i = 0; i < 4; ++i) {
        const __m256 kv = load8(k + (j + i) * key_stride + e);
        for (int g = 0; g < G; ++g) acc[g][i] = _mm256_fmadd_ps(qv[g], kv, acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(scores + g * score_stride + j, lane_sums4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (; j < n; ++j) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) {
      const __m256 kv = load8(k + j * key_stride + e);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + e), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      const __m128 s4 = lane_sums4(acc[g], acc[g], acc[g], acc[g]);
      scores[g * score_stride + j] = _mm_cvtss_f32(s4);
    }
  }
}

// acc_g += sum_j p_g[j] * v_j for the G rows of one GQA group (accumulators d apart, probabilities
// p_stride apart) over keys [0, n): each value row is loaded, and widened, once for the G rows. 32 dims a pass:
// 4 G accumulators, G probabilities and one value in registers. Head dim a multiple of 32.
template <int G, typename E>
inline void accumulate_values_group(float* acc, int64_t d, const float* p, int64_t p_stride, const E* v,
                                    int64_t value_stride, int64_t n) {
  for (int64_t e0 = 0; e0 < d; e0 += 32) {
    __m256 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) a[g][c] = _mm256_loadu_ps(acc + g * d + e0 + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      __m256 pj[G];
      for (int g = 0; g < G; ++g) pj[g] = _mm256_set1_ps(p[g * p_stride + j]);
      const E* vj = v + j * value_stride + e0;
      for (int c = 0; c < 4; ++c) {
        const __m256 vv = load8(vj + 8 * c);
        for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(pj[g], vv, a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + g * d + e0 + 8 * c, a[g][c]);
  }
}

// One GQA group of a block (rows head * G .. head * G + G - 1 of the scratch), for G = 2..4; false: not served.
template <typename E>
inline bool score_group(int64_t group, const float* q, int64_t d, const E* k, int64_t key_stride, int64_t n,
                        float* scores, int64_t score_stride) {
  switch (group) {
    case 2: score_keys_group<2>(q, d, k, key_stride, n, scores, score_stride); return true;
    case 3: score_keys_group<3>(q, d, k, key_stride, n, scores, score_stride); return true;
    case 4: score_keys_group<4>(q, d, k, key_stride, n, scores, score_stride); return true;
    default: return false;
  }
}

template <typename E>
inline bool accumulate_group(int64_t group, float* acc, int64_t d, const float* p, int64_t p_stride, const E* v,
                             int64_t value_stride, int64_t n) {
  if (d % 32) return false;
  switch (group) {
    case 2: accumulate_values_group<2>(acc, d, p, p_stride, v, value_stride, n); return true;
    case 3: accumulate_values_group<3>(acc, d, p, p_stride, v, value_stride, n); return true;
    case 4: accumulate_values_group<4>(acc, d, p, p_stride, v, value_stride, n); return true;
    default: return false;
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bfloat16 decode path on CPUs with AVX512-BF16 (run_decode_task_bf16): query and key rows stay bfloat16 and
// meet in vdpbf16ps (32 products a pass, summed in float32); values widen to float32 16 lanes at a time.

// Lane i of the result: the sum of v[i]'s 16 lanes (a transpose-and-add tree: 30 shuffles and 15 adds for 16 sums).
inline __m512 lane_sums16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit quarter: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per quarter: four vectors' sums over that quarter
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // quarters (0 + 1) and (2 + 3) of y[2i], then of y[2i + 1]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t kMaxGroupBf16 = 16;  // query heads per KV head that run_decode_task_bf16 serves

inline void prefetch_line(const char* p);  // below, with the prefetch rules

inline __m512bh load_bf16x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Sixteen bfloat16 values widened to float32 (a 16-bit shift of each lane).
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Lane j: q . k_j for keys [0, m) at key_stride (m <= 16), each sum in a register of its own; lanes from m on: 0.
inline __m512 score_keys_bf16(const uint16_t* q, int64_t d, const uint16_t* k, int64_t key_stride, int m) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    acc[i] = _mm512_setzero_ps();
    if (i >= m) continue;
    const uint16_t* ki = k + i * key_stride;
    for (int64_t e = 0; e < d; e += 32) acc[i] = _mm512_dpbf16_ps(acc[i], load_bf16x32(q + e), load_bf16x32(ki + e));
  }
  return lane_sums16(acc);
}

// acc_g += sum_j p_g[j] * v_j for G rows (accumulators d apart, probabilities p_stride apart) over keys [0, n):
// each value row is loaded and widened once for the G rows; W dims (W / 16 registers a row) a pass.
// The accumulators are first multiplied by their row's correction (the online softmax's rescale). With pf_k set,
// each key row j also prefetches pf_lines lines at pf_k + j * pf_stride and pf_v + j * pf_stride (bytes): the
// next block's rows of this head, spread over the loop (see run_decode_task_bf16).
template <int G, int W>
inline void accumulate_values_bf16(float* acc, int64_t d, const float* p, int64_t p_stride, const float* correction,
                                   const uint16_t* v, int64_t value_stride, int64_t n,
                                   const char* pf_k = nullptr, const char* pf_v = nullptr, int64_t pf_stride = 0,
                                   int pf_lines = 0) {
  constexpr int C = W / 16;
  for (int64_t e0 = 0; e0 < d; e0 += W) {
    __m512 a[G][C];
    for (int g = 0; g < G; ++g) {
      const __m512 f = _mm512_set1_ps(correction[g]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_mul_ps(f, _mm512_loadu_ps(acc + g * d + e0 + 16 * c));
    }
    for (int64_t j = 0; j < n; ++j) {
      __m512 pj[G];
      for (int g = 0; g < G; ++g) pj[g] = _mm512_set1_ps(p[g * p_stride + j]);
      const uint16_t* vj = v + j * value_stride + e0;
      if (pf_k != nullptr && e0 == 0) {
        for (int l = 0; l < pf_lines; ++l) {
          prefetch_line(pf_k + j * pf_stride + 64 * l);
          prefetch_line(pf_v + j * pf_stride + 64 * l);
        }
      }
      for (int c = 0; c < C; ++c) {
        const __m512 vv = load_bf16x16(vj + 16 * c);
        for (int g = 0; g < G; ++g) a[g][c] = _mm512_fmadd_ps(pj[g], vv, a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * d + e0 + 16 * c, a[g][c]);
  }
}

// Rows [0, rows) of one KV head in groups of up to four (the accumulators of a group stay in registers).
template <int W>
inline void accumulate_rows_bf16(int64_t rows, float* acc, int64_t d, const float* p, int64_t p_stride,
                                 const float* correction, const uint16_t* v, int64_t value_stride, int64_t n,
                                 const char* pf_k, const char* pf_v, int64_t pf_stride, int pf_lines) {
  for (int64_t r = 0; r < rows; r += 4) {
    float* a = acc + r * d;
    const float *pr = p + r * p_stride, *f = correction + r;
    const char *pk = r == 0 ? pf_k : nullptr, *pv = r == 0 ? pf_v : nullptr;
    switch (std::min<int64_t>(4, rows - r)) {
      case 1: accumulate_values_bf16<1, W>(a, d, pr, p_stride, f, v, value_stride, n, pk, pv, pf_stride, pf_lines); break;
      case 2: accumulate_values_bf16<2, W>(a, d, pr, p_stride, f, v, value_stride, n, pk, pv, pf_stride, pf_lines); break;
      case 3: accumulate_values_bf16<3, W>(a, d, pr, p_stride, f, v, value_stride, n, pk, pv, pf_stride, pf_lines); break;
      default: accumulate_values_bf16<4, W>(a, d, pr, p_stride, f, v, value_stride, n, pk, pv, pf_stride, pf_lines); break;
    }
  }
}
#endif

// The AVX2 decode path serves this dtype (float32, or bfloat16 widened to it as it is read).
template <typename T>
constexpr bool simd_decode_dtype() {
#if defined(__AVX2__) && defined(__FMA__)
  return std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
  return false;
#endif
}

struct Task {
  int64_t seq, first, count;     // first: index of the tile's first query within its sequence
  int64_t head_begin, head_end;  // KV heads; all of them when there are enough tasks without splitting
  // A decode split by keys (see make_tasks): key positions [key_begin, key_end) only, and the rows' running max,
  // sum and unnormalised accumulators go to partial `part` (merged after every task ran) instead of out.
  int64_t key_begin = 0, key_end = std::numeric_limits<int64_t>::max(), part = -1;
};

// A partial of a decode split by keys: per query row of the sequence, its running max, its sum and d accumulators.
inline int64_t partial_row(int64_t d) { return d + 2; }

// The first key a decode task at position qpos reads: its window's start, or its piece's if later.
inline int64_t first_key(const Task& t, int64_t window, int64_t qpos) {
  return std::max(t.key_begin, window > 0 ? std::max<int64_t>(0, qpos - window + 1) : 0);
}

// Rows [0, rows) of a decode task's result: normalised into out (through `store`), or as they are into its partial
// (a split task covers every KV head, so its rows are the sequence's rows).
template <class Store>
inline void finish_decode_rows(const Task& t, int64_t rows, int64_t d, const float* m, const float* l,
                               const float* acc, float* partials, const Store& store) {
  if (t.part < 0) {
    for (int64_t r = 0; r < rows; ++r) store(r, acc + r * d, 1.f / l[r]);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = partials + r * partial_row(d);
    dst[0] = m[r], dst[1] = l[r];
    std::memcpy(dst + 2, acc + r * d, d * sizeof(float));
  }
}

struct Shape {
  int64_t heads, kv_heads, group, dim, block_size, window;
  float scale, softcap;
};

template <typename T>
struct Views {
  const T* q; T* out; const T* k; const T* v;
  int64_t q_row, q_head, out_row, out_head, kv_slot, kv_head;
  const int32_t* tables; int64_t table_row;
  const int32_t* query_start; const int32_t* query_lens; const int32_t* context_lens;
};

// A software prefetch the compiler keeps: GCC 12 at -O2/-O3 deletes loops whose only statements are
// __builtin_prefetch calls (prefetch_block's compiled to nothing), so the instruction is written out.
// Measured on a 2-core AVX2 EPYC, fp32: the offline engine (64 x 128/128, one process, interleaved with a
// build without it) 563 -> 589 tok/s; one layer alone (batch 64 x 160 context, caches in DRAM) within
// noise, as were prefetching 2 or 4 blocks ahead and into L2 only.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %0" : : "Q"(*p));
#else
  __builtin_prefetch(p);
#endif
}

inline void prefetch_line_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The K/V rows of KV heads [head_begin, head_begin + heads) in slots [slot0, slot0 + n), into L1 (or into L2 only:
// prefetch_rows_l2). Blocks sit anywhere in the pool, so no hardware prefetcher sees the next one coming: a task
// fetches it while it works on this one.
template <typename T, bool IntoL2 = false>
inline void prefetch_rows(const Views<T>& w, int64_t slot0, int64_t n, int64_t head_begin, int64_t heads) {
  const int64_t row_bytes = heads * w.kv_head * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = (slot0 + j) * w.kv_slot + head_begin * w.kv_head;
    const char* kr = reinterpret_cast<const char*>(w.k + row);
    const char* vr = reinterpret_cast<const char*>(w.v + row);
    for (int64_t off = 0; off < row_bytes; off += 64) {
      if constexpr (IntoL2) {
        prefetch_line_l2(kr + off);
        prefetch_line_l2(vr + off);
      } else {
        prefetch_line(kr + off);
        prefetch_line(vr + off);
      }
    }
  }
}

// The block after next, a KV head at a time, and a next task's first two blocks (see the file's head).
template <typename T>
inline void prefetch_rows_l2(const Views<T>& w, int64_t slot0, int64_t n, int64_t head_begin, int64_t heads) {
  prefetch_rows<T, true>(w, slot0, n, head_begin, heads);
}

// All of a task's heads in one block.
template <typename T>
inline void prefetch_block(const Views<T>& w, const Task& t, int64_t block, int64_t bs) {
  prefetch_rows(w, block * bs, bs, t.head_begin, t.head_end - t.head_begin);
}

// The bfloat16 decode path fetches the next block a KV head at a time (prefetch_rows of one head), after each
// head's pass over this block, instead of all of it at once before the first (benchmarks/ab_paged_attention.py,
// caches from DRAM): SmolLM2's heads at batch 64 x 200 3-4% faster with two threads, 5% with one; the tiny
// model's (--spread) 11%. Without any prefetch: 1.4x slower; two blocks ahead: 2-5% slower than one. The L2 fetch of
// the block after next (prefetch_rows_l2) comes on top of it (see the file's head).

// Floats of a thread's scratch buffer (what a task reads there it has written first).
struct Floats {
  float* p;
  float* data() const { return p; }
  float* begin() const { return p; }
  float& operator[](int64_t i) const { return p[i]; }
};

// Scratch of one thread: queries, accumulators, running maxima and sums, scores of one block. Views into a
// thread-local buffer that only grows: a call neither allocates nor zeroes it (SmolLM2's heads: 84 KB a thread,
// which cost ~3 us of a ~7 us call at batch 1 when it was allocated and zeroed for every call).
struct Scratch {
  Floats q, acc, m, l, scores;
  Scratch(int64_t rows, int64_t dim, int64_t block_size) {
    thread_local std::vector<float> buffer;
    const size_t need = static_cast<size_t>(rows * (2 * dim + 2 + block_size));
    if (buffer.size() < need) buffer.resize(need);
    float* p = buffer.data();
    q = {p}, acc = {p + rows * dim}, m = {p + 2 * rows * dim}, l = {p + 2 * rows * dim + rows};
    scores = {p + 2 * rows * dim + 2 * rows};
  }
};

template <typename T>
void run_task(const Task& t, const Views<T>& w, const Shape& s, Scratch& x) {
  const int64_t per_head = t.count * s.group, rows = (t.head_end - t.head_begin) * per_head;
  const int64_t d = s.dim, bs = s.block_size;
  const int64_t context = w.context_lens[t.seq];
  const int64_t first_pos = context - w.query_lens[t.seq] + t.first;
  const int64_t row0 = w.query_start[t.seq] + t.first;
  for (int64_t r = 0; r < rows; ++r) {  // row r: head head_begin + r / per_head, query (r % per_head) / group
    const int64_t head = t.head_begin + r / per_head, i = r % per_head / s.group, g = r % s.group;
    const T* src = w.q + (row0 + i) * w.q_row + (head * s.group + g) * w.q_head;
    float* dst = x.q.data() + r * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(src[e]) * s.scale;
  }
  std::fill_n(x.acc.begin(), rows * d, 0.f);
  std::fill_n(x.m.begin(), rows, kNegInf);
  std::fill_n(x.l.begin(), rows, 0.f);
  const int64_t last_pos = first_pos + t.count - 1;
  const int64_t lo = s.window > 0 ? std::max<int64_t>(0, first_pos - s.window + 1) : 0;
  const int32_t* table = w.tables + t.seq * w.table_row;
  for (int64_t b = lo / bs; b <= last_pos / bs; ++b) {
    const int64_t begin = std::max(lo, b * bs), end = std::min(last_pos + 1, (b + 1) * bs);
    const int64_t n = end - begin;
    const int64_t slot0 = static_cast<int64_t>(table[b]) * bs + (begin - b * bs);
    if (b < last_pos / bs) prefetch_block(w, t, table[b + 1], bs);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = t.head_begin + r / per_head;
      const T* keys = w.k + slot0 * w.kv_slot + head * w.kv_head;
      const T* values = w.v + slot0 * w.kv_slot + head * w.kv_head;
      // Keys visible to this row form one range of the block: pos <= qpos and pos > qpos - window.
      const int64_t qpos = first_pos + r % per_head / s.group;
      const int64_t jlo = s.window > 0 ? std::clamp<int64_t>(qpos - s.window + 1 - begin, 0, n) : 0;
      const int64_t jhi = std::clamp<int64_t>(qpos + 1 - begin, 0, n);
      if (jlo >= jhi) continue;
      float* sc = x.scores.data() + r * bs;
      score_keys(x.q.data() + r * d, storage(keys), w.kv_slot, jlo, jhi, d, sc);
      if (s.softcap > 0.f) {
        for (int64_t j = jlo; j < jhi; ++j) sc[j] = s.softcap * std::tanh(sc[j] / s.softcap);
      }
      const float m_new = std::max(x.m[r], *std::max_element(sc + jlo, sc + jhi));
      const float correction = std::exp(x.m[r] - m_new);
      const float sum = exp_shifted_sum(sc, jlo, jhi, m_new);
      x.l[r] = x.l[r] * correction + sum;
      x.m[r] = m_new;
      float* acc = x.acc.data() + r * d;
      if (correction != 1.f) {
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) acc[e] *= correction;
      }
      accumulate_values(acc, sc, storage(values), w.kv_slot, jlo, jhi, d);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = t.head_begin + r / per_head, i = r % per_head / s.group, g = r % s.group;
    const float inv = 1.f / x.l[r];
    T* dst = w.out + (row0 + i) * w.out_row + (head * s.group + g) * w.out_head;
    const float* acc = x.acc.data() + r * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(acc[e] * inv);
  }
}


// A decode task (one query per sequence): every row sees the same keys, so each block is walked slot by
// slot, all the task's KV heads of a slot at once (one contiguous run of memory), every query head of a
// GQA group scored against a key row while it is in registers; then the values the same way.
template <typename T>
void run_decode_task(const Task& t, const Views<T>& w, const Shape& s, Scratch& x, float* partials) {
  const int64_t nh = t.head_end - t.head_begin, rows = nh * s.group;
  const int64_t d = s.dim, bs = s.block_size;
  const int64_t context = w.context_lens[t.seq];
  const int64_t qpos = context - 1;
  const int64_t row0 = w.query_start[t.seq];
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = w.q + row0 * w.q_row + (t.head_begin * s.group + r) * w.q_head;
    float* dst = x.q.data() + r * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(src[e]) * s.scale;
  }
  std::fill_n(x.acc.begin(), rows * d, 0.f);
  std::fill_n(x.m.begin(), rows, kNegInf);
  std::fill_n(x.l.begin(), rows, 0.f);
  const int64_t lo = first_key(t, s.window, qpos);
  const int64_t hi = std::min(qpos + 1, t.key_end);  // keys [lo, hi)
  const int32_t* table = w.tables + t.seq * w.table_row;
  const bool simd = simd_decode_dtype<T>() && d % 8 == 0;
  for (int64_t b = lo / bs; lo < hi && b <= (hi - 1) / bs; ++b) {
    const int64_t begin = std::max(lo, b * bs), end = std::min(hi, (b + 1) * bs);
    const int64_t n = end - begin;
    const int64_t slot0 = static_cast<int64_t>(table[b]) * bs + (begin - b * bs);
    if (b < (hi - 1) / bs) prefetch_block(w, t, table[b + 1], bs);
    const int64_t far_slot = b + 1 < (hi - 1) / bs ? static_cast<int64_t>(table[b + 2]) * bs : -1;
    if (far_slot >= 0 && !simd) prefetch_rows_l2(w, far_slot, bs, t.head_begin, nh);
    if (simd) {  // per query row, eight keys of its KV head per pass (the block stays in L1 across rows)
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (simd_decode_dtype<T>()) {
        for (int64_t h = 0; h < nh; ++h) {
          if (far_slot >= 0) prefetch_rows_l2(w, far_slot, bs, t.head_begin + h, 1);  // two blocks ahead
          const auto* keys = storage(w.k + slot0 * w.kv_slot + (t.head_begin + h) * w.kv_head);
          const int64_t r0 = h * s.group;
          if (score_group(s.group, x.q.data() + r0 * d, d, keys, w.kv_slot, n, x.scores.data() + r0 * bs, bs)) continue;
          for (int64_t r = r0; r < r0 + s.group; ++r) {
            score_keys_simd(x.q.data() + r * d, keys, w.kv_slot, n, d, x.scores.data() + r * bs);
          }
        }
      }
#endif
    } else if (nh == 1) {  // one KV head: its key rows are strided; four keys per pass feed four FMA chains
      const auto* kblock = storage(w.k + slot0 * w.kv_slot + t.head_begin * w.kv_head);
      for (int64_t r = 0; r < rows; ++r) {
        score_keys(x.q.data() + r * d, kblock, w.kv_slot, 0, n, d, x.scores.data() + r * bs);
      }
    } else {  // slot by slot, all heads of a slot in one contiguous run
      for (int64_t j = 0; j < n; ++j) {
        const auto* krow = storage(w.k + (slot0 + j) * w.kv_slot + t.head_begin * w.kv_head);
        for (int64_t h = 0; h < nh; ++h) {
          const auto* kh = krow + h * w.kv_head;
          for (int64_t g = 0; g < s.group; ++g) {
            const float* q = x.q.data() + (h * s.group + g) * d;
            float acc = 0.f;
  #pragma omp simd reduction(+ : acc)
            for (int64_t e = 0; e < d; ++e) acc += q[e] * to_float(kh[e]);
            x.scores[(h * s.group + g) * bs + j] = acc;
          }
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sc = x.scores.data() + r * bs;
      if (s.softcap > 0.f) {
        for (int64_t j = 0; j < n; ++j) sc[j] = s.softcap * std::tanh(sc[j] / s.softcap);
      }
      const float m_new = std::max(x.m[r], *std::max_element(sc, sc + n));
      const float correction = std::exp(x.m[r] - m_new);
      x.l[r] = x.l[r] * correction + exp_shifted_sum(sc, 0, n, m_new);
      x.m[r] = m_new;
      if (correction != 1.f) {
        float* acc = x.acc.data() + r * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) acc[e] *= correction;
      }
    }
    if (simd) {
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (simd_decode_dtype<T>()) {
        for (int64_t h = 0; h < nh; ++h) {
          const auto* values = storage(w.v + slot0 * w.kv_slot + (t.head_begin + h) * w.kv_head);
          const int64_t r0 = h * s.group;
          if (accumulate_group(s.group, x.acc.data() + r0 * d, d, x.scores.data() + r0 * bs, bs, values, w.kv_slot, n)) {
            continue;
          }
          for (int64_t r = r0; r < r0 + s.group; ++r) {
            accumulate_values_simd(x.acc.data() + r * d, x.scores.data() + r * bs, values, w.kv_slot, n, d);
          }
        }
      }
#endif
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      const auto* vrow = storage(w.v + (slot0 + j) * w.kv_slot + t.head_begin * w.kv_head);
      for (int64_t h = 0; h < nh; ++h) {
        const auto* vh = vrow + h * w.kv_head;
        for (int64_t g = 0; g < s.group; ++g) {
          const int64_t r = h * s.group + g;
          const float p = x.scores[r * bs + j];
          float* acc = x.acc.data() + r * d;
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) acc[e] += p * to_float(vh[e]);
        }
      }
    }
  }
  finish_decode_rows(t, rows, d, x.m.data(), x.l.data(), x.acc.data(), partials, [&](int64_t r, const float* acc, float inv) {
    T* dst = w.out + row0 * w.out_row + (t.head_begin * s.group + r) * w.out_head;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(acc[e] * inv);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// run_decode_task for a bfloat16 cache on a CPU with AVX512-BF16 and a head dim a multiple of 32. Keys come 16
// at a time (a block, or a part of one): per KV head, each query row of the GQA group is scored against them with
// vdpbf16ps (the query as it is, the scale applied to the sums), the online softmax runs on the 16 scores in one
// register, and the group's rows then accumulate the 16 values together, their rescale folded into the load of
// the accumulators. Scores go through memory only as probabilities, read by the value pass.
void run_decode_task_bf16(const Task& t, const Views<c10::BFloat16>& w, const Shape& s, Scratch& x, float* partials) {
  const int64_t nh = t.head_end - t.head_begin, rows = nh * s.group;
  const int64_t d = s.dim, bs = s.block_size;
  const int64_t qpos = w.context_lens[t.seq] - 1;
  const auto* q = storage(w.q + w.query_start[t.seq] * w.q_row + t.head_begin * s.group * w.q_head);
  std::fill_n(x.acc.begin(), rows * d, 0.f);
  std::fill_n(x.m.begin(), rows, kNegInf);
  std::fill_n(x.l.begin(), rows, 0.f);
  alignas(64) float p[kMaxGroupBf16 * 16], correction[kMaxGroupBf16];
  const __m512 scale = _mm512_set1_ps(s.scale), neg_inf = _mm512_set1_ps(kNegInf);
  const int64_t lo = first_key(t, s.window, qpos);
  const int64_t hi = std::min(qpos + 1, t.key_end);  // keys [lo, hi)
  const int32_t* table = w.tables + t.seq * w.table_row;
  for (int64_t b = lo / bs; lo < hi && b <= (hi - 1) / bs; ++b) {
    const int64_t begin = std::max(lo, b * bs), end = std::min(hi, (b + 1) * bs);
    const int64_t slot_b = static_cast<int64_t>(table[b]) * bs - b * bs;  // key position pos sits at slot_b + pos
    const int64_t next_slot = b < (hi - 1) / bs ? static_cast<int64_t>(table[b + 1]) * bs : -1;
    const int64_t far_slot = b + 1 < (hi - 1) / bs ? static_cast<int64_t>(table[b + 2]) * bs : -1;
    for (int64_t j0 = begin; j0 < end; j0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, end - j0));
      const __mmask16 live = static_cast<__mmask16>((1u << m) - 1);
      const int64_t slot0 = slot_b + j0;
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t r0 = h * s.group;
        if (far_slot >= 0 && j0 == begin) prefetch_rows_l2(w, far_slot, bs, t.head_begin + h, 1);  // two blocks ahead
        const auto* keys = storage(w.k + slot0 * w.kv_slot + (t.head_begin + h) * w.kv_head);
        float* m_old = x.m.data() + r0;
        float* l = x.l.data() + r0;
        alignas(64) float m_new[kMaxGroupBf16];
        for (int64_t g = 0; g < s.group; ++g) {  // scores (kept in p) and each row's new running max
          __m512 sc = _mm512_mul_ps(score_keys_bf16(q + (r0 + g) * w.q_head, d, keys, w.kv_slot, m), scale);
          if (s.softcap > 0.f) {
            alignas(64) float lanes[16];
            _mm512_store_ps(lanes, sc);
            for (int j = 0; j < m; ++j) lanes[j] = s.softcap * std::tanh(lanes[j] / s.softcap);
            sc = _mm512_load_ps(lanes);
          }
          m_new[g] = std::max(m_old[g], _mm512_reduce_max_ps(_mm512_mask_blend_ps(live, neg_inf, sc)));
          _mm512_store_ps(p + g * 16, sc);
        }
        for (int64_t g0 = 0; g0 < s.group; g0 += 16) {  // the rescale of every row at once: exp(m_old - m_new)
          const __mmask16 rows_live = static_cast<__mmask16>((1u << std::min<int64_t>(16, s.group - g0)) - 1);
          const __m512 shift = _mm512_sub_ps(_mm512_maskz_loadu_ps(rows_live, m_old + g0),
                                             _mm512_maskz_loadu_ps(rows_live, m_new + g0));
          _mm512_mask_storeu_ps(correction + g0, rows_live, redserve_simd::exp_avx512(shift));
          _mm512_mask_storeu_ps(m_old + g0, rows_live, _mm512_maskz_loadu_ps(rows_live, m_new + g0));
        }
        for (int64_t g = 0; g < s.group; ++g) {  // probabilities over the live lanes, and the running sums
          const __m512 pr = _mm512_maskz_mov_ps(
              live, redserve_simd::exp_avx512(_mm512_sub_ps(_mm512_load_ps(p + g * 16), _mm512_set1_ps(m_new[g]))));
          l[g] = l[g] * correction[g] + _mm512_reduce_add_ps(pr);
          _mm512_store_ps(p + g * 16, pr);
        }
        // The next block's rows of this head, fetched a key row at a time as the values stream past (a burst
        // of prefetches fills the line buffers and stalls the loads of this block behind it).
        const char *pf_k = nullptr, *pf_v = nullptr;
        int pf_lines = 0;
        if (next_slot >= 0 && j0 + 16 >= end) {
          const int64_t row = next_slot * w.kv_slot + (t.head_begin + h) * w.kv_head;
          pf_k = reinterpret_cast<const char*>(w.k + row), pf_v = reinterpret_cast<const char*>(w.v + row);
          pf_lines = static_cast<int>((w.kv_head * static_cast<int64_t>(sizeof(uint16_t)) + 63) / 64);
          if (m < bs) prefetch_rows(w, next_slot + m, bs - m, t.head_begin + h, 1);  // rows the loop won't reach
        }
        const int64_t pf_stride = w.kv_slot * static_cast<int64_t>(sizeof(uint16_t));
        const auto* values = storage(w.v + slot0 * w.kv_slot + (t.head_begin + h) * w.kv_head);
        if (d % 64 == 0) {
          accumulate_rows_bf16<64>(s.group, x.acc.data() + r0 * d, d, p, 16, correction, values, w.kv_slot, m,
                                   pf_k, pf_v, pf_stride, pf_lines);
        } else {
          accumulate_rows_bf16<32>(s.group, x.acc.data() + r0 * d, d, p, 16, correction, values, w.kv_slot, m,
                                   pf_k, pf_v, pf_stride, pf_lines);
        }
      }
    }
  }
  finish_decode_rows(t, rows, d, x.m.data(), x.l.data(), x.acc.data(), partials, [&](int64_t r, const float* acc, float inv) {
    c10::BFloat16* dst = w.out + w.query_start[t.seq] * w.out_row + (t.head_begin * s.group + r) * w.out_head;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<c10::BFloat16>(acc[e] * inv);
  });
}
#endif

// The decode task on the CPU's native bfloat16 path where it serves the dtype and shape; false: not served.
template <typename T>
inline bool run_decode_task_native(const Task& t, const Views<T>& w, const Shape& s, Scratch& x, float* partials) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (s.dim % 32 == 0 && s.group <= kMaxGroupBf16) {
      run_decode_task_bf16(t, w, s, x, partials);
      return true;
    }
  }
#endif
  return false;
}

// Each KV head of a prefill tile through a prefill header's `attend` (prefill_bf16.h's or prefill_f32.h's Tile:
// the same fields over the element type E the header reads).
template <class Tile, class E, class T>
inline void attend_heads(const Task& t, const Views<T>& w, const Shape& s, const E* q, E* out, const E* k, const E* v,
                         void (*attend)(const Tile&)) {
  const int64_t first_pos = w.context_lens[t.seq] - w.query_lens[t.seq] + t.first;
  const int64_t row0 = w.query_start[t.seq] + t.first;
  for (int64_t h = t.head_begin; h < t.head_end; ++h) {
    attend(Tile{q + row0 * w.q_row, w.q_row, w.q_head, out + row0 * w.out_row, w.out_row, w.out_head, k, v, w.kv_slot,
                w.kv_head, w.tables + t.seq * w.table_row, s.block_size, first_pos, t.count, h, s.group, s.dim,
                s.window, s.scale});
  }
}

// A prefill tile (several queries of a sequence) on the CPU's native path for its dtype (prefill_bf16.h,
// prefill_f32.h), one KV head at a time, where it serves the dtype and shape; false: not served.
template <typename T>
inline bool run_prefill_task_native(const Task& t, const Views<T>& w, const Shape& s) {
  if (s.softcap > 0.f) return false;
#if defined(REDSERVE_PREFILL_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (!redserve_prefill::serves(s.dim)) return false;
    attend_heads<redserve_prefill::Tile>(t, w, s, storage(w.q), reinterpret_cast<uint16_t*>(w.out), storage(w.k),
                                         storage(w.v), redserve_prefill::attend);
    return true;
  }
#endif
#if defined(REDSERVE_PREFILL_F32)
  if constexpr (std::is_same_v<T, float>) {
    if (!redserve_prefill_f32::serves_f32(s.dim)) return false;
    attend_heads<redserve_prefill_f32::Tile>(t, w, s, w.q, w.out, w.k, w.v, redserve_prefill_f32::attend);
    return true;
  }
#endif
  return false;
}

// A decode split by keys: its sequence and its partials [first_part, first_part + parts), merged into its rows.
struct Split {
  int64_t seq, first_part, parts;
};

constexpr int64_t kMinSplitBlocks = 2;  // blocks of keys that a piece of a split decode reads at least

// Tiles of up to kQueryTile queries per sequence. A task takes all KV heads of a tile (each block is then
// read as one contiguous run of rows) unless that leaves too few tasks for the threads. Then, where one KV head a
// task would not spread evenly over the threads, a decode with keys
// for at least two pieces of kMinSplitBlocks blocks is split by keys into pieces (up to 4 x threads tasks in all),
// each over all its KV heads, merged after the pass (`splits`); any other tile takes one KV head a task.
// Why by keys: one head a task left 3 tasks to 2 threads at SmolLM2's batch 1 (one thread did two) and walked each
// block in 128-byte pieces of 384-byte rows; a piece over all heads reads its blocks as contiguous runs.
std::vector<Task> make_tasks(const at::Tensor& query_lens, const int32_t* contexts, const Shape& shape,
                             std::vector<Split>& splits) {
  std::vector<Task> tiles;
  const int32_t* lens = query_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < query_lens.size(0); ++s) {
    for (int64_t first = 0; first < lens[s]; first += kQueryTile) {
      tiles.push_back({s, first, std::min<int64_t>(kQueryTile, lens[s] - first), 0, shape.kv_heads});
    }
  }
  const int64_t threads = at::get_num_threads(), count = static_cast<int64_t>(tiles.size());
  if (count >= 4 * threads) return tiles;
  // One KV head a task already spreads evenly (e.g. the tiny model's 4 KV heads on 2 threads): no split, whose merge
  // would only add work (benchmarks/ab_paged_attention.py --shape 8,4,64,8 --batch 1: 1.03-1.13x slower split).
  const bool even = count * shape.kv_heads % threads == 0;
  const int64_t pieces = (4 * threads + count - 1) / count, bs = shape.block_size;
  std::vector<Task> tasks;
  int64_t parts = 0;
  for (const Task& tile : tiles) {
    const int64_t context = contexts[tile.seq];
    const int64_t lo = shape.window > 0 ? std::max<int64_t>(0, context - shape.window) : 0;
    const int64_t first_block = lo / bs, blocks = (context + bs - 1) / bs - first_block;
    const int64_t n = tile.count == 1 && lens[tile.seq] == 1 && !even  // one thread: always even
                          ? std::min(pieces, blocks / kMinSplitBlocks) : 1;
    if (n >= 2) {
      for (int64_t i = 0; i < n; ++i) {
        Task piece = tile;
        piece.key_begin = (first_block + blocks * i / n) * bs;
        piece.key_end = (first_block + blocks * (i + 1) / n) * bs;
        piece.part = parts + i;
        tasks.push_back(piece);
      }
      splits.push_back({tile.seq, parts, n});
      parts += n;
      continue;
    }
    for (int64_t h = 0; h < shape.kv_heads; ++h) tasks.push_back({tile.seq, tile.first, tile.count, h, h + 1});
  }
  return tasks;
}

// The rows of each split decode: the pieces' running maxima, sums and accumulators merged (the online softmax's
// rescale, once per piece), normalised into out.
template <typename T>
void merge_splits(const std::vector<Split>& splits, const float* partials, const Views<T>& w, const Shape& s) {
  if (splits.empty()) return;
  const int64_t d = s.dim, stride = s.heads * partial_row(d);
  std::vector<float> acc(d);
  for (const Split& sp : splits) {
    for (int64_t r = 0; r < s.heads; ++r) {
      float top = kNegInf, l = 0.f;
      for (int64_t i = 0; i < sp.parts; ++i) top = std::max(top, partials[(sp.first_part + i) * stride + r * partial_row(d)]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < sp.parts; ++i) {
        const float* p = partials + (sp.first_part + i) * stride + r * partial_row(d);
        if (p[1] == 0.f) continue;  // no keys in this piece (before a sliding window)
        const float weight = std::exp(p[0] - top);
        l += p[1] * weight;
        for (int64_t e = 0; e < d; ++e) acc[e] += weight * p[2 + e];
      }
      const float inv = 1.f / l;
      T* dst = w.out + w.query_start[sp.seq] * w.out_row + r * w.out_head;
      for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(acc[e] * inv);
    }
  }
}

// The first two blocks a decode task reads (from its query's window start), all its heads, into L2: the blocks
// that no earlier block of the task fetched (each block fetches the one after next).
template <typename T>
inline void prefetch_first_blocks(const Views<T>& w, const Shape& s, const Task& t) {
  if (t.count != 1 || w.query_lens[t.seq] != 1) return;
  const int64_t qpos = w.context_lens[t.seq] - 1;
  const int64_t lo = first_key(t, s.window, qpos);
  if (lo > qpos) return;
  const int64_t bs = s.block_size, first = lo / bs;
  for (int64_t b = first; b <= std::min(first + 1, qpos / bs); ++b) {
    const int64_t slot0 = static_cast<int64_t>(w.tables[t.seq * w.table_row + b]) * bs;
    prefetch_rows_l2(w, slot0, std::min(bs, qpos + 1 - b * bs), t.head_begin, t.head_end - t.head_begin);
  }
}

// A task's work, about: the keys it reads times the query rows that read them.
inline int64_t task_cost(const Task& t, const int32_t* context_lens) {
  const int64_t keys = std::min<int64_t>(context_lens[t.seq], t.key_end) - t.key_begin;
  return keys * t.count * (t.head_end - t.head_begin);
}

void check_int32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.stride(-1) == 1, name,
              " must be an int32 CPU tensor, contiguous in its last dim");
}

}  // namespace

// out, q: [T, H, d]; k_cache, v_cache: [num_slots, KVH, d]; block_tables: int32 [S, max_blocks];
// query_start, query_lens, context_lens: int32 [S]. Writes only the query rows the sequences own.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window,
                     double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "expected q/out [T, H, d] and k_cache/v_cache [num_slots, KVH, d]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(), "q, out and the cache must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 &&
                  k_cache.strides() == v_cache.strides(), "the head dim must be contiguous");
  check_int32(block_tables, "block_tables");
  check_int32(query_start, "query_start");
  check_int32(query_lens, "query_lens");
  check_int32(context_lens, "context_lens");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  const Shape shape{heads, kv_heads, heads / kv_heads, q.size(2), block_size, window,
                    static_cast<float>(scale), static_cast<float>(softcap)};
  const int32_t* contexts = context_lens.data_ptr<int32_t>();
  std::vector<Split> splits;
  std::vector<Task> tasks = make_tasks(query_lens, contexts, shape, splits);
  std::vector<float> partials(splits.empty() ? 0 : (splits.back().first_part + splits.back().parts) * heads *
                                                       partial_row(shape.dim));
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {  // the longest first
    return task_cost(a, contexts) > task_cost(b, contexts);
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const Views<scalar_t> views{q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                v_cache.data_ptr<scalar_t>(), q.stride(0), q.stride(1), out.stride(0),
                                out.stride(1), k_cache.stride(0), k_cache.stride(1),
                                block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                                query_start.data_ptr<int32_t>(), query_lens.data_ptr<int32_t>(),
                                context_lens.data_ptr<int32_t>()};
    std::atomic<size_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {  // each thread takes the next task until none is left
      Scratch scratch(kQueryTile * shape.heads, shape.dim, block_size);
      for (size_t i = next.fetch_add(1, std::memory_order_relaxed), j; i < tasks.size(); i = j) {
        const Task& task = tasks[i];
        j = next.fetch_add(1, std::memory_order_relaxed);  // the task after this one: its first block into L2
        if (j < tasks.size()) prefetch_first_blocks(views, shape, tasks[j]);
        if (task.count == 1 && views.query_lens[task.seq] == 1) {
          float* part = task.part < 0 ? nullptr : partials.data() + task.part * heads * partial_row(shape.dim);
          if (!run_decode_task_native(task, views, shape, scratch, part)) {
            run_decode_task(task, views, shape, scratch, part);
          }
        } else if (!run_prefill_task_native(task, views, shape)) {
          run_task(task, views, shape, scratch);
        }
      }
    });
    merge_splits(splits, partials.data(), views, shape);
  });
}

// Whether a prefill chunk (more than one query) in `dtype` with this head dim and softcap takes a native path here
// (prefill_bf16.h, prefill_f32.h); the rest take the per-row walk (run_task), which the caller may leave to SDPA.
bool native_prefill(at::ScalarType dtype, int64_t head_dim, double softcap) {
  if (softcap > 0.0) return false;
#if defined(REDSERVE_PREFILL_BF16)
  if (dtype == at::kBFloat16 && redserve_prefill::serves(head_dim)) return true;
#endif
#if defined(REDSERVE_PREFILL_F32)
  if (dtype == at::kFloat && redserve_prefill_f32::serves_f32(head_dim)) return true;
#endif
  (void)dtype, (void)head_dim;
  return false;
}

// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for every token t: the step's new K/V rows
// (KVH * d elements each, k and v [T, KVH, d] with contiguous rows, e.g. views into the qkv output)
// written into the caches [num_slots, KVH, d]. One call for both, in place of two index_copy_.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_cache.device().is_cpu() && k.device().is_cpu() && slots.device().is_cpu(), "write_kv runs on CPU tensors");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous int64 tensor");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                  k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2) && k.size(0) == slots.size(0),
              "expected k/v [T, KVH, d], caches [num_slots, KVH, d] and T slots");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(), "k, v and the caches must share a dtype");
  const int64_t row = k.size(1) * k.size(2);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &k_cache, &v_cache}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "each token's K/V row must be contiguous");
  }
  const int64_t tokens = slots.size(0), num_slots = k_cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot out of range");
  const int64_t bytes = row * static_cast<int64_t>(k.element_size());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = k.element_size();
  at::parallel_for(0, tokens, std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, 2 * bytes)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot[t] * k_cache.stride(0) * es, kp + t * k.stride(0) * es, bytes);
      std::memcpy(vc + slot[t] * v_cache.stride(0) * es, vp + t * v.stride(0) * es, bytes);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "k_cache[slots[t]] = k[t]; v_cache[slots[t]] = v[t] (CPU)");
  m.def("paged_attention", &paged_attention, "Paged attention over a block-paged KV cache (CPU)");
  m.def("native_prefill", &native_prefill, "whether prefill chunks of this dtype and head dim take the native path");
}
