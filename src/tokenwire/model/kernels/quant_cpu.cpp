// CPU kernels for GGUF block-quantised weights (the types of type_table.h), kept in the file's
// own blocks, and the fused decode step of a Llama decoder stack: the torch ops and class. The
// kernels live in headers this file alone includes (blocks.h -> types_*.h -> type_table.h ->
// matvec.h -> stack_parts.h -> experts.h -> decode_stack.h).
//
// Why our own kernels (measured on the 2-core AVX2 machine, SmolLM2-135M, all matmuls of one
// decode step): torch's int4 weight-only kernel takes 134 ms with fp32 activations and 10.8 ms
// with bf16 ones (which also changes the numerics); fp32 MKL takes 38.6 ms and runs a matvec on
// one core. Dequantising a block in registers and multiplying with fp32 activations reads 4.5
// bits per weight, uses both cores and keeps the fp32 path's numerics up to summation order.
// The fused stack removes ~30 framework dispatches per layer (8.5 ms of a 30-layer step).
//
// Numerics: a weight is dequantised exactly as gguf's reference (d*q, d*(q-8), d*q+m: the
// product d*q is exact in fp32, so d*q+m rounds once whether fused or not), then multiplied
// by fp32 activations with fp32 accumulation. Compiled with -ffp-contract=off so scalar code
// rounds where it is written (RoPE, RMSNorm match the PyTorch expressions operation for
// operation).
#include <torch/library.h>

#include "decode_stack.h"

namespace tw {

// qmatmul's work below which a parallel region (one per call) costs more than it saves: a
// fork/join is a few us on an idle core pair but, when the other core is busy, a barrier waits
// for its time slice. qmatmul serves the lm_head and unfused steps; the fused decode stack
// shares out all its work in one region per step instead (decode_stack.h).
constexpr int64_t kMinParallelWeights = 1 << 19;

inline int64_t rows_per_task(int64_t K, int64_t M) {
  return std::max<int64_t>(16, kMinParallelWeights / std::max<int64_t>(1, K * M));
}

// x [M, K] fp32 contiguous -> [M, N]. `wide`: a type whose integer dot takes int8 activations
// gets ~15-bit ones as two int8 rows (tiles.h's quantize_rows_i8_pair); the others' int16 are
// already as fine.
void qmatmul_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& out, bool int16_rows,
                  bool wide) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const ActFormat* format = type_row(qtype).act;
  const bool int16 = kInt16Rows && int16_rows && format != nullptr;
  if (int16 && wide && format == &act_format_i8()) {
    QuantizedActivations acts;
    quantize_rows_i8_pair(xp, M, K, *format, acts);
    std::vector<float> halves(2 * M * N);
    const int64_t grain = 2 * M < 4 ? rows_per_task(K, 2 * M) : (N + at::get_num_threads() - 1) / at::get_num_threads();
    at::parallel_for(0, N, g_team.solo() ? N : grain, [&](int64_t a, int64_t b) {
      matvec_rows(xp, &acts, 2 * M, K, w, qtype, a, b, halves.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = a; n < b; ++n) op[m * N + n] = halves[m * N + n] + halves[(M + m) * N + n];
    });
    return;
  }
  if (M < 4 || int16) {
    QuantizedActivations acts;
    if (int16) acts.quantize(xp, M, K, *format);
    // many rows: one task per thread (each copies the activations into its groups once)
    const int64_t grain = M < 4 ? rows_per_task(K, M) : (N + at::get_num_threads() - 1) / at::get_num_threads();
    at::parallel_for(0, N, g_team.solo() ? N : grain, [&](int64_t a, int64_t b) {
      matvec_rows(xp, int16 ? &acts : nullptr, M, K, w, qtype, a, b, op);
    });
  } else {
    // tasks are groups of kRows weight rows (the tile's height)
    at::parallel_for(0, (N + kRows - 1) / kRows, 8, [&](int64_t a, int64_t b) {
      matvec_rows(xp, nullptr, M, K, w, qtype, kRows * a, std::min(N, kRows * b), op);
    });
  }
}

// int16_rows: take int16 activations (when set_int16_activations is on), for any number of rows;
// the lm_head of a fused decode step: SmolLM2 5.4 -> 3.4 ms (min of 60, one thread, loaded machine)
at::Tensor qmatmul(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, bool int16_rows, bool wide) {
  TORCH_CHECK(x_in.dtype() == at::kFloat, "activations must be float32");
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  check_weight(w, qtype, x.size(1));
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) > 0) qmatmul_into(x, w, qtype, out, int16_rows && g_int16_activations, wide);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = w.size(0);
  return out.view(shape);
}

at::Tensor qmatmul_meta(const at::Tensor& x, const at::Tensor& w, int64_t, bool, bool) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return at::empty(shape, x.options());
}

// rows [R] of W -> [R, K] fp32 (all rows when `rows` is empty): embedding lookups and the
// dequantise-then-GEMM path of large batches
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& rows) {
  check_weight(w, qtype, K);
  const bool all = rows.numel() == 0;
  const int64_t R = all ? w.size(0) : rows.numel();
  at::Tensor idx = all ? rows : rows.to(at::kLong).contiguous();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  at::Tensor out = at::empty({R, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1), N = w.size(0);
  const TypeRow& type = type_row(qtype);
  at::parallel_for(0, R, 64, [&](int64_t a, int64_t b) {
    std::vector<uint8_t> scratch;
    for (int64_t r = a; r < b; ++r) {
      const int64_t src = ip ? ip[r] : r;
      TORCH_CHECK(src >= 0 && src < N, "row ", src, " out of range for ", N, " rows");
      type.dequant_row(split_rows_of(wp, type, N, K, src, src + 1, scratch), K / type.block, op + r * K);
    }
  });
  return out;
}

// Split rows -> the laid-out form (tiles.h), in place, where is_laid says the kernels read this
// matrix so (then true; false leaves it as it is). The model's loader calls it once per weight.
bool lay_out(at::Tensor w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const TypeRow& type = type_row(qtype);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  if (!is_laid(type, N, K)) return false;
#ifdef TW_AVX2
  uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t group = kTileRows * row_bytes;
  at::parallel_for(0, N / kTileRows, 16, [&](int64_t a, int64_t b) {
    std::vector<uint8_t> rows(group), image(group);
    for (int64_t g = a; g < b; ++g) {
      std::memcpy(rows.data(), wp + g * group, group);
      type.lay_out_group(rows.data(), K / type.block, row_bytes, image.data(), wp + g * group);
    }
  });
#endif
  return true;
}

// Per row of logits [R, V]: the max, its first index and, where want_lse[r], the logsumexp, on
// the calling thread. torch's max and log_softmax split one 49,152-logit row over the OpenMP
// threads: 76 us for the max alone on 2 threads (the engine's greedy step needs it every token),
// and a descheduled thread stalls their barrier for milliseconds; this takes ~15 us.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_stats(const at::Tensor& logits_in, const at::Tensor& want_lse) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.dtype() == at::kFloat && logits_in.size(1) > 0,
              "logits must be float32 [rows, vocab]");
  TORCH_CHECK(want_lse.dtype() == at::kBool && want_lse.numel() == logits_in.size(0), "want_lse must be bool [rows]");
  const at::Tensor logits = logits_in.contiguous(), want = want_lse.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor maxima = at::empty({R}, logits.options()), lse = at::full({R}, NAN, logits.options());
  at::Tensor argmax = at::empty({R}, logits.options().dtype(at::kLong));
  for (int64_t r = 0; r < R; ++r) {
    const float* x = logits.data_ptr<float>() + r * V;
    float mx = -INFINITY;
    bool nan = false;
    int64_t i = 0;
#ifdef TW_AVX2
    __m256 vmx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      vmx = _mm256_max_ps(vmx, v);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (const float lane : lanes) mx = std::max(mx, lane);
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < V; ++i) {
      nan |= std::isnan(x[i]);
      mx = std::max(mx, x[i]);
    }
    int64_t arg = 0;
#ifdef TW_AVX2
    if (!nan)  // the first lane equal to the max, eight at a time
      for (int mask = 0; arg + 8 <= V; arg += 8)
        if ((mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + arg), _mm256_set1_ps(mx), _CMP_EQ_OQ)))) {
          arg += __builtin_ctz(mask);
          break;
        }
#endif
    while (arg < V && !(nan ? std::isnan(x[arg]) : x[arg] == mx)) ++arg;
    if (nan) mx = NAN;  // as torch.max: a NaN is the maximum
    maxima.data_ptr<float>()[r] = mx;
    argmax.data_ptr<int64_t>()[r] = arg;
    if (!want.data_ptr<bool>()[r] || nan) continue;
    if (mx == -INFINITY) {
      lse.data_ptr<float>()[r] = -INFINITY;
      continue;
    }
    float total = 0;
    i = 0;
#ifdef TW_AVX2
    __m256 sum = _mm256_setzero_ps();
    const __m256 vmax = _mm256_set1_ps(mx);
    for (; i + 8 <= V; i += 8) sum = _mm256_add_ps(sum, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax)));
    total = hsum(sum);
#endif
    for (; i < V; ++i) total += std::exp(x[i] - mx);
    lse.data_ptr<float>()[r] = mx + std::log(total);
  }
  return {maxima, argmax, lse};
}

// The fused step's attention on its own (paged_attention.h), for tests: q [M, heads, D] over one
// layer's cache [blocks, block_size, kv_heads, D] (q8: with its scales) -> [M, heads * D]; split
// -1 as the stack decides, 0 / 1 forces (row, KV head) / (chunk, KV head) tasks
at::Tensor paged_attention_op(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                              const at::Tensor& positions, const at::Tensor& block_tables, int64_t window,
                              double scale, int64_t split) {
  const at::Tensor q = q_in.contiguous();
  TORCH_CHECK(q.dtype() == at::kFloat && q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "q must be float32 [M, heads, D] and the caches one layer's [blocks, block_size, kv_heads, D]");
  const int64_t M = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == D, "heads must be a multiple of kv_heads, D the cache's");
  check_kv(k_cache, k_scale, kv_heads, D, "the K cache");
  check_kv(v_cache, v_scale, kv_heads, D, "the V cache");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous() && positions.numel() == M &&
                  block_tables.dtype() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == M,
              "positions [M] and block_tables [M, max_blocks] must be contiguous int64");
  const int64_t bs = k_cache.size(1), width = block_tables.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(pos[m] >= 0 && pos[m] / bs < width, "position ", pos[m], " is past its block table");
    for (int64_t b = 0; b <= pos[m] / bs; ++b)
      TORCH_CHECK(tables[m * width + b] >= 0 && tables[m * width + b] < k_cache.size(0), "block table entry out of range");
  }
  at::Tensor out = at::empty({M, heads * D}, q.options());
  const KvCacheView kc = kv_view(k_cache, k_scale, 0), vc = kv_view(v_cache, v_scale, 0);
  const int threads = at::get_num_threads();
  PagedAttention paged(heads, kv_heads, D, M, pos, tables, width, bs, threads, static_cast<int>(split));
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    PagedAttention::Thread th;
    paged.tasks(th, kc, vc, window, static_cast<float>(scale), qp, heads * D, op, tid, nt);
    if (paged.split) {
#pragma omp barrier
      paged.merge(th, op, tid, nt);
    }
  }
  return out;
}

// rows [n, kv_heads, D] (fp32) into slots [n] of one layer's cache, stored as the fused step
// stores them (kv_store.h): the eager path's q8 cache and the tests
void kv_store_op(at::Tensor cache, const std::optional<at::Tensor>& scales, const at::Tensor& slots,
                 const at::Tensor& rows_in) {
  const at::Tensor rows = rows_in.to(at::kFloat).contiguous();
  TORCH_CHECK(cache.dim() == 4 && rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3),
              "rows must be [n, kv_heads, D] for a cache [blocks, block_size, kv_heads, D]");
  check_kv(cache, scales, cache.size(2), cache.size(3), "the cache");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.numel() == rows.size(0), "slots must be int64 [n]");
  const at::Tensor s = slots.contiguous();
  const KvCacheView view = kv_view(cache, scales, 0);
  const int64_t n = rows.size(0), kv_heads = rows.size(1), D = rows.size(2), capacity = cache.size(0) * cache.size(1);
  const float* x = rows.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = s.data_ptr<int64_t>()[i];
    TORCH_CHECK(slot >= 0 && slot < capacity, "slot ", slot, " is not in the cache's ", capacity);
    for (int64_t h = 0; h < kv_heads; ++h) view.store_row(slot, h, D, x + (i * kv_heads + h) * D);
  }
}

// The C++ table's rows, for the test that model/weight_types.py mirrors them: every type id, and
// a type's (name, activation format or "", [block, bytes per block, bytes of each split part...])
std::vector<int64_t> weight_type_ids() {
  std::vector<int64_t> ids;
  for (const TypeRow& row : kTypes) ids.push_back(row.id);
  return ids;
}

std::tuple<std::string, std::string, std::vector<int64_t>> weight_type_info(int64_t id) {
  const TypeRow& row = type_row(id);
  std::vector<int64_t> sizes{row.block, row.block_bytes};
  sizes.insert(sizes.end(), row.part_bytes, row.part_bytes + row.num_parts);
  return {row.name, row.act != nullptr ? row.act->name : "", sizes};
}

void set_int16_activations(bool on) { g_int16_activations = on; }

void set_barrier_spin_us(double us) { g_spin_ns = static_cast<int64_t>(us * 1000); }

// 0: always the team, 1: adaptive (the default), 2: always one thread
void set_team_mode(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "team mode is 0 (fixed), 1 (adaptive) or 2 (solo)");
  g_team.set_mode(static_cast<int>(mode));
  g_step_team.set_mode(static_cast<int>(mode));
}

TeamGate& gate(int64_t which) {
  TORCH_CHECK(which == 0 || which == 1, "gate 0 is the fused decode stack's, 1 the other steps'");
  return which == 0 ? g_team : g_step_team;
}

// the last team step's waiting share, the solo steps still due, and the steps run solo and as a
// team so far
std::tuple<double, int64_t, int64_t, int64_t> team_state(int64_t which) {
  const TeamGate& g = gate(which);
  return {g.last_fraction.load(), g.solo_left(), g.solo_total.load(), g.team_total.load()};
}

// the threads a step outside the fused stack gets (of `threads`), and what it measured after
int64_t step_team(int64_t threads) { return g_step_team.team(static_cast<int>(threads)); }
void step_team_report(int64_t waited_ns, int64_t team, int64_t threads, int64_t wall_ns, int64_t units) {
  g_step_team.report(waited_ns, static_cast<int>(team), static_cast<int>(threads), wall_ns, units);
}

// [participants, 3]: CPU seconds and wall seconds inside the barrier, rounds seen right
at::Tensor barrier_probe_op(int64_t participants, int64_t rounds, double sleep_ms) {
  TORCH_CHECK(participants >= 1 && participants <= 64 && rounds >= 1, "1-64 participants, at least one round");
  const std::vector<double> r = barrier_probe(static_cast<int>(participants), static_cast<int>(rounds), sleep_ms);
  return at::tensor(r, at::kDouble).view({participants, 3});
}

}  // namespace tw

using namespace tw;

TORCH_LIBRARY(tokenwire, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run);
  m.def("row_stats(Tensor logits, Tensor want_lse) -> (Tensor, Tensor, Tensor)");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, Tensor positions, "
        "Tensor block_tables, int window, float scale, int split=-1) -> Tensor");
  m.def("kv_store(Tensor(a!) cache, Tensor(b!)? scales, Tensor slots, Tensor rows) -> ()");
  m.def("set_int16_activations(bool on) -> ()");
  m.def("set_barrier_spin_us(float us) -> ()");
  m.def("set_team_mode(int mode) -> ()");
  m.def("team_state(int gate=0) -> (float, int, int, int)");
  m.def("step_team(int threads) -> int");
  m.def("step_team_report(int waited_ns, int team, int threads, int wall_ns, int units) -> ()");
  m.def("barrier_probe(int participants, int rounds, float sleep_ms) -> Tensor");
  m.def("qmatmul(Tensor x, Tensor w, int qtype, bool int16_rows=False, bool wide=False) -> Tensor");
  m.def("dequantize(Tensor w, int qtype, int k, Tensor rows) -> Tensor");
  m.def("lay_out(Tensor(a!) w, int qtype, int k) -> bool");
  m.def("weight_type_ids() -> int[]");
  m.def("weight_type_info(int id) -> (str, str, int[])");
}

TORCH_LIBRARY_IMPL(tokenwire, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("dequantize", &dequantize);
  m.impl("lay_out", &lay_out);
  m.impl("row_stats", &row_stats);
  m.impl("paged_attention", &paged_attention_op);
  m.impl("kv_store", &kv_store_op);
}

TORCH_LIBRARY_IMPL(tokenwire, CatchAll, m) { m.impl("set_int16_activations", &set_int16_activations);
  m.impl("set_barrier_spin_us", &set_barrier_spin_us);
  m.impl("barrier_probe", &barrier_probe_op);
  m.impl("set_team_mode", &set_team_mode);
  m.impl("team_state", &team_state);
  m.impl("step_team", &step_team);
  m.impl("step_team_report", &step_team_report);
  m.impl("weight_type_ids", &weight_type_ids);
  m.impl("weight_type_info", &weight_type_info);
}

TORCH_LIBRARY_IMPL(tokenwire, Meta, m) { m.impl("qmatmul", &qmatmul_meta); }
