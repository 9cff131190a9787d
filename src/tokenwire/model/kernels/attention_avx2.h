// AVX2 attention: groups of up to 3 query heads sharing a KV head, four positions' keys side by
// side, and a prefill group's rows two at a time (attention.h chooses it).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via attention.h).
#pragma once

#include "attention_softmax.h"

namespace tw {

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

// Scores of positions [t, b) for Q query vectors, query i's at out[i][position - a]: four
// positions at a time (Q <= 2: their keys side by side, 4Q chains; more: two pairs, 2Q chains and
// the first pair's sums held, the 16 registers), then the last 1-3 padded with zero sums
template <int Q, class KeyAt>
inline void scores_from(const float* const* qs, int64_t D, const KeyAt& key, int64_t a, int64_t t, int64_t b,
                        float scale, float* const* out) {
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
    for (int i = 0; i < Q; ++i) _mm_storeu_ps(out[i] + t - a, _mm_mul_ps(four[i], vscale));
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
    for (int p = 0; p < valid; ++p) out[i][t + p - a] = four[p];
  }
}

// The weighed values of Q queries, out[i][0 .. D) = sum over positions of weights[i][position - a]
// * value(position): queries [0, Split) over [a, b), queries [Split, Q) over [a, b_rest) (a pair's
// longer row continues its accumulators past the shorter one's end). 8-lane FMAs in position
// order (as weigh_values), 8V values of each output a pass: Q * V chains in flight.
template <int Q, int V, int Split, class ValueAt>
inline void weigh_rows(const float* const* weights, const ValueAt& value, int64_t a, int64_t b, int64_t b_rest,
                       int64_t D, float* const* out) {
  auto accumulate = [&](__m256(&acc)[Q][V], int first, int64_t t0, int64_t t1, int64_t c) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto v = value(t);
      __m256 vv[V];
      for (int j = 0; j < V; ++j) vv[j] = v.load8(c + 8 * j);
      for (int i = first; i < Q; ++i) {
        const __m256 w = _mm256_set1_ps(weights[i][t - a]);
        for (int j = 0; j < V; ++j) acc[i][j] = _mm256_fmadd_ps(w, vv[j], acc[i][j]);
      }
    }
  };
  for (int64_t c = 0; c < D; c += 8 * V) {
    __m256 acc[Q][V];
    for (auto& query : acc)
      for (auto& r : query) r = _mm256_setzero_ps();
    accumulate(acc, 0, a, b, c);
    if constexpr (Split < Q) accumulate(acc, Split, b, b_rest, c);
    for (int i = 0; i < Q; ++i)
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(out[i] + c + 8 * j, acc[i][j]);
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
  float *heads[G], *outs[G];
  for (int g = 0; g < G; ++g) qs[g] = q + g * D, heads[g] = scores + g * n, outs[g] = o + g * D;
  scores_from<G>(qs, D, key, a, a, b, scale, heads);
  for (int g = 0; g < G; ++g) sums[g] = softmax_numerators(heads[g], n, mx + g);
  // each head's output 8V values a pass: G * V accumulators and V value vectors in registers
  constexpr int kWide = G == 1 ? 8 : G == 2 ? 4 : 2;
  if (D % (8 * kWide) == 0)
    weigh_rows<G, kWide, G>(heads, value, a, b, b, D, outs);
  else
    weigh_rows<G, 2, G>(heads, value, a, b, b, D, outs);
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
  const float* qs[2 * G];
  float *heads[2 * G], *outs[2 * G];
  for (int g = 0; g < G; ++g) {
    qs[g] = r0.q + (h + g) * D, qs[G + g] = r1.q + (h + g) * D;
    heads[g] = scores + g * n0, heads[G + g] = scores + G * n0 + g * n1;
    outs[g] = r0.o + (h + g) * D, outs[G + g] = r1.o + (h + g) * D;
  }
  const int64_t both = a + n0 / 4 * 4;  // the four-position groups both rows see whole
  scores_from<2 * G>(qs, D, key, a, a, both, scale, heads);
  scores_from<G>(qs, D, key, a, both, r0.b, scale, heads);
  scores_from<G>(qs + G, D, key, a, both, r1.b, scale, heads + G);
  for (int g = 0; g < G; ++g) {
    r0.sums[h + g] = softmax_numerators(heads[g], n0, r0.mx + h + g);
    r1.sums[h + g] = softmax_numerators(heads[G + g], n1, r1.mx + h + g);
  }
  weigh_rows<2 * G, G == 1 ? 4 : 2, G>(heads, value, a, r0.b, r1.b, D, outs);  // 2G * V accumulators
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

}  // namespace tw
