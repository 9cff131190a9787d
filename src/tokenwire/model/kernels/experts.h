// A mixture of experts inside the fused decode step (decode_stack.h): the router, each row's
// chosen experts, the experts run on just their rows. Part of tokenwire's CPU kernels:
// included once, by quant_cpu.cpp.
#pragma once

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "stack_parts.h"

namespace tw {

// A mixture of experts in place of the dense MLP: a float32 router [experts, hidden] and each
// expert's gate/up (a Proj: its parts may differ in type) and down; `top_k` experts a token,
// their router probabilities renormalised to sum 1 when `normalize` (Mixtral, Qwen3-MoE).
struct Experts {
  at::Tensor router;
  std::vector<Proj> gate_up;
  std::vector<at::Tensor> down;
  std::vector<int64_t> down_type;
  int64_t top_k = 0, inter = 0;
  bool normalize = false;
};

// A layer of experts for rows h [M, H] (every thread holds them), inside the stack's parallel
// region; the summed output into proj [M, H]. Three phases, a barrier after each: the router's
// logits (experts shared out), every chosen expert on just its rows (whole experts shared out,
// in the same order in every thread: an expert's rows are gathered, its gate/up, gated
// activation and down run on them as one small batch), then each row's outputs summed in
// ascending expert order (columns shared out). A row's arithmetic depends only on its own
// values and experts, whatever else is in the batch.
inline void run_experts(const Experts& E, const float* h, int64_t M, int64_t H, int64_t activation, float* logits,
                        float* out, float* proj, int tid, int nt, SpinThenSleepBarrier& barrier, bool omp_barrier,
                        int64_t& my_wait, bool int16) {
  const int64_t count = E.router.size(0), k = E.top_k, I = E.inter;
  const float* router = E.router.data_ptr<float>();
  const auto [e0, e1] = share(count, tid, nt);
  // eight running sums a logit, added up in one order at the end (a single chain of dependent
  // adds took 4 cycles a weight: ~1 ms of a 16-layer OLMoE token)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t e = e0; e < e1; ++e) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const float* a = h + m * H;
      const float* w = router + e * H;
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * w[i + j];
      for (; i < H; ++i) acc[i % 8] += a[i] * w[i];
      logits[m * count + e] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
SYNC
  // every thread picks the same experts: the top k of each row's softmax, lowest index first
  // among equals, their probabilities renormalised where the family does; kept in expert order
  std::vector<int64_t> chosen(M * k);
  std::vector<float> weight(M * k), probs(count);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows_of(count);  // expert -> (row, slot)
  for (int64_t m = 0; m < M; ++m) {
    const float* lg = logits + m * count;
    const float top = *std::max_element(lg, lg + count);
    float sum = 0;
    for (int64_t e = 0; e < count; ++e) sum += (probs[e] = std::exp(lg[e] - top));
    std::vector<int64_t> order(count);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
    std::sort(order.begin(), order.begin() + k);
    float picked = 0;
    for (int64_t j = 0; j < k; ++j) picked += probs[order[j]] / sum;
    for (int64_t j = 0; j < k; ++j) {
      const float p = probs[order[j]] / sum;
      chosen[m * k + j] = order[j];
      weight[m * k + j] = E.normalize ? p / picked : p;
      rows_of[order[j]].emplace_back(m, j);
    }
  }
  // experts to threads, most rows first, each to the thread with the fewest rows so far (ties:
  // the lower thread): every thread makes the same plan; an expert's arithmetic does not
  // depend on the thread that runs it
  std::vector<int64_t> busy, load(nt, 0), mine;
  for (int64_t e = 0; e < count; ++e)
    if (!rows_of[e].empty()) busy.push_back(e);
  std::stable_sort(busy.begin(), busy.end(), [&](int64_t a, int64_t b) { return rows_of[a].size() > rows_of[b].size(); });
  for (const int64_t e : busy) {
    const int t = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[t] += static_cast<int64_t>(rows_of[e].size());
    if (t == tid) mine.push_back(e);
  }
  std::vector<float> x, gu, act, y;
  QuantizedActivations qa;
  for (const int64_t e : mine) {
    const int64_t r = static_cast<int64_t>(rows_of[e].size());
    x.resize(r * H);
    for (int64_t j = 0; j < r; ++j) std::memcpy(x.data() + j * H, h + rows_of[e][j].first * H, H * sizeof(float));
    gu.resize(r * 2 * I);
    proj_rows(x.data(), r, H, E.gate_up[e], {{0, 2 * I}}, gu.data(), int16, qa);
    act.resize(r * I);
    for (int64_t j = 0; j < r; ++j) gated(gu.data() + j * 2 * I, gu.data() + j * 2 * I + I, act.data() + j * I, I, activation);
    y.resize(r * H);
    const QuantizedActivations* q = quantized_for(act.data(), r, I, E.down_type[e], int16, qa);
    matvec_rows(act.data(), q, r, I, E.down[e], E.down_type[e], 0, H, y.data());
    for (int64_t j = 0; j < r; ++j) {
      const auto [m, slot] = rows_of[e][j];
      std::memcpy(out + (m * k + slot) * H, y.data() + j * H, H * sizeof(float));
    }
  }
SYNC
  const auto [c0, c1] = share(H, tid, nt);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = c0; i < c1; ++i) {
      float acc = 0;
      for (int64_t j = 0; j < k; ++j) acc += out[(m * k + j) * H + i] * weight[m * k + j];
      proj[m * H + i] = acc;
    }
SYNC
}

}  // namespace tw
