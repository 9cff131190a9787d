// The attention of one step's rows over the paged KV cache, shared out over a team of threads:
// the fused decode stack's (decode_stack.h) and the paged_attention op's, which tests hold
// against a float64 reference. Row m is a query at position pos[m] of the sequence whose KV
// blocks block_tables[m] lists; it sees positions [from, pos[m]] (from = 0, or its window's).
// Tasks are (row, KV head) with all of the row's position chunks, or, when the rows are too few
// to keep every thread busy (decode of one long sequence), (chunk, KV head) with the partial
// softmaxes merged after a barrier: attention.h's arithmetic is the same either way, so a row's
// output does not depend on its company.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via decode_stack.h).
#pragma once

#include "attention.h"

namespace tw {

// thread tid's share [a, b) of n items
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt) { return {n * tid / nt, n * (tid + 1) / nt}; }

struct PagedAttention {
  int64_t num_heads, num_kv_heads, D, M, max_blocks, bs;
  const int64_t* pos;
  const int64_t* tables;
  bool split;
  std::vector<float> part_o, part_mx, part_sum;  // split: each chunk's partial softmaxes, all heads

  // what one thread keeps between layers
  struct Thread {
    std::vector<int64_t> chunk_first, from, rows = std::vector<int64_t>(kAttnChunk);
    std::vector<float> o, mx, sum;
    AttnScratch scratch;
  };

  PagedAttention(int64_t heads, int64_t kv_heads, int64_t dim, int64_t rows, const int64_t* positions,
                 const int64_t* block_tables, int64_t table_width, int64_t block_size, int threads,
                 int split_mode = -1)  // -1: by the rows and threads; 0 / 1: never / always (tests)
      : num_heads(heads), num_kv_heads(kv_heads), D(dim), M(rows), max_blocks(table_width), bs(block_size),
        pos(positions), tables(block_tables) {
    int64_t chunks = 0;  // without a window: the most any layer has
    for (int64_t m = 0; m < M; ++m) chunks += attn_chunks(pos[m] + 1);
    split = split_mode < 0 ? M * num_kv_heads < 8 * threads && chunks > M : split_mode == 1;
    if (split) {
      part_o.resize(chunks * num_heads * D);
      part_mx.resize(chunks * num_heads);
      part_sum.resize(chunks * num_heads);
    }
  }

  // Every thread, for one layer: q [M, q_stride] (row m's head h at q + m * q_stride + h * D),
  // out [M, num_heads * D]. Split, out is written by merge() after a barrier.
  void tasks(Thread& th, const KvCacheView& k, const KvCacheView& v, int64_t window, float scale, const float* q,
             int64_t q_stride, float* out, int tid, int nt) {
    const int64_t rep = num_heads / num_kv_heads, q_size = num_heads * D, kv_size = num_kv_heads * D;
    th.chunk_first.assign(M + 1, 0);
    th.from.resize(M);
    for (int64_t m = 0; m < M; ++m) {
      th.from[m] = window > 0 ? std::max<int64_t>(0, pos[m] + 1 - window) : 0;
      th.chunk_first[m + 1] = th.chunk_first[m] + attn_chunks(pos[m] + 1 - th.from[m]);
    }
    // chunks [c0, c1) of row m for the rep query heads of KV head u: partial softmaxes at o
    // (chunk stride o_stride, head stride D), mx and sums (chunk stride s_stride)
    auto attend = [&](int64_t m, int64_t u, int64_t c0, int64_t c1, float* o, int64_t o_stride, float* mx,
                      float* sums, int64_t s_stride) {
      const int64_t* table = tables + m * max_blocks;
      const float* qm = q + m * q_stride + u * rep * D;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t a = th.from[m] + c * kAttnChunk, b = std::min(pos[m] + 1, a + kAttnChunk);
        // where each position's row starts, stepping through the blocks (a division per
        // position was a third of the attention's time at 4k positions)
        int64_t block = a / bs, offset = a % bs;
        for (int64_t t = a; t < b; ++t) {
          th.rows[t - a] = (table[block] * bs + offset) * kv_size + u * D;
          if (++offset == bs) ++block, offset = 0;
        }
        const int64_t* rows = th.rows.data() - a;
        with_kv_reader(k.type, [&](auto reader) {
          using R = decltype(reader);
          auto key = [&](int64_t t) { return R::at(k.data, k.scales, rows[t]); };
          auto value = [&](int64_t t) { return R::at(v.data, v.scales, rows[t]); };
          attend_chunk(D, qm, rep, key, value, a, b, scale, th.scratch, o + (c - c0) * o_stride,
                       mx + (c - c0) * s_stride, sums + (c - c0) * s_stride);
        });
      }
    };
    if (!split) {  // (row, KV head): every chunk here, merged here
      const auto [t0, t1] = share(M * num_kv_heads, tid, nt);
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t m = task / num_kv_heads, u = task % num_kv_heads, n = th.chunk_first[m + 1] - th.chunk_first[m];
        th.o.resize(n * rep * D);
        th.mx.resize(n * rep);
        th.sum.resize(n * rep);
        attend(m, u, 0, n, th.o.data(), rep * D, th.mx.data(), th.sum.data(), rep);
        for (int64_t g = 0; g < rep; ++g)
          merge_partials(th.o.data() + g * D, rep * D, th.mx.data() + g, th.sum.data() + g, rep, n, D,
                         out + m * q_size + (u * rep + g) * D);
      }
      return;
    }
    const auto [t0, t1] = share(th.chunk_first[M] * num_kv_heads, tid, nt);  // (chunk, KV head)
    int64_t m = 0;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t chunk = task / num_kv_heads, u = task % num_kv_heads;
      while (th.chunk_first[m + 1] <= chunk) ++m;
      const int64_t c = chunk - th.chunk_first[m];
      attend(m, u, c, c + 1, part_o.data() + chunk * q_size + u * rep * D, q_size,
             part_mx.data() + chunk * num_heads + u * rep, part_sum.data() + chunk * num_heads + u * rep, num_heads);
    }
  }

  // Split only, after a barrier that follows every thread's tasks(): the (row, head) merges
  void merge(const Thread& th, float* out, int tid, int nt) {
    const int64_t q_size = num_heads * D;
    const auto [h0, h1] = share(M * num_heads, tid, nt);
    for (int64_t task = h0; task < h1; ++task) {
      const int64_t row = task / num_heads, head = task % num_heads, c0 = th.chunk_first[row];
      merge_partials(part_o.data() + c0 * q_size + head * D, q_size, part_mx.data() + c0 * num_heads + head,
                     part_sum.data() + c0 * num_heads + head, num_heads, th.chunk_first[row + 1] - c0, D,
                     out + row * q_size + head * D);
    }
  }
};

}  // namespace tw
