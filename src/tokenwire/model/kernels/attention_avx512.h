// AVX-512 attention: groups of query heads sharing a KV head, each key and value read once for
// the group, 16-lane sums (attention.h chooses it: grouped_attention).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via attention.h).
#pragma once

#include "attention_softmax.h"

namespace tw {

// Whether attend_chunk takes the AVX-512 path below: a head of 16 to 128 values in whole
// vectors, or Gemma 3's 256 (one head at a time: 16 query vectors and 4 sums in registers)
inline bool grouped_attention(int64_t D) {
#ifdef TW_AVX512
  return (D % 16 == 0 && D >= 16 && D <= 128) || D == 256;
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

// One chunk [a, b) of positions for G query heads sharing a KV head (D = 16 QV): each key and
// value is read once for the G heads, through its reader (kv_store.h: fp32, fp16, bf16 or q8 to
// fp32 in registers). A score is q.k in QV 16-lane FMAs in order and sum4x16's tree, times scale;
// positions go in fours with the tail padded, so a score does not depend on the row's step or
// company. Leaves each head's partial softmax: o = sum of e^(score - max) * value in position
// order (G rows of D), its max and its sum of e^(score - max).
template <int QV, int G, class KeyAt, class ValueAt>
void attend_group(const float* q, int64_t q_stride, const KeyAt& key, const ValueAt& value, int64_t a, int64_t b,
                  float scale, float* scores, float* o, float* mx, float* sums) {
  const int64_t n = b - a;
  __m512 qv[G][QV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < QV; ++j) qv[g][j] = _mm512_loadu_ps(q + g * q_stride + 16 * j);
  __m128 top[G];  // the running max of each head's scores (exact in any order)
  for (auto& m : top) m = _mm_set1_ps(-INFINITY);
  for (int64_t t = a; t < b; t += 4) {
    __m512 acc[G][4];
    for (int i = 0; i < 4; ++i) {
      if (t + i >= b) {  // padding: a zero score, not stored
        for (int g = 0; g < G; ++g) acc[g][i] = _mm512_setzero_ps();
        continue;
      }
      const auto k = key(t + i);
      __m512 kv[QV];
      for (int j = 0; j < QV; ++j) kv[j] = k.load16(16 * j);
      for (int g = 0; g < G; ++g) {
        acc[g][i] = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int j = 1; j < QV; ++j) acc[g][i] = _mm512_fmadd_ps(qv[g][j], kv[j], acc[g][i]);
      }
    }
    const int valid = static_cast<int>(std::min<int64_t>(4, b - t));
    const __mmask8 real = static_cast<__mmask8>((1 << valid) - 1);
    for (int g = 0; g < G; ++g) {
      const __m128 four = _mm_mul_ps(sum4x16(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale));
      _mm_mask_storeu_ps(scores + g * n + t - a, real, four);
      top[g] = _mm_mask_max_ps(top[g], real, top[g], four);
    }
  }
  for (int g = 0; g < G; ++g) {
    __m128 m = _mm_max_ps(top[g], _mm_movehl_ps(top[g], top[g]));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    mx[g] = _mm_cvtss_f32(m);
    sums[g] = exp_sum(scores + g * n, n, mx[g]);
  }
  __m512 acc[G][QV];
  for (auto& head : acc)
    for (auto& r : head) r = _mm512_setzero_ps();
  for (int64_t t = a; t < b; ++t) {
    const auto v = value(t);
    __m512 vv[QV];
    for (int j = 0; j < QV; ++j) vv[j] = v.load16(16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * n + t - a]);
      for (int j = 0; j < QV; ++j) acc[g][j] = _mm512_fmadd_ps(w, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < QV; ++j) _mm512_storeu_ps(o + g * 16 * QV + 16 * j, acc[g][j]);
}

// `count` heads sharing one KV head, in groups of at most 16 / QV and 4 (the registers: G * QV
// query vectors, as many outputs)
template <int QV, class KeyAt, class ValueAt>
void attend_heads(const float* q, int64_t count, const KeyAt& key, const ValueAt& value, int64_t a, int64_t b,
                  float scale, float* scores, float* o, float* mx, float* sums) {
  constexpr int kMaxGroup = std::min(4, 16 / QV), D = 16 * QV;
  for (int64_t g0 = 0; g0 < count; g0 += kMaxGroup) {
    const float* qg = q + g0 * D;
    float *og = o + g0 * D, *mg = mx + g0, *sg = sums + g0;
    switch (std::min<int64_t>(kMaxGroup, count - g0)) {
      case 1: attend_group<QV, 1>(qg, D, key, value, a, b, scale, scores, og, mg, sg); break;
      case 2:
        if constexpr (kMaxGroup >= 2) attend_group<QV, 2>(qg, D, key, value, a, b, scale, scores, og, mg, sg);
        break;
      case 3:
        if constexpr (kMaxGroup >= 3) attend_group<QV, 3>(qg, D, key, value, a, b, scale, scores, og, mg, sg);
        break;
      default:
        if constexpr (kMaxGroup >= 4) attend_group<QV, 4>(qg, D, key, value, a, b, scale, scores, og, mg, sg);
        break;
    }
  }
}
#endif

}  // namespace tw
