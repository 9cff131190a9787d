// Attention over the paged cache for the fused decode stack: the softmax, each position's score
// and the weighed values of one row, per query head (AVX2) or per group of query heads sharing a
// KV head (AVX-512: each key and value read once for the group).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via decode_stack.h).
#pragma once

#include "blocks.h"

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

// scores[t] <- exp(scores[t] - max); returns their sum (the softmax's denominator)
inline float softmax_numerators(float* scores, int64_t len) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, scores[t]);
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

// The attention of one (row, head) over its positions [from, len): scores q.k * scale, then the
// values weighed by softmax. Each position's score and each value's term are computed the same
// way whatever the row, the step or the number of positions (positions are taken in fours with
// the tail padded, never as one scalar tail), so a row's attention does not depend on its step.
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

// out[D] = sum over positions of (score / total) * value, in position order; the output is held
// in registers 64 values at a time (the same FMAs, in the same order, as through memory)
template <class ValueAt>
inline void weigh_values(const float* scores, float total, const ValueAt& value, int64_t from, int64_t len,
                         int64_t D, float* out) {
#ifdef TW_AVX2
  if (D % 64 == 0) {
    for (int64_t c = 0; c < D; c += 64) {
      __m256 o[8];
      for (auto& r : o) r = _mm256_setzero_ps();
      for (int64_t t = from; t < len; ++t) {
        const __m256 w = _mm256_set1_ps(scores[t - from] / total);
        const float* v = value(t) + c;
        for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), o[i]);
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + c + 8 * i, o[i]);
    }
    return;
  }
#endif
  std::fill(out, out + D, 0.0f);
  for (int64_t t = from; t < len; ++t) axpy(scores[t - from] / total, value(t), out, D);
}

// Whether the fused step takes its attention by (row, KV head) through attend_heads_d below:
// AVX-512 and a head of 16 to 128 values in whole vectors
inline bool grouped_attention(int64_t D) {
#ifdef TW_AVX512
  return D % 16 == 0 && D >= 16 && D <= 128;
#else
  (void)D;
  return false;
#endif
}

#ifdef TW_AVX512
// four 16-lane sums -> their four totals, each by the same tree (pairs inside 128-bit lanes, then
// the 128-bit lanes), whatever the other three
inline __m128 sum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // [a02 b02 a13 b13]
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The attention of one row over positions [from, len) for G query heads that share a KV head (D =
// 16 QV): each key and value is loaded once for the G heads. A score is q.k in QV 16-lane FMAs in
// order and sum4x16's tree, times scale; positions go in fours with the tail padded, so a score
// does not depend on the row's step or company. The values are weighed in position order, each
// output value by the same FMAs as weigh_values'. scores: G rows of len - from.
template <int QV, int G, class KeyAt, class ValueAt>
void attend_group(const float* q, int64_t q_stride, const KeyAt& key, const ValueAt& value, int64_t from, int64_t len,
                  float scale, float* scores, float* out, int64_t out_stride) {
  const int64_t n = len - from;
  __m512 qv[G][QV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < QV; ++j) qv[g][j] = _mm512_loadu_ps(q + g * q_stride + 16 * j);
  for (int64_t t = from; t < len; t += 4) {
    __m512 acc[G][4];
    for (int i = 0; i < 4; ++i) {
      if (t + i >= len) {  // padding: a zero score, not stored
        for (int g = 0; g < G; ++g) acc[g][i] = _mm512_setzero_ps();
        continue;
      }
      const float* k = key(t + i);
      __m512 kv[QV];
      for (int j = 0; j < QV; ++j) kv[j] = _mm512_loadu_ps(k + 16 * j);
      for (int g = 0; g < G; ++g) {
        acc[g][i] = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int j = 1; j < QV; ++j) acc[g][i] = _mm512_fmadd_ps(qv[g][j], kv[j], acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g) {
      float four[4];
      _mm_storeu_ps(four, _mm_mul_ps(sum4x16(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
      for (int i = 0; i < 4 && t + i < len; ++i) scores[g * n + t + i - from] = four[i];
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) total[g] = softmax_numerators(scores + g * n, n);
  __m512 o[G][QV];
  for (auto& head : o)
    for (auto& r : head) r = _mm512_setzero_ps();
  for (int64_t t = from; t < len; ++t) {
    const float* v = value(t);
    __m512 vv[QV];
    for (int j = 0; j < QV; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * n + t - from] / total[g]);
      for (int j = 0; j < QV; ++j) o[g][j] = _mm512_fmadd_ps(w, vv[j], o[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < QV; ++j) _mm512_storeu_ps(out + g * out_stride + 16 * j, o[g][j]);
}

// heads [h0, h0 + count) of one row, sharing one KV head, in groups of at most 16 / QV and 4
// (the registers: G * QV query vectors, as many outputs)
template <int QV, class KeyAt, class ValueAt>
void attend_heads(const float* q, int64_t q_stride, int64_t count, const KeyAt& key, const ValueAt& value,
                  int64_t from, int64_t len, float scale, std::vector<float>& scores, float* out, int64_t out_stride) {
  constexpr int kMaxGroup = std::min(4, 16 / QV);
  scores.resize(kMaxGroup * (len - from));
  for (int64_t g0 = 0; g0 < count; g0 += kMaxGroup) {
    const float* qg = q + g0 * q_stride;
    float* og = out + g0 * out_stride;
    switch (std::min<int64_t>(kMaxGroup, count - g0)) {
      case 1: attend_group<QV, 1>(qg, q_stride, key, value, from, len, scale, scores.data(), og, out_stride); break;
      case 2:
        if constexpr (kMaxGroup >= 2) attend_group<QV, 2>(qg, q_stride, key, value, from, len, scale, scores.data(), og, out_stride);
        break;
      case 3:
        if constexpr (kMaxGroup >= 3) attend_group<QV, 3>(qg, q_stride, key, value, from, len, scale, scores.data(), og, out_stride);
        break;
      default:
        if constexpr (kMaxGroup >= 4) attend_group<QV, 4>(qg, q_stride, key, value, from, len, scale, scores.data(), og, out_stride);
        break;
    }
  }
}

// the same for a head size of 16 QV, QV = 1..8
template <class KeyAt, class ValueAt>
void attend_heads_d(int64_t D, const float* q, int64_t count, const KeyAt& key, const ValueAt& value, int64_t from,
                    int64_t len, float scale, std::vector<float>& scores, float* out) {
  switch (D / 16) {
    case 1: return attend_heads<1>(q, D, count, key, value, from, len, scale, scores, out, D);
    case 2: return attend_heads<2>(q, D, count, key, value, from, len, scale, scores, out, D);
    case 3: return attend_heads<3>(q, D, count, key, value, from, len, scale, scores, out, D);
    case 4: return attend_heads<4>(q, D, count, key, value, from, len, scale, scores, out, D);
    case 5: return attend_heads<5>(q, D, count, key, value, from, len, scale, scores, out, D);
    case 6: return attend_heads<6>(q, D, count, key, value, from, len, scale, scores, out, D);
    case 7: return attend_heads<7>(q, D, count, key, value, from, len, scale, scores, out, D);
    default: return attend_heads<8>(q, D, count, key, value, from, len, scale, scores, out, D);
  }
}
#endif

}  // namespace tw
