// Attention over the paged cache for the fused decode stack: the softmax, each position's score
// and the weighed values of one row, per query head (AVX2) or per group of query heads sharing a
// KV head (AVX-512: each key and value read once for the group).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via decode_stack.h).
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
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, scores[t]);
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

// One row's share of a chunk: its `count` query heads (q: count rows of D), its end b (it sees
// [a, b)) and where its partial softmaxes go: o [count, D], mx and sums [count]
struct ChunkRow {
  const float* q;
  int64_t b;
  float* o;
  float* mx;
  float* sums;
};

#ifdef TW_AVX2
// The dots of P positions from t with Q query vectors qs[i] (D a multiple of 8): acc[i][p] = 8-lane
// FMAs of qs[i] and key(t + p) in d order, as key_scores runs them one position at a time. The P
// keys are read side by side so that Q * P FMA chains are in flight: one position at a time kept
// only Q chains (the 4-cycle FMA latency over 1-3 of them: a sixth of the FMA peak, issue 42's
// AVX2 4k-token prefill). Each accumulator sees the same FMAs in the same order: the same bits.
template <int Q, int P, class KeyAt>
inline void position_dots(const float* const* qs, int64_t D, const KeyAt& key, int64_t t, __m256 (&acc)[Q][P]) {
  decltype(key(t)) k[P];
  for (int p = 0; p < P; ++p) k[p] = key(t + p);
  for (auto& query : acc)
    for (auto& r : query) r = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 kv[P];
    for (int p = 0; p < P; ++p) kv[p] = k[p].load8(d);
    for (int i = 0; i < Q; ++i) {
      const __m256 qv = _mm256_loadu_ps(qs[i] + d);
      for (int p = 0; p < P; ++p) acc[i][p] = _mm256_fmadd_ps(qv, kv[p], acc[i][p]);
    }
  }
}

// four positions' 8-lane sums -> their four totals in the low 128 bits, each by the same tree
inline __m128 sum4x8(__m256 pair01, __m256 pair23) {
  const __m256 h = _mm256_hadd_ps(pair01, pair23);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of positions [t, b) for Q query vectors, query i's at scores[i * n + position - a]: four
// positions at a time (Q <= 2: their keys side by side, 4Q chains; more: two pairs, 2Q chains and
// the first pair's sums held, the 16 registers), then the last 1-3 padded with zero sums
template <int Q, class KeyAt>
inline void scores_from(const float* const* qs, int64_t D, const KeyAt& key, int64_t a, int64_t t, int64_t b,
                        int64_t n, float scale, float* scores) {
  const __m128 vscale = _mm_set1_ps(scale);
  for (; t + 4 <= b; t += 4) {
    __m128 four[Q];
    if constexpr (Q <= 2) {
      __m256 acc[Q][4];
      position_dots<Q, 4>(qs, D, key, t, acc);
      for (int i = 0; i < Q; ++i)
        four[i] = sum4x8(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
    } else {
      __m256 acc[Q][2], first[Q];
      position_dots<Q, 2>(qs, D, key, t, acc);
      for (int i = 0; i < Q; ++i) first[i] = _mm256_hadd_ps(acc[i][0], acc[i][1]);
      position_dots<Q, 2>(qs, D, key, t + 2, acc);
      for (int i = 0; i < Q; ++i) four[i] = sum4x8(first[i], _mm256_hadd_ps(acc[i][0], acc[i][1]));
    }
    for (int i = 0; i < Q; ++i) _mm_storeu_ps(scores + i * n + t - a, _mm_mul_ps(four[i], vscale));
  }
  if (t == b) return;
  const int valid = static_cast<int>(b - t);  // padding: a zero sum, not stored
  __m256 acc[Q][4];
  for (auto& query : acc)
    for (auto& r : query) r = _mm256_setzero_ps();
  for (int p = 0; p < valid; ++p) {
    const auto k = key(t + p);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = k.load8(d);
      for (int i = 0; i < Q; ++i) acc[i][p] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[i] + d), kv, acc[i][p]);
    }
  }
  for (int i = 0; i < Q; ++i) {
    float four[4];
    _mm_storeu_ps(four, _mm_mul_ps(sum4x8(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3])), vscale));
    for (int p = 0; p < valid; ++p) scores[i * n + t + p - a] = four[p];
  }
}

// out_i[c .. c + 8V), i in [First, Q), over values [t0, t1) weighed by weights[i] (indexed by position - a), 8-lane
// FMAs in position order continuing from out (as weigh_values): Q * V chains in flight
template <int Q, int V, int First = 0, class ValueAt>
inline void weigh_into(__m256 (&out)[Q][V], const float* const* weights, const ValueAt& value, int64_t a,
                       int64_t t0, int64_t t1, int64_t c) {
  for (int64_t t = t0; t < t1; ++t) {
    const auto v = value(t);
    __m256 vv[V];
    for (int j = 0; j < V; ++j) vv[j] = v.load8(c + 8 * j);
    for (int i = First; i < Q; ++i) {
      const __m256 w = _mm256_set1_ps(weights[i][t - a]);
      for (int j = 0; j < V; ++j) out[i][j] = _mm256_fmadd_ps(w, vv[j], out[i][j]);
    }
  }
}

// AVX2: G query heads sharing a KV head over [a, b) (D a multiple of 16), each key and value read
// and converted (kv_store.h's load8) once for the G heads, in registers. The arithmetic of
// key_scores and weigh_values exactly (a score: 8-lane FMAs in order and the four-position hadd
// tree; the values: 8-lane FMAs in position order), so a score does not depend on the row's step
// or company. G <= 3 (the 16 registers). Leaves each head's partial softmax as attend_group does.
// Measured (SmolLM2's 9 heads over 3 KV heads, one layer, 2 threads, AVX2 build, 4k fp16
// positions): 1 row 0.335 ms with the chunk converted to fp32 first (8 at a time), 0.77 ms
// converted one value at a time, 0.148 ms one position's dots at a time (21 GB/s of KV; AVX-512
// 0.094 ms, 33 GB/s); then the positions side by side (position_dots, wider value passes): see
// docs/engine.md, issue 42's AVX2 prompt attention.
template <int G, class KeyAt, class ValueAt>
void attend_group8(const float* q, int64_t D, const KeyAt& key, const ValueAt& value, int64_t a, int64_t b,
                   float scale, float* scores, float* o, float* mx, float* sums) {
  const int64_t n = b - a;
  const float* qs[G];
  const float* weights[G];
  for (int g = 0; g < G; ++g) qs[g] = q + g * D, weights[g] = scores + g * n;
  scores_from<G>(qs, D, key, a, a, b, n, scale, scores);
  for (int g = 0; g < G; ++g) sums[g] = softmax_numerators(scores + g * n, n, mx + g);
  // each head's output 8V values a pass: G * V accumulators and V value vectors in registers
  auto weigh = [&](auto vs) {
    constexpr int V = decltype(vs)::value;
    for (int64_t c = 0; c < D; c += 8 * V) {
      __m256 out[G][V];
      for (auto& head : out)
        for (auto& r : head) r = _mm256_setzero_ps();
      weigh_into<G, V>(out, weights, value, a, a, b, c);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < V; ++j) _mm256_storeu_ps(o + g * D + c + 8 * j, out[g][j]);
    }
  };
  constexpr int kWide = G == 1 ? 8 : G == 2 ? 4 : 2;
  if (D % (8 * kWide) == 0)
    weigh(std::integral_constant<int, kWide>{});
  else
    weigh(std::integral_constant<int, 2>{});
}

// `count` heads sharing one KV head, in groups of at most 3 (the registers), as even as they go:
// 4 -> 2 + 2, not 3 + 1 (each group reads and converts the keys and values once). llama-1b's 4
// heads a KV head as 3 + 1 spent 13 % of a 4k-token prefill in the 1 and 21 % in the 3; AVX2
// build, 16 rows over 2k fp16 positions each, 32 heads over 8: 11.5-11.8 -> 9.8 ms. Tried: one
// group of 4 two positions a step (12.4-13.0 ms: a score's reduction then serves 2 positions),
// and the query vectors loaded once for 4 positions (slower for groups of 3: the registers).
template <class KeyAt, class ValueAt>
void attend_heads8(const float* q, int64_t count, int64_t D, const KeyAt& key, const ValueAt& value, int64_t a,
                   int64_t b, float scale, float* scores, float* o, float* mx, float* sums) {
  const int64_t groups = (count + 2) / 3;
  for (int64_t i = 0, g0 = 0; i < groups; ++i) {
    const int64_t size = (count - g0 + groups - i - 1) / (groups - i);  // the rest shared evenly
    const float* qg = q + g0 * D;
    float *og = o + g0 * D, *mg = mx + g0, *sg = sums + g0;
    switch (size) {
      case 1: attend_group8<1>(qg, D, key, value, a, b, scale, scores, og, mg, sg); break;
      case 2: attend_group8<2>(qg, D, key, value, a, b, scale, scores, og, mg, sg); break;
      default: attend_group8<3>(qg, D, key, value, a, b, scale, scores, og, mg, sg); break;
    }
    g0 += size;
  }
}

// Two rows of one sequence, r0 ending no later than r1, and their heads [h, h + G) (G <= 2) over
// fp32 rows: the 2G query vectors share each key and value read, half the reads of a row at a
// time (a prefill chunk's rows find the chunk in L2, whose bandwidth bounded the row at a time).
// Each (row, head) runs attend_group8's arithmetic: the positions both rows see go side by side,
// the rest of each row's on its own, and r1's values past r0's end continue its accumulators.
template <int G, class KeyAt, class ValueAt>
void attend_pair8(const ChunkRow& r0, const ChunkRow& r1, int64_t h, int64_t D, const KeyAt& key,
                  const ValueAt& value, int64_t a, float scale, float* scores) {
  const int64_t n0 = r0.b - a, n1 = r1.b - a;
  float *s0 = scores, *s1 = scores + G * n0;
  const float* qs[2 * G];
  const float* weights[2 * G];
  for (int g = 0; g < G; ++g) {
    qs[g] = r0.q + (h + g) * D, qs[G + g] = r1.q + (h + g) * D;
    weights[g] = s0 + g * n0, weights[G + g] = s1 + g * n1;
  }
  int64_t t = a;
  const __m128 vscale = _mm_set1_ps(scale);
  for (; t + 4 <= r0.b; t += 4) {
    __m128 four[2 * G];
    __m256 acc[2 * G][2], first[2 * G];  // 2G <= 4 queries: two pairs of positions (scores_from)
    position_dots<2 * G, 2>(qs, D, key, t, acc);
    for (int i = 0; i < 2 * G; ++i) first[i] = _mm256_hadd_ps(acc[i][0], acc[i][1]);
    position_dots<2 * G, 2>(qs, D, key, t + 2, acc);
    for (int i = 0; i < 2 * G; ++i) four[i] = sum4x8(first[i], _mm256_hadd_ps(acc[i][0], acc[i][1]));
    for (int g = 0; g < G; ++g) {
      _mm_storeu_ps(s0 + g * n0 + t - a, _mm_mul_ps(four[g], vscale));
      _mm_storeu_ps(s1 + g * n1 + t - a, _mm_mul_ps(four[G + g], vscale));
    }
  }
  scores_from<G>(qs, D, key, a, t, r0.b, n0, scale, s0);
  scores_from<G>(qs + G, D, key, a, t, r1.b, n1, scale, s1);
  for (int g = 0; g < G; ++g) {
    r0.sums[h + g] = softmax_numerators(s0 + g * n0, n0, r0.mx + h + g);
    r1.sums[h + g] = softmax_numerators(s1 + g * n1, n1, r1.mx + h + g);
  }
  constexpr int V = G == 1 ? 4 : 2;  // 2G * V accumulators
  for (int64_t c = 0; c < D; c += 8 * V) {
    __m256 out[2 * G][V];
    for (auto& head : out)
      for (auto& r : head) r = _mm256_setzero_ps();
    weigh_into<2 * G, V>(out, weights, value, a, a, r0.b, c);
    weigh_into<2 * G, V, G>(out, weights, value, a, r0.b, r1.b, c);  // r1's positions past r0's end
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < V; ++j) {
        _mm256_storeu_ps(r0.o + (h + g) * D + c + 8 * j, out[g][j]);
        _mm256_storeu_ps(r1.o + (h + g) * D + c + 8 * j, out[G + g][j]);
      }
  }
}

// the pair's `count` heads in groups of at most 2, as even as they go (D a multiple of 32 for a
// group of one: V = 4; attend_chunk_rows sends the pairs only then)
template <class KeyAt, class ValueAt>
void attend_pair_heads8(const ChunkRow& r0, const ChunkRow& r1, int64_t count, int64_t D, const KeyAt& key,
                        const ValueAt& value, int64_t a, float scale, float* scores) {
  const int64_t groups = (count + 1) / 2;
  for (int64_t i = 0, h = 0; i < groups; ++i) {
    const int64_t size = (count - h + groups - i - 1) / (groups - i);
    if (size == 1)
      attend_pair8<1>(r0, r1, h, D, key, value, a, scale, scores);
    else
      attend_pair8<2>(r0, r1, h, D, key, value, a, scale, scores);
    h += size;
  }
}
#endif

// Positions are taken in chunks of kAttnChunk from the first one a row sees. Each chunk leaves a
// partial softmax per head, and merge_partials combines them in chunk order: the same arithmetic
// whether one thread runs every chunk of a row (prefill, many rows) or the chunks are shared out
// over the threads (decode of one long sequence, so both cores read its cache).
constexpr int64_t kAttnChunk = 256;
inline int64_t attn_chunks(int64_t positions) { return (positions + kAttnChunk - 1) / kAttnChunk; }

// What one thread's attention needs besides the cache: scores, and (without AVX-512) the chunk's
// rows in fp32
struct AttnScratch {
  std::vector<float> scores, keys, values;
};


// The partial softmaxes of chunk [a, rows[i].b) for each of `n_rows` rows (rows of one sequence:
// the same keys and values, each to its own end) and their `count` query heads sharing one KV
// head, whose rows key(t) / value(t) give as readers (kv_store.h). The chunk is read from memory
// once for all the rows: a speculated step's guessed rows (engine/speculation.py) and a prefill
// chunk's rows then cost their arithmetic, not another pass over the cache. Each (row, head)
// runs the arithmetic it runs alone, so its partials do not depend on its company.
// Measured (AVX2 build, SmolLM2's 9 heads over 3 KV heads at 8k fp16 positions, 2 threads, one
// layer, 8k fp16 positions): 4 rows of one sequence 11.5 ms -> 1.87 (then 0.97 with attend_group8).
template <class KeyAt, class ValueAt>
void attend_chunk_rows(int64_t D, int64_t count, const ChunkRow* rows, int64_t n_rows, const KeyAt& key,
                       const ValueAt& value, int64_t a, float scale, AttnScratch& s) {
  int64_t b = a;
  for (int64_t r = 0; r < n_rows; ++r) b = std::max(b, rows[r].b);
  const int64_t n = b - a;
#ifdef TW_AVX512
  if (grouped_attention(D)) {  // each row in turn: its chunk is in L2 after the first
    s.scores.resize(4 * n);
    for (int64_t r = 0; r < n_rows; ++r) {
      const ChunkRow& row = rows[r];
      auto run = [&](auto qv) {
        constexpr int QV = decltype(qv)::value;
        attend_heads<QV>(row.q, count, key, value, a, row.b, scale, s.scores.data(), row.o, row.mx, row.sums);
      };
      switch (D / 16) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 7: run(std::integral_constant<int, 7>{}); break;
        case 8: run(std::integral_constant<int, 8>{}); break;
        default: run(std::integral_constant<int, 16>{}); break;  // grouped_attention: D = 256
      }
    }
    return;
  }
#endif
#ifdef TW_AVX2
  if (D % 16 == 0) {  // each row in turn: its chunk is in L2 after the first
    s.scores.resize(3 * n);
    auto each_row = [&](const auto& row_key, const auto& row_value) {
      for (int64_t r = 0; r < n_rows; ++r) {
        const ChunkRow& row = rows[r];
        attend_heads8(row.q, count, D, row_key, row_value, a, row.b, scale, s.scores.data(), row.o, row.mx,
                      row.sums);
      }
    };
    if (n_rows == 1 || std::is_same_v<decltype(key(a)), KvF32>) return each_row(key, value);
    // Several rows (a prefill chunk's, a step's guesses): the chunk converted to fp32 once for all
    // of them rather than once a row and group of heads (fp16 -> fp32 and q8's scale are exact
    // and the same products, so the same bits as the row alone)
    s.keys.resize(n * D);
    s.values.resize(n * D);
    for (int64_t t = a; t < b; ++t) {
      key(t).to_floats(D, s.keys.data() + (t - a) * D);
      value(t).to_floats(D, s.values.data() + (t - a) * D);
    }
    const float *keys = s.keys.data() - a * D, *values = s.values.data() - a * D;
    auto fkey = [&](int64_t t) { return KvF32{keys + t * D}; };
    auto fvalue = [&](int64_t t) { return KvF32{values + t * D}; };
    if (D % 32 != 0) return each_row(fkey, fvalue);
    // two rows at a time (attend_pair8), an odd last one alone
    s.scores.resize(4 * n);
    int64_t r = 0;
    for (; r + 1 < n_rows; r += 2) {
      const bool ordered = rows[r].b <= rows[r + 1].b;
      const ChunkRow &r0 = ordered ? rows[r] : rows[r + 1], &r1 = ordered ? rows[r + 1] : rows[r];
      attend_pair_heads8(r0, r1, count, D, fkey, fvalue, a, scale, s.scores.data());
    }
    if (r < n_rows)
      attend_heads8(rows[r].q, count, D, fkey, fvalue, a, rows[r].b, scale, s.scores.data(), rows[r].o, rows[r].mx,
                    rows[r].sums);
    return;
  }
#endif
  // each head on its own, over the chunk's rows in fp32, converted once for all the rows
  s.scores.resize(n);
  s.keys.resize(n * D);
  s.values.resize(n * D);
  for (int64_t t = a; t < b; ++t) {
    key(t).to_floats(D, s.keys.data() + (t - a) * D);
    value(t).to_floats(D, s.values.data() + (t - a) * D);
  }
  auto key_row = [&](int64_t t) { return s.keys.data() + (t - a) * D; };
  auto value_row = [&](int64_t t) { return s.values.data() + (t - a) * D; };
  for (int64_t r = 0; r < n_rows; ++r) {
    const ChunkRow& row = rows[r];
    for (int64_t h = 0; h < count; ++h) {
      key_scores(row.q + h * D, key_row, a, row.b, D, scale, s.scores.data());
      row.sums[h] = softmax_numerators(s.scores.data(), row.b - a, row.mx + h);
      weigh_values(s.scores.data(), value_row, a, row.b, D, row.o + h * D);
    }
  }
}

// One head's output from its n chunks' partial softmaxes (chunk c: o + c * o_stride, mx and sums
// at c * s_stride): out = sum_c w_c o_c in chunk order, w_c = e^(mx_c - M) / sum_c e^(mx_c - M)
// sums_c, M the largest mx. One chunk: out = o / sum. out may be chunk 0's o.
inline void merge_partials(const float* o, int64_t o_stride, const float* mx, const float* sums, int64_t s_stride,
                           int64_t n, int64_t D, float* out) {
  float top = -INFINITY, total = 0;
  for (int64_t c = 0; c < n; ++c) top = std::max(top, mx[c * s_stride]);
  thread_local std::vector<float> weights;
  weights.resize(n);
  for (int64_t c = 0; c < n; ++c) {
    weights[c] = std::exp(mx[c * s_stride] - top);
    total += weights[c] * sums[c * s_stride];
  }
  for (int64_t c = 0; c < n; ++c) weights[c] /= total;
  for (int64_t i = 0; i < D; ++i) {
    float acc = weights[0] * o[i];
    for (int64_t c = 1; c < n; ++c) acc += weights[c] * o[c * o_stride + i];
    out[i] = acc;
  }
}

// Calls f with a value of the reader type of a cache's storage (kv_store.h)
template <class F>
void with_kv_reader(KvType type, F&& f) {
  switch (type) {
    case kKvF32: return f(KvF32{});
    case kKvF16: return f(KvF16{});
    case kKvBF16: return f(KvBF16{});
    case kKvQ8: return f(KvQ8{});
  }
}

}  // namespace tw
