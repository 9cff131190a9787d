// The fused decode step: every decoder layer of a decode-only batch in one call.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp.
#pragma once

#include <memory>

#include "experts.h"
#include "paged_attention.h"

namespace tw {

// ---------------------------------------------------------------------------------------------
// The decoder stack of a decode step in one call and one parallel region, five barriers a layer
// (six when a few rows' attention is shared out by position chunks: paged_attention.h).
// Each thread keeps its own copy of the residual stream and does the norms and the quantisation
// of the matvec inputs itself (a few microseconds, done twice in parallel instead of once while
// the other thread waits at a barrier); the matvecs are shared out by rows: q/k/v on head
// boundaries, so a thread applies RoPE and writes the cache for the heads it computed, and
// gate/up as matching gate and up rows, so a thread's SwiGLU needs only its own outputs (o,
// gate/up and down in chunks claimed while they run when the step has many rows: claim_chunks).
// The op it replaced (one decode layer per call) took a Python call per layer, opened a parallel
// region per large matvec, ran o_proj, attention and the SwiGLU on one thread and used libm's
// expf: SmolLM2's 30 layers on 2 threads, 80 interleaved rounds in one process, median 7.63 ->
// 4.74 ms, min 5.80 -> 3.81 ms (the same matvec kernels in both).

// One layer as the model describes it (model/layers/fusion.py): weights by role, optional parts
// absent from the dict. rope: which of a step's cos/sin tables the layer rotates by (-1: a layer
// without RoPE). window 0: attends every position.
// attn_out_norm / mlp_out_norm: Gemma's sandwich norms, on each sublayer's output before the
// residual sum.
struct StackLayer {
  at::Tensor attn_norm, mlp_norm;
  Proj qkv, gate_up;   // gate_up and down: empty in a layer of experts
  at::Tensor o, down;  // one weight each (one tensor in every checkpoint)
  std::optional<at::Tensor> qkv_bias, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t o_type, down_type, window, activation;
  float eps, scale;
  bool qk_norm_whole = false;  // q and k normed over the whole projection (OLMoE), not per head
  int64_t rope = -1;           // set after the aggregate's fields above, from the description
  std::optional<Experts> experts;
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim;
  double eps;  // the final norm's
  std::vector<StackLayer> layers;

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t dim, double rms_eps)
      : num_heads(heads), num_kv_heads(kv_heads), head_dim(dim), eps(rms_eps) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && dim > 0 && dim % 2 == 0,
                "heads must be a multiple of kv_heads and head_dim even");
  }

  static std::optional<at::Tensor> part(const c10::Dict<std::string, at::Tensor>& t, const std::string& name) {
    return t.contains(name) ? std::optional<at::Tensor>(t.at(name)) : std::nullopt;
  }

  static void check_floats(const std::optional<at::Tensor>& t, int64_t n, const char* what) {
    if (t.has_value())
      TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous() && t->numel() == n, what,
                  " must be contiguous float32 of ", n, " values");
  }

  void add_layer(c10::Dict<std::string, at::Tensor> t, c10::Dict<std::string, int64_t> n,
                 c10::Dict<std::string, double> f) {
    const bool moe = t.contains("router");
    for (const char* name : {"attn_norm", "mlp_norm", "o"})
      TORCH_CHECK(t.contains(name), "layer description lacks ", name);
    for (const char* name : {"o_type", "window", "activation"})
      TORCH_CHECK(n.contains(name), "layer description lacks ", name);
    TORCH_CHECK(moe || (t.contains("down") && n.contains("down_type")), "layer description lacks down");
    TORCH_CHECK(f.contains("eps") && f.contains("scale"), "layer description lacks eps or scale");
    const int64_t H = t.at("attn_norm").numel(), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    StackLayer L{t.at("attn_norm"), t.at("mlp_norm"), Proj::from(t, n, "qkv", H),
                 moe ? Proj{} : Proj::from(t, n, "gate_up", H), t.at("o"), moe ? at::Tensor() : t.at("down"),
                 part(t, "qkv_bias"), part(t, "q_norm"), part(t, "k_norm"),
                 part(t, "attn_out_norm"), part(t, "mlp_out_norm"), n.at("o_type"), moe ? 0 : n.at("down_type"), n.at("window"),
                 n.at("activation"), static_cast<float>(f.at("eps")), static_cast<float>(f.at("scale"))};
    L.qk_norm_whole = n.contains("qk_norm_whole") && n.at("qk_norm_whole") != 0;
    L.rope = n.contains("rope") ? n.at("rope") : -1;
    check_floats(L.attn_norm, H, "attn_norm");
    check_floats(L.mlp_norm, H, "mlp_norm");
    check_floats(L.attn_out_norm, H, "attn_out_norm");
    check_floats(L.mlp_out_norm, H, "mlp_out_norm");
    check_weight(L.o, L.o_type, q_size);
    if (moe) {
      Experts E;
      E.router = t.at("router");
      const int64_t count = E.router.size(0);
      TORCH_CHECK(E.router.dtype() == at::kFloat && E.router.is_contiguous() && E.router.dim() == 2 &&
                      E.router.size(1) == H, "the router must be contiguous float32 [experts, hidden]");
      E.top_k = n.at("top_k");
      E.normalize = n.at("normalize") != 0;
      TORCH_CHECK(0 < E.top_k && E.top_k <= count, "top_k ", E.top_k, " of ", count, " experts");
      for (int64_t e = 0; e < count; ++e) {
        const std::string name = "expert" + std::to_string(e);
        E.gate_up.push_back(Proj::from(t, n, name + ".gate_up", H));
        E.inter = E.gate_up.back().rows / 2;
        TORCH_CHECK(t.contains(name + ".down") && n.contains(name + ".down_type"), "layer description lacks ", name, ".down");
        E.down.push_back(t.at(name + ".down"));
        E.down_type.push_back(n.at(name + ".down_type"));
        check_weight(E.down.back(), E.down_type.back(), E.inter);
        TORCH_CHECK(E.gate_up.back().rows == 2 * E.inter && E.down.back().size(0) == H && E.inter % 8 == 0 &&
                        E.inter == E.gate_up[0].rows / 2,
                    "expert ", e, "'s shapes do not match the hidden size, or its width is not a multiple of 8");
      }
      L.experts = std::move(E);
    } else {
      const int64_t inter = L.gate_up.rows / 2;
      check_weight(L.down, L.down_type, inter);
      // the SwiGLU is shared out in whole vectors of 8 (types without an activation format: F16, BF16)
      TORCH_CHECK(inter % 8 == 0, "the intermediate size ", inter, " is not a multiple of 8");
      TORCH_CHECK(L.down.size(0) == H, "projection shapes do not match the hidden size and heads");
    }
    TORCH_CHECK(L.qkv.rows == q_size + 2 * kv_size && L.o.size(0) == H,
                "projection shapes do not match the hidden size and heads");
    check_floats(L.qkv_bias, L.qkv.rows, "qkv bias");
    check_floats(L.q_norm, L.qk_norm_whole ? q_size : head_dim, "q_norm");
    check_floats(L.k_norm, L.qk_norm_whole ? kv_size : head_dim, "k_norm");
    TORCH_CHECK(L.q_norm.has_value() == L.k_norm.has_value(), "q_norm and k_norm come together");
    TORCH_CHECK(L.window >= 0 && (L.activation == 0 || L.activation == 1), "window must be >= 0, activation 0 or 1");
    if (!layers.empty())
      TORCH_CHECK(layers[0].attn_norm.numel() == H, "every layer must have the first one's hidden size");
    layers.push_back(std::move(L));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // resid += a sublayer's output, through its norm where the layer has one (scratch: [M, H])
  static void add_output(float* resid, const float* out, const std::optional<at::Tensor>& norm, float eps, int64_t M,
                         int64_t H, float* scratch) {
    if (norm.has_value()) {
      rms_norm_rows(out, norm->data_ptr<float>(), eps, M, H, scratch);
      out = scratch;
    }
    for (int64_t i = 0; i < M * H; ++i) resid[i] += out[i];
  }



  // Checks a block table [M, width] against the rows' positions and a pool of `blocks` blocks.
  static void check_tables(const at::Tensor& tables, int64_t M, const int64_t* pos, int64_t bs, int64_t blocks,
                           const char* what) {
    TORCH_CHECK(tables.dtype() == at::kLong && tables.dim() == 2 && tables.size(0) == M && tables.is_contiguous(),
                what, " must be contiguous int64 [M, max_blocks]");
    const int64_t width = tables.size(1);
    const int64_t* t = tables.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(pos[m] >= 0 && pos[m] / bs < width, "position ", pos[m], " is past its row of ", what);
      for (int64_t b = 0; b <= pos[m] / bs; ++b)
        TORCH_CHECK(t[m * width + b] >= 0 && t[m * width + b] < blocks, what, " entry ", t[m * width + b],
                    " is not one of the ", blocks, " blocks");
    }
  }

  static void check_caches(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, int64_t kv_heads, int64_t D, const char* what) {
    TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), what,
                " K and V must be [layers, blocks, block_size, kv_heads, head_dim] of one type");
    check_kv(k, k_scale, kv_heads, D, "a K cache");
    check_kv(v, v_scale, kv_heads, D, "a V cache");
  }

  // Layers [first, last) for one decode token per row of x [M, H] (updated in place), then the
  // final RMSNorm when `final_norm` is given. KV caches [layers, blocks, block_size, kv_heads, D];
  // the rows' positions [M] (the row attends to 0..position, or its window's end of it);
  // block_tables [M, max_blocks]; rope_cos / rope_sin: each rotary's cos and sin of the rows'
  // D/2 angles, [M, D/2] (a layer's `rope` picks one).
  // Where the cache keeps windowed layers in a pool of their own (engine/kv_cache.py),
  // `layer_slots` [layers] places each layer: s >= 0 is layer s of k/v_cache, s < 0 layer -s - 1
  // of window_k/v (a row's blocks there in window_tables, released ones given as any valid block:
  // a window never reads them). Without it, layer l is layer l of k/v_cache.
  void run(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache, const std::optional<at::Tensor>& k_scale,
           const std::optional<at::Tensor>& v_scale, const at::Tensor& positions, const at::Tensor& block_tables,
           int64_t first, int64_t last, const std::optional<at::Tensor>& final_norm,
           const std::vector<at::Tensor>& rope_cos, const std::vector<at::Tensor>& rope_sin,
           const std::optional<at::Tensor>& layer_slots, const std::optional<at::Tensor>& window_k,
           const std::optional<at::Tensor>& window_v, const std::optional<at::Tensor>& window_k_scale,
           const std::optional<at::Tensor>& window_v_scale, const std::optional<at::Tensor>& window_tables) {
    TORCH_CHECK(0 <= first && first <= last && last <= num_layers(), "layer range out of bounds");
    const int64_t M = x.size(0), H = x.size(1), D = head_dim;
    TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2 && H == layers[0].attn_norm.numel(),
                "x must be contiguous float32 [M, hidden]");
    check_caches(k_cache, v_cache, k_scale, v_scale, num_kv_heads, D, "the cache's");
    const bool pools = window_k.has_value();
    TORCH_CHECK(pools == window_v.has_value() && pools == window_tables.has_value() &&
                    (!pools || layer_slots.has_value()),
                "a window pool comes with its K, V, tables and the layers' slots");
    if (pools) check_caches(*window_k, *window_v, window_k_scale, window_v_scale, num_kv_heads, D, "the window pool's");
    std::vector<int64_t> slot_of(num_layers());
    for (int64_t l = 0; l < num_layers(); ++l) slot_of[l] = l;
    if (layer_slots.has_value()) {
      TORCH_CHECK(layer_slots->dtype() == at::kLong && layer_slots->is_contiguous() &&
                      layer_slots->numel() == num_layers(),
                  "layer_slots must be contiguous int64 [layers]");
      std::memcpy(slot_of.data(), layer_slots->data_ptr<int64_t>(), num_layers() * sizeof(int64_t));
    }
    for (int64_t l = first; l < last; ++l) {
      const int64_t s = slot_of[l];
      TORCH_CHECK(s >= 0 ? s < k_cache.size(0) : pools && -s - 1 < window_k->size(0), "layer ", l, "'s slot ", s,
                  " is not a layer of its pool");
    }
    if (final_norm.has_value())
      TORCH_CHECK(final_norm->dtype() == at::kFloat && final_norm->is_contiguous() && final_norm->numel() == H,
                  "the final norm must be contiguous float32 [hidden]");
    TORCH_CHECK(positions.dtype() == at::kLong && positions.numel() == M && positions.is_contiguous(),
                "positions must be contiguous int64 [M]");
    const int64_t bs = k_cache.size(2), max_blocks = block_tables.size(1);
    const int64_t* pos = positions.data_ptr<int64_t>();
    check_tables(block_tables, M, pos, bs, k_cache.size(1), "the block tables");
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    if (pools) {
      TORCH_CHECK(window_k->size(2) == bs, "the window pool's blocks must be the cache's size");
      check_tables(*window_tables, M, pos, bs, window_k->size(1), "the window tables");
    }
    const int64_t window_width = pools ? window_tables->size(1) : 0;
    const int64_t* wtables = pools ? window_tables->data_ptr<int64_t>() : nullptr;
    TORCH_CHECK(rope_cos.size() == rope_sin.size(), "rope_cos and rope_sin come together");
    for (size_t r = 0; r < rope_cos.size(); ++r)
      for (const at::Tensor* t : {&rope_cos[r], &rope_sin[r]})
        TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == M &&
                        t->size(1) == D / 2,
                    "rotary cos/sin must be contiguous float32 [M, head_dim / 2]");
    for (int64_t l = first; l < last; ++l)
      TORCH_CHECK(layers[l].rope < static_cast<int64_t>(rope_cos.size()), "layer ", l, " rotates by table ",
                  layers[l].rope, " of ", rope_cos.size());
    if (M == 0) return;

    const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
    int64_t inter = 0, experts = 0, top_k = 0;  // the dense MLPs' width; the widest mixture's counts
    for (int64_t l = first; l < last; ++l) {
      if (layers[l].experts.has_value()) {
        experts = std::max(experts, layers[l].experts->router.size(0));
        top_k = std::max(top_k, layers[l].experts->top_k);
      } else {
        inter = std::max(inter, layers[l].gate_up.rows / 2);
      }
    }
    const int64_t slices = num_heads + 2 * num_kv_heads, qkv_n = slices * D;
    const int64_t half = D / 2;
    const float feps = static_cast<float>(eps), default_scale = 1.0f / std::sqrt(static_cast<float>(D));
    // gu: the gate/up outputs of layers that take fixed halves (claimed chunks keep theirs in a
    // buffer of the thread's own: gate_up_rows)
    const bool claimed = M >= kClaimFrom;
    const bool halves = std::any_of(layers.begin() + first, layers.begin() + last, [&](const StackLayer& L) {
      return !L.experts.has_value() && !gate_up_claimed(L.gate_up, claimed);
    });
    std::vector<float> qkv(M * qkv_n), attn(M * q_size), proj(M * H), gu(halves ? M * 2 * inter : 0), act(M * inter);
    // a mixture of experts: router logits, and each (row, chosen expert)'s output
    std::vector<float> router_logits(M * experts), expert_out(M * top_k * H);
    const bool int16 = kInt16Rows && g_int16_activations;
    // the input of down, quantised as the SwiGLU makes it: one buffer per activation format the
    // layers' down projections take (their type rows'); a layer's SwiGLU is shared out in
    // blocks of its format (any 8 values where the type has none)
    std::vector<std::unique_ptr<QuantizedActivations>> act_buffers;
    std::vector<QuantizedActivations*> down_in(last - first, nullptr);
    std::vector<int64_t> swiglu_blocks(last - first, 8);
    for (int64_t l = first; l < last; ++l) {
      if (layers[l].experts.has_value()) continue;  // each expert's input is quantised where it runs
      const ActFormat* format = type_row(layers[l].down_type).act;
      if (format == nullptr) continue;
      swiglu_blocks[l - first] = format->block;
      auto same = [format](const auto& b) { return b->format == format; };
      auto it = std::find_if(act_buffers.begin(), act_buffers.end(), same);
      if (it == act_buffers.end()) {
        act_buffers.push_back(std::make_unique<QuantizedActivations>());
        act_buffers.back()->reset(M, inter, *format);
        it = act_buffers.end() - 1;
      }
      down_in[l - first] = it->get();
    }
    float* xp = x.data_ptr<float>();
    const int wanted = at::get_num_threads(), threads = g_team.team(wanted);
    PagedAttention paged(num_heads, num_kv_heads, D, M, pos, tables, max_blocks, bs, threads);
    std::optional<PagedAttention> windowed;
    if (pools) windowed.emplace(num_heads, num_kv_heads, D, M, pos, wtables, window_width, bs, threads);
    // each layer's o, gate/up and down claims (kClaimFrom rows or more)
    std::unique_ptr<std::atomic<int64_t>[]> claims(new std::atomic<int64_t>[3 * (last - first)]());
    auto claims_of = [&](int64_t l, int part) { return claimed ? &claims[3 * (l - first) + part] : nullptr; };
    SpinThenSleepBarrier barrier;
    const bool omp_barrier = g_spin_ns.load() < 0;  // A/B measurement only
    std::atomic<int64_t> waited{0};
    const auto started = std::chrono::steady_clock::now();

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      int64_t my_wait = 0;
      std::vector<float> resid(xp, xp + M * H), h(M * H), rotated(D), whole_norm(2 * M), gu_chunk;
      PagedAttention::Thread attn_thread;
      QuantizedActivations qa;  // this thread's copy of the current matvec input
      const auto [s0, s1] = share(slices, tid, nt);                          // q/k/v head slices
      const auto [o0, o1] = share(H, tid, nt);                               // o and down rows
      for (int64_t l = first; l < last; ++l) {
        const StackLayer& L = layers[l];
        const int64_t slot = slot_of[l], pool_layer = slot >= 0 ? slot : -slot - 1;
        const bool in_window = slot < 0;
        const KvCacheView kc = in_window ? kv_view(*window_k, window_k_scale, pool_layer)
                                         : kv_view(k_cache, k_scale, pool_layer);
        const KvCacheView vc = in_window ? kv_view(*window_v, window_v_scale, pool_layer)
                                         : kv_view(v_cache, v_scale, pool_layer);
        const int64_t* layer_tables = in_window ? wtables : tables;
        const int64_t layer_width = in_window ? window_width : max_blocks;
        PagedAttention& layer_paged = in_window ? *windowed : paged;
        rms_norm_rows(resid.data(), L.attn_norm.data_ptr<float>(), L.eps, M, H, h.data());
        proj_rows(h.data(), M, H, L.qkv, {{s0 * D, s1 * D}}, qkv.data(), int16, qa);
        if (L.qk_norm_whole) {  // each row's whole q and k: every thread's slices written, read
SYNC
          for (int64_t m = 0; m < M; ++m)
            for (int64_t part = 0; part < 2; ++part) {
              const float* v = qkv.data() + m * qkv_n + (part == 0 ? 0 : q_size);
              const int64_t n = part == 0 ? q_size : kv_size;
              float ss = 0;
              for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
              whole_norm[m * 2 + part] = 1.0f / std::sqrt(ss / static_cast<float>(n) + L.eps);
            }
SYNC
        }
        // this thread's head slices: bias, the q/k norm of each head, RoPE on q and k
        // (x*cos + roll(x, D/2)*signed_sin), new keys and values into the cache
        const float* bias = L.qkv_bias.has_value() ? L.qkv_bias->data_ptr<float>() : nullptr;
        const float* cp = L.rope >= 0 ? rope_cos[L.rope].data_ptr<float>() : nullptr;
        const float* sp = L.rope >= 0 ? rope_sin[L.rope].data_ptr<float>() : nullptr;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t s = s0; s < s1; ++s) {
            float* v = qkv.data() + m * qkv_n + s * D;
            if (bias != nullptr)
              for (int64_t i = 0; i < D; ++i) v[i] += bias[s * D + i];
            if (L.q_norm.has_value() && s < num_heads + num_kv_heads && L.qk_norm_whole) {
              const bool is_q = s < num_heads;
              const float r = whole_norm[m * 2 + (is_q ? 0 : 1)];
              const float* w = (is_q ? *L.q_norm : *L.k_norm).data_ptr<float>() + (is_q ? s : s - num_heads) * D;
              for (int64_t i = 0; i < D; ++i) v[i] = w[i] * (v[i] * r);
            } else if (L.q_norm.has_value() && s < num_heads + num_kv_heads) {
              const at::Tensor& w = s < num_heads ? *L.q_norm : *L.k_norm;
              rms_norm_rows(v, w.data_ptr<float>(), L.eps, 1, D, rotated.data());
              std::memcpy(v, rotated.data(), D * sizeof(float));
            }
            if (cp != nullptr && s < num_heads + num_kv_heads) {  // row m's D/2 angles
              const float* c = cp + m * half;
              const float* sn = sp + m * half;
              for (int64_t i = 0; i < half; ++i) {
                rotated[i] = v[i] * c[i] + v[i + half] * -sn[i];
                rotated[i + half] = v[i + half] * c[i] + v[i] * sn[i];
              }
              std::memcpy(v, rotated.data(), D * sizeof(float));
            }
            if (s >= num_heads) {
              const int64_t p = pos[m], row = layer_tables[m * layer_width + p / bs] * bs + p % bs;
              (s < num_heads + num_kv_heads ? kc : vc).store_row(row, (s - num_heads) % num_kv_heads, D, v);
            }
          }
SYNC
        const float scale = L.scale > 0 ? L.scale : default_scale;
        layer_paged.tasks(attn_thread, kc, vc, L.window, scale, qkv.data(), qkv_n, attn.data(), tid, nt);
        if (layer_paged.split) {
SYNC
          layer_paged.merge(attn_thread, attn.data(), tid, nt);
        }
SYNC
        matvec_share(attn.data(), quantized_for(attn.data(), M, q_size, L.o_type, int16, qa), M, q_size, L.o, L.o_type,
                     claims_of(l, 0), o0, o1, proj.data());
SYNC
        add_output(resid.data(), proj.data(), L.attn_out_norm, L.eps, M, H, h.data());
        rms_norm_rows(resid.data(), L.mlp_norm.data_ptr<float>(), L.eps, M, H, h.data());
        if (L.experts.has_value()) {
          run_experts(*L.experts, h.data(), M, H, L.activation, router_logits.data(), expert_out.data(), proj.data(),
                      tid, nt, barrier, omp_barrier, my_wait, int16);
          add_output(resid.data(), proj.data(), L.mlp_out_norm, L.eps, M, H, h.data());
          continue;
        }
        QuantizedActivations* down_q = int16 ? down_in[l - first] : nullptr;
        gate_up_rows(L.gate_up, L.activation, h.data(), M, H, inter, swiglu_blocks[l - first], claims_of(l, 1), tid, nt,
                     int16, qa, gu.data(), gu_chunk, act.data(), down_q);
SYNC
        matvec_share(act.data(), down_q, M, inter, L.down, L.down_type, claims_of(l, 2), o0, o1, proj.data());
SYNC
        add_output(resid.data(), proj.data(), L.mlp_out_norm, L.eps, M, H, h.data());
      }
      waited.fetch_add(my_wait, std::memory_order_relaxed);
      if (tid == 0) {
        if (final_norm.has_value()) rms_norm_rows(resid.data(), final_norm->data_ptr<float>(), feps, M, H, xp);
        else std::memcpy(xp, resid.data(), M * H * sizeof(float));
      }
    }
    const auto wall = std::chrono::steady_clock::now() - started;
    g_team.report(waited.load(), threads, wanted, std::chrono::duration_cast<std::chrono::nanoseconds>(wall).count(),
                  M * (last - first));
  }
};

}  // namespace tw
