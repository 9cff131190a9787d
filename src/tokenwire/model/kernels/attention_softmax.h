// The softmax and one (row, head)'s scores and weighed values, the arithmetic every attention path
// keeps (attention.h), and a row's share of a chunk (ChunkRow).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via attention.h).
#pragma once

#include "kv_store.h"

namespace tw {

#ifdef TW_AVX2
// e^x, within a few ulp for x in [-87.3, 88.3] (clamped there: softmax and SiLU never need more):
// x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so n ln2 is exact enough), e^r by its
// Taylor polynomial to r^7 (truncation error 5e-9 relative), 2^n built in the exponent bits.
inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

// scores[t] <- exp(scores[t] - mx) for their max mx; returns their sum (the softmax's denominator)
inline float exp_sum(float* scores, int64_t len, float mx) {
  float total = 0;
  int64_t t = 0;
#ifdef TW_AVX2
  const __m256 vmax = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vmax));
    _mm256_storeu_ps(scores + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = hsum(sum);
#endif
  for (; t < len; ++t) {
    scores[t] = std::exp(scores[t] - mx);
    total += scores[t];
  }
  return total;
}

// the same, finding the max (into *max) first
inline float softmax_numerators(float* scores, int64_t len, float* max) {
  float mx = -INFINITY;
  int64_t t = 0;
#ifdef TW_AVX2
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= len; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + t));
  mx = hmax(vmax);
#endif
  for (; t < len; ++t) mx = std::max(mx, scores[t]);
  *max = mx;
  return exp_sum(scores, len, mx);
}

// The attention of one (row, head) over positions [from, len): scores q.k * scale. Each
// position's score is computed the same way whatever the row, the step or the number of
// positions (positions are taken in fours with the tail padded, never as one scalar tail), so a
// row's attention does not depend on its step.
// Measured (SmolLM2's fused stack, one 512-row prefill step, 2 threads, min of 3): rows at
// positions 1500-2011 2.45 -> 2.05 s, 500-1011 1.40 -> 1.26 s, 0-511 0.95 -> 0.97 s, against
// one hsum per position and the output accumulated through memory.
template <class KeyAt>
inline void key_scores(const float* q, const KeyAt& key, int64_t from, int64_t len, int64_t D, float scale,
                       float* scores) {
#ifdef TW_AVX2
  if (D % 8 == 0) {
    for (int64_t t = from; t < len; t += 4) {
      __m256 acc[4];
      for (int i = 0; i < 4; ++i) {
        acc[i] = _mm256_setzero_ps();
        if (t + i >= len) continue;  // padding: a zero score, not stored
        const float* k = key(t + i);
        for (int64_t d = 0; d < D; d += 8)
          acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc[i]);
      }
      // the four sums at once: [a0 a1 a2 a3] in the low lanes
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      float four[4];
      _mm_storeu_ps(four, _mm_mul_ps(sums, _mm_set1_ps(scale)));
      for (int i = 0; i < 4 && t + i < len; ++i) scores[t + i - from] = four[i];
    }
    return;
  }
#endif
  for (int64_t t = from; t < len; ++t) scores[t - from] = dot(q, key(t), D) * scale;
}

// out[D] = sum over positions of weight * value, in position order; the output is held in
// registers 64 values at a time (the same FMAs, in the same order, as through memory)
template <class ValueAt>
inline void weigh_values(const float* weights, const ValueAt& value, int64_t from, int64_t len, int64_t D,
                         float* out) {
#ifdef TW_AVX2
  if (D % 64 == 0) {
    for (int64_t c = 0; c < D; c += 64) {
      __m256 o[8];
      for (auto& r : o) r = _mm256_setzero_ps();
      for (int64_t t = from; t < len; ++t) {
        const __m256 w = _mm256_set1_ps(weights[t - from]);
        const float* v = value(t) + c;
        for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), o[i]);
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + c + 8 * i, o[i]);
    }
    return;
  }
#endif
  std::fill(out, out + D, 0.0f);
  for (int64_t t = from; t < len; ++t) axpy(weights[t - from], value(t), out, D);
}

// One row's share of a chunk: its `count` query heads (q: count rows of D), its end b (it sees
// [a, b)) and where its partial softmaxes go: o [count, D], mx and sums [count]
struct ChunkRow {
  const float* q;
  int64_t b;
  float* o;
  float* mx;
  float* sums;
};

}  // namespace tw
