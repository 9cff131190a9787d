// Attention over the paged cache for the fused decode stack: a row's positions in chunks, each
// chunk's partial softmaxes per query head (attention_softmax.h's arithmetic; AVX-512 and AVX2
// groups of heads sharing a KV head in attention_avx512.h / attention_avx2.h) and their merge.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via decode_stack.h).
#pragma once

#include "attention_avx2.h"
#include "attention_avx512.h"

namespace tw {

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

// positions [a, b) of a chunk's keys and values into s.keys / s.values in fp32 (exact: fp16, bf16
// and q8's one product per value are the readers' own load8 values)
template <class KeyAt, class ValueAt>
void chunk_to_floats(const KeyAt& key, const ValueAt& value, int64_t a, int64_t b, int64_t D, AttnScratch& s) {
  s.keys.resize((b - a) * D);
  s.values.resize((b - a) * D);
  for (int64_t t = a; t < b; ++t) {
    key(t).to_floats(D, s.keys.data() + (t - a) * D);
    value(t).to_floats(D, s.values.data() + (t - a) * D);
  }
}


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
    s.scores.resize(4 * n);  // a row's 3 heads, or a pair's 2 heads each
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
    chunk_to_floats(key, value, a, b, D, s);
    const float *keys = s.keys.data() - a * D, *values = s.values.data() - a * D;
    auto fkey = [&](int64_t t) { return KvF32{keys + t * D}; };
    auto fvalue = [&](int64_t t) { return KvF32{values + t * D}; };
    if (D % 32 != 0) return each_row(fkey, fvalue);
    // two rows at a time (attend_pair8), an odd last one alone
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
  chunk_to_floats(key, value, a, b, D, s);
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
