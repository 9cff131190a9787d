// The attention of one step's rows over the paged KV cache, shared out over a team of threads:
// the fused decode stack's (decode_stack.h) and the paged_attention op's, which tests hold
// against a float64 reference. Row m is a query at position pos[m] of the sequence whose KV
// blocks block_tables[m] lists; it sees positions [from, pos[m]] (from = 0, or its window's).
// Rows of one sequence go in groups (a decode row and its guesses, a prefill chunk's rows), and
// each chunk of positions is read once for the group. Tasks are (group, KV head) with all of the
// group's position chunks, or, when the groups are too few to keep every thread busy (decode of
// one long sequence), (group's chunk, KV head) with the partial softmaxes merged after a barrier:
// attention.h's arithmetic is the same either way, so a row's output does not depend on its company.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via decode_stack.h).
#pragma once

#include "attention.h"

namespace tw {

// thread tid's share [a, b) of n items
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt) { return {n * tid / nt, n * (tid + 1) / nt}; }

// thread tid's share [a, b) of n items whose costs have the prefix sums before[0..n] (before[i]:
// the cost of items [0, i)): the items whose cost starts in its nt-th of the total
inline std::pair<int64_t, int64_t> share_by_cost(const std::vector<int64_t>& before, int tid, int nt) {
  const int64_t n = static_cast<int64_t>(before.size()) - 1, total = before[n];
  auto first_from = [&](int64_t cost) {
    return std::lower_bound(before.begin(), before.end() - 1, cost) - before.begin();
  };
  return {first_from(total * tid / nt), tid + 1 == nt ? n : first_from(total * (tid + 1) / nt)};
}

// Rows of one sequence (consecutive rows, positions non-decreasing, the same blocks) go together,
// at most attn_group_rows of them: each chunk of their cache is read (AVX2: converted to fp32)
// once for all of them (attend_chunk_rows), and each row's partial softmaxes over every chunk,
// rows x rep x D floats a chunk, wait for the merge. 16 rows keep a 512-row prefill chunk at 32
// groups. Where the chunk is converted, up to 64 while those partials stay within 16K floats a
// chunk (64 KB), so llama-1b (4 heads of 64 a KV head) and SmolLM2 take 64 and qwen2.5 (6 of
// 128) and gemma3 (4 of 256) keep 16. Measured (AVX2 build, 2 threads, one 512-row prefill
// chunk's attention, positions 3,584-4,095, fp16 cache, 8-10 alternating rounds, medians): 64
// rows against 16, llama-1b 1.36x (conversion was a fifth of its time), SmolLM2 1.08x; qwen2.5
// 0.97x and gemma3 0.99x, which is why they keep 16.
inline int64_t attn_group_rows(int64_t rep, int64_t D) {
  int64_t rows = 16;
  if (!grouped_attention(D))
    while (rows < 64 && 2 * rows * rep * D <= 16384) rows *= 2;
  return rows;
}

struct PagedAttention {
  int64_t num_heads, num_kv_heads, D, M, max_blocks, bs, group_rows;
  const int64_t* pos;
  const int64_t* tables;
  bool split;
  std::vector<uint8_t> joins;  // joins[m]: row m may share row m - 1's group (same blocks, pos not lower)
  std::vector<float> part_o, part_mx, part_sum;  // split: each chunk's partial softmaxes, all heads

  // what one thread keeps between layers
  struct Thread {
    std::vector<int64_t> chunk_first, from, group_first, group_chunk_first, task_cost, rows = std::vector<int64_t>(kAttnChunk);
    std::vector<float> o, mx, sum;
    std::vector<ChunkRow> chunk_rows;
    AttnScratch scratch;
  };

  PagedAttention(int64_t heads, int64_t kv_heads, int64_t dim, int64_t rows, const int64_t* positions,
                 const int64_t* block_tables, int64_t table_width, int64_t block_size, int threads,
                 int split_mode = -1)  // -1: by the rows and threads; 0 / 1: never / always (tests)
      : num_heads(heads), num_kv_heads(kv_heads), D(dim), M(rows), max_blocks(table_width), bs(block_size),
        group_rows(attn_group_rows(heads / kv_heads, dim)), pos(positions), tables(block_tables), joins(rows, 0) {
    int64_t chunks = 0, groups = 0, group_chunks = 0, size = 0;  // without a window: the most any layer has
    for (int64_t m = 0; m < M; ++m) {
      chunks += attn_chunks(pos[m] + 1);
      if (m > 0 && pos[m] >= pos[m - 1])
        joins[m] = std::equal(tables + m * max_blocks, tables + m * max_blocks + pos[m] / bs + 1,
                              tables + (m - 1) * max_blocks);
      if (!joins[m] || size == group_rows) ++groups, size = 0;
      ++size;
      if (m + 1 == M || !joins[m + 1] || size == group_rows) group_chunks += attn_chunks(pos[m] + 1);
    }
    // a few groups (decode of one long sequence, with or without guesses): their chunks shared out
    split = split_mode < 0 ? groups * num_kv_heads < 8 * threads && group_chunks > groups : split_mode == 1;
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
    if (M == 0) return;
    th.chunk_first.assign(M + 1, 0);
    th.from.resize(M);
    th.group_first.clear();
    th.group_chunk_first.assign(1, 0);
    for (int64_t m = 0; m < M; ++m) {
      th.from[m] = window > 0 ? std::max<int64_t>(0, pos[m] + 1 - window) : 0;
      th.chunk_first[m + 1] = th.chunk_first[m] + attn_chunks(pos[m] + 1 - th.from[m]);
      // a group's rows start their chunks at one position (a window moves it with the row)
      if (m == 0 || !joins[m] || th.from[m] != th.from[m - 1] || m - th.group_first.back() == group_rows) {
        if (m > 0) th.group_chunk_first.push_back(th.group_chunk_first.back() + th.chunk_first[m] - th.chunk_first[m - 1]);
        th.group_first.push_back(m);
      }
    }
    th.group_first.push_back(M);  // a group's last row has its most chunks (positions non-decreasing)
    th.group_chunk_first.push_back(th.group_chunk_first.back() + th.chunk_first[M] - th.chunk_first[M - 1]);
    const int64_t groups = static_cast<int64_t>(th.group_first.size()) - 1;
    // chunk c of group g's rows for the rep query heads of KV head u: row m's partial softmaxes at
    // o + index(m) * o_stride (head stride D), mx and sums + index(m) * s_stride
    auto attend = [&](int64_t g, int64_t u, int64_t c, float* o, int64_t o_stride, float* mx, float* sums,
                      int64_t s_stride, auto index) {
      const int64_t r0 = th.group_first[g], r1 = th.group_first[g + 1], last = r1 - 1;
      const int64_t* table = tables + last * max_blocks;  // every row's blocks (joins)
      const int64_t a = th.from[r0] + c * kAttnChunk, b = std::min(pos[last] + 1, a + kAttnChunk);
      th.chunk_rows.clear();
      for (int64_t m = r0; m < r1; ++m)
        if (pos[m] >= a) {
          const int64_t i = index(m);
          th.chunk_rows.push_back({q + m * q_stride + u * rep * D, std::min(pos[m] + 1, b), o + i * o_stride,
                                   mx + i * s_stride, sums + i * s_stride});
        }
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
        attend_chunk_rows(D, rep, th.chunk_rows.data(), static_cast<int64_t>(th.chunk_rows.size()), key, value, a,
                          scale, th.scratch);
      });
    };
    if (!split) {  // (group, KV head): every chunk here, merged here
      // shared by the positions the tasks' rows see, not by their count: a prefill chunk's later
      // groups see more, and even counts left thread 0 a quarter of a prompt's first chunk
      // (2 threads, 512-row chunks: the attention of a 1,000-token prompt took 1.24x the time
      // of an even split, 4,096 tokens 1.06x). Which thread runs a task does not change its bits.
      th.task_cost.assign(1, 0);
      for (int64_t g = 0; g < groups; ++g) {
        int64_t seen = 0;
        for (int64_t m = th.group_first[g]; m < th.group_first[g + 1]; ++m) seen += pos[m] + 1 - th.from[m];
        for (int64_t u = 0; u < num_kv_heads; ++u) th.task_cost.push_back(th.task_cost.back() + seen);
      }
      const auto [t0, t1] = share_by_cost(th.task_cost, tid, nt);
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t g = task / num_kv_heads, u = task % num_kv_heads;
        const int64_t r0 = th.group_first[g], r1 = th.group_first[g + 1], base = th.chunk_first[r0];
        const int64_t n = th.chunk_first[r1] - base;  // every row's chunks
        th.o.resize(n * rep * D);
        th.mx.resize(n * rep);
        th.sum.resize(n * rep);
        for (int64_t c = 0; c < th.group_chunk_first[g + 1] - th.group_chunk_first[g]; ++c)
          attend(g, u, c, th.o.data(), rep * D, th.mx.data(), th.sum.data(), rep,
                 [&](int64_t m) { return th.chunk_first[m] - base + c; });
        for (int64_t m = r0; m < r1; ++m)
          for (int64_t h = 0; h < rep; ++h) {
            const int64_t first = th.chunk_first[m] - base;
            merge_partials(th.o.data() + first * rep * D + h * D, rep * D, th.mx.data() + first * rep + h,
                           th.sum.data() + first * rep + h, rep, th.chunk_first[m + 1] - th.chunk_first[m], D,
                           out + m * q_size + (u * rep + h) * D);
          }
      }
      return;
    }
    const auto [t0, t1] = share(th.group_chunk_first[groups] * num_kv_heads, tid, nt);  // (group's chunk, KV head)
    int64_t g = 0;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t chunk = task / num_kv_heads, u = task % num_kv_heads;
      while (th.group_chunk_first[g + 1] <= chunk) ++g;
      const int64_t c = chunk - th.group_chunk_first[g];
      attend(g, u, c, part_o.data() + u * rep * D, q_size, part_mx.data() + u * rep, part_sum.data() + u * rep,
             num_heads, [&](int64_t m) { return th.chunk_first[m] + c; });
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
