// Parts of the fused decode step (decode_stack.h, experts.h): RMSNorm rows, the gated
// activation, a projection of typed row ranges, and the barrier every thread of the step's
// parallel region meets. Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <utility>

#include "barrier.h"
#include "matvec.h"
#include "paged_attention.h"  // share(), exp_avx2()

namespace tw {

void rms_norm_rows(const float* x, const float* weight, float eps, int64_t M, int64_t H, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) out[m * H + i] = weight[i] * (xr[i] * r);
  }
}

// out = act(gate) * up for n values (a multiple of 8); act 0 = SiLU, 1 = GELU (tanh form)
inline void gated(const float* gate, const float* up, float* out, int64_t n, int64_t act) {
#ifdef TW_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    __m256 a;
    if (act == 0) {
      a = _mm256_div_ps(g, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    } else {  // 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3)
      const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                     _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
      a = _mm256_div_ps(g, _mm256_add_ps(one, exp_avx2(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u))));
    }
    _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_loadu_ps(up + i)));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float u = 0.7978845608f * (g + 0.044715f * g * g * g);
    out[i] = (act == 0 ? g / (1.0f + std::exp(-g)) : g / (1.0f + std::exp(-2.0f * u))) * up[i];
  }
#endif
}

// A projection's weight: row ranges stacked in order, each in its own block type. A K-quant
// file mixes types inside one fused projection (Q4_K_M keeps v in Q6_K beside Q4_K q and k in
// some layers); each range keeps the file's blocks rather than one type re-quantised for all.
// In the description: `qkv`, `qkv@1`, `qkv@2`... with `qkv_type`, `qkv_type@1`...
struct Proj {
  std::vector<at::Tensor> w;
  std::vector<int64_t> type, first;  // each range's block type and first output row
  int64_t rows = 0;

  static Proj from(const c10::Dict<std::string, at::Tensor>& t, const c10::Dict<std::string, int64_t>& n,
                   const std::string& role, int64_t K) {
    Proj p;
    for (int i = 0;; ++i) {
      const std::string suffix = i == 0 ? "" : "@" + std::to_string(i);
      if (!t.contains(role + suffix)) break;
      TORCH_CHECK(n.contains(role + "_type" + suffix), "layer description lacks ", role, "_type", suffix);
      p.w.push_back(t.at(role + suffix));
      p.type.push_back(n.at(role + "_type" + suffix));
      check_weight(p.w.back(), p.type.back(), K);
      p.first.push_back(p.rows);
      p.rows += p.w.back().size(0);
    }
    TORCH_CHECK(!p.w.empty(), "layer description lacks ", role);
    return p;
  }
};

// `in` [M, K] quantised into `qa` for a weight of `qtype`; nullptr where that type multiplies
// float activations (or int16 activations are off)
inline const QuantizedActivations* quantized_for(const float* in, int64_t M, int64_t K, int64_t qtype, bool int16,
                                                 QuantizedActivations& qa) {
  const ActFormat* format = type_row(qtype).act;
  if (!int16 || format == nullptr) return nullptr;
  qa.quantize(in, M, K, *format);
  return &qa;
}

// rows [n0, n1) of part i of a stacked projection (those inside it) into out[m * ldo + n - base]
inline void part_rows(const float* in, const QuantizedActivations* q, int64_t M, int64_t K, const Proj& P, size_t i,
                      int64_t n0, int64_t n1, float* out, int64_t ldo, int64_t base) {
  const int64_t r0 = P.first[i], a = std::max(n0, r0), b = std::min(n1, r0 + P.w[i].size(0));
  if (a < b) matvec_rows(in, q, M, K, P.w[i], P.type[i], a - r0, b - r0, out + (r0 - base), ldo);
}

// rows [n0, n1) of each range of a stacked projection, each part by its own type (the
// activations quantised once per format in a row, into `qa`)
inline void proj_rows(const float* in, int64_t M, int64_t K, const Proj& P,
                      std::initializer_list<std::pair<int64_t, int64_t>> ranges, float* out, bool int16,
                      QuantizedActivations& qa) {
  const QuantizedActivations* q = nullptr;
  const ActFormat* quantized_as = nullptr;
  for (size_t i = 0; i < P.w.size(); ++i) {
    const ActFormat* format = type_row(P.type[i]).act;
    if (format != quantized_as || q == nullptr) {
      q = quantized_for(in, M, K, P.type[i], int16, qa);
      quantized_as = format;
    }
    for (const auto& [n0, n1] : ranges) part_rows(in, q, M, K, P, i, n0, n1, out, P.rows, 0);
  }
}

// rows [n0, n1) of a stacked projection into out[m * ldo + n - n0], from activations `q`
// quantised for every part (one_format; nullptr: fp32)
inline void proj_rows_into(const float* in, const QuantizedActivations* q, int64_t M, int64_t K, const Proj& P,
                           int64_t n0, int64_t n1, float* out, int64_t ldo) {
  for (size_t i = 0; i < P.w.size(); ++i) part_rows(in, q, M, K, P, i, n0, n1, out, ldo, n0);
}

// whether every part of a projection takes its activations in one format
inline bool one_format(const Proj& P) {
  return std::all_of(P.type.begin(), P.type.end(), [&](int64_t t) { return type_row(t).act == type_row(P.type[0]).act; });
}

// Steps of kClaimFrom rows or more (a prefill chunk, a large batch) share o, gate/up and down out
// in chunks of kClaimRows rows claimed while they run (claim_chunks); fewer (decode) keep fixed
// halves, each streamed front to back
constexpr int64_t kClaimRows = 64, kClaimFrom = 16;

// Units [0, n) of a matmul shared out while it runs: chunks of `chunk` claimed in turn from
// `next` by whichever thread is free, rather than a fixed half each. Which thread computes a
// row does not change its bits. Why: on a shared VM the two threads' speeds differ from moment
// to moment, and with fixed halves the faster one waited at the barrier after each matmul:
// qwen2.5-1.5b Q4_K_M 1,000-token prefills (AVX2-only EPYC, 2 threads) spent 4.5-8.5 % of the
// team's time waiting, three quarters of it after gate/up and down, whose halves are equal.
template <class Run>
void claim_chunks(std::atomic<int64_t>& next, int64_t n, int64_t chunk, Run&& run) {
  for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c * chunk < n;
       c = next.fetch_add(1, std::memory_order_relaxed))
    run(c * chunk, std::min(n, (c + 1) * chunk));
}

// whether a layer's gate/up rows are claimed in chunks (gate_up_rows): a step of kClaimFrom
// rows or more, and one activation format for all its parts; else this thread's fixed half
inline bool gate_up_claimed(const Proj& P, bool claimed) { return claimed && one_format(P); }

// A layer's gate/up rows (P: gate rows [0, inter), up rows [inter, 2 inter)) in blocks of `ab`
// values (down's activation format) and their gated activation into act [M, inter], quantised
// for down into down_q: this thread's fixed half, gate and up rows that match (its SwiGLU needs
// only its own outputs, in gu [M, 2 inter]), or, given `claims`, chunks of kClaimRows claimed while
// they run, each chunk's outputs in the thread's own buffer [M, 2 x 64]: in gu a row's 64
// outputs lay 71 KB from the next (qwen2.5), and the SwiGLU stalled on their reads (57 % of its
// samples, 2 % of a 1,000-token prefill).
inline void gate_up_rows(const Proj& P, int64_t activation, const float* h, int64_t M, int64_t H, int64_t inter,
                         int64_t ab, std::atomic<int64_t>* claims, int tid, int nt, bool int16, QuantizedActivations& qa,
                         float* gu, std::vector<float>& gu_chunk, float* act, QuantizedActivations* down_q) {
  // blocks [b0, b1) from their outputs at g: row m's gate values of block b at
  // g[m * ldg + (b - b0) * ab], its up values `up` further
  auto swiglu = [&](int64_t b0, int64_t b1, const float* g, int64_t ldg, int64_t up) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = b0; b < b1; ++b) {
        float* a = act + m * inter + b * ab;
        const float* gate = g + m * ldg + (b - b0) * ab;
        gated(gate, gate + up, a, ab, activation);
        if (down_q != nullptr) down_q->quantize_block(a, m, b);
      }
  };
  if (gate_up_claimed(P, claims != nullptr)) {
    const QuantizedActivations* q = quantized_for(h, M, H, P.type[0], int16, qa);
    claim_chunks(*claims, inter / ab, std::max<int64_t>(1, kClaimRows / ab), [&](int64_t b0, int64_t b1) {
      const int64_t R = (b1 - b0) * ab;
      gu_chunk.resize(M * 2 * R);
      float* g = gu_chunk.data();
      proj_rows_into(h, q, M, H, P, b0 * ab, b1 * ab, g, 2 * R);
      proj_rows_into(h, q, M, H, P, inter + b0 * ab, inter + b1 * ab, g + R, 2 * R);
      swiglu(b0, b1, g, 2 * R, R);
    });
    return;
  }
  const auto [g0, g1] = share(inter / ab, tid, nt);
  proj_rows(h, M, H, P, {{g0 * ab, g1 * ab}, {inter + g0 * ab, inter + g1 * ab}}, gu, int16, qa);
  swiglu(g0, g1, gu + g0 * ab, 2 * inter, inter);
}

// rows [n0, n1) of out = x W^T, or, given `claims`, chunks of kClaimRows of [0, N) claimed while
// they run (claim_chunks)
inline void matvec_share(const float* x, const QuantizedActivations* q, int64_t M, int64_t K, const at::Tensor& w,
                         int64_t qtype, std::atomic<int64_t>* claims, int64_t n0, int64_t n1, float* out) {
  if (claims == nullptr) return matvec_rows(x, q, M, K, w, qtype, n0, n1, out);
  claim_chunks(*claims, w.size(0), kClaimRows, [&](int64_t a, int64_t b) { matvec_rows(x, q, M, K, w, qtype, a, b, out); });
}

// every thread of the stack's parallel region waits here for the others (barrier.h; an OpenMP
// barrier for A/B measurement only)
#define SYNC if (omp_barrier) { _Pragma("omp barrier") } else my_wait += barrier.wait(nt);

}  // namespace tw
