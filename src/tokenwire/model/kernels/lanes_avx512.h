// The AVX-512 integer matmul of the common types (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), for any number
// of activation rows: one block per int32 lane. A type unpacks a step of one weight row (8 or 16
// blocks: the 16- or 32-value units that carry one activation scale) into int16 vectors whose
// lane l holds values of the lane's block, and the activations are stored to match (the Act
// formats below). vpdpwssd then leaves each block's integer dot in its own lane, with no
// horizontal sums (the AVX2 rows of type_kernels.h / types_k.h spend a third of their operations
// on them), and the unpacked step is shared by up to kLanesRows activation rows. Each (weight
// row, activation row) is summed in the same order whatever the number of rows, so a batch or
// a prefill chunk gives every row the bits it gets alone; the integer dots are exact, so how a
// type's step groups them does not matter.
//
// Measured (Zen 5 EPYC, one core, 8192x2048, GFLOP/s, min of 12 calls in interleaved rounds of
// separate processes; AVX2 rows (commit 0192c52) -> these):
//              M = 1         M = 32        M = 256
//   Q4_0    127 -> 151    97 -> 159     95 -> 242
//   Q4_1    124 -> 145   105 -> 164    114 -> 237
//   Q8_0     93 ->  99   104 -> 161    112 -> 227
//   Q4_K    100 -> 122   104 -> 149    108 -> 200
//   Q6_K     64 -> 108    69 -> 144     69 -> 204
// and SmolLM2's Q4_1 3072x576 (M = 256) 88 -> 133, 576x1536 102 -> 193. A core's vpdpwssd peak
// here is 8.3 G/s (2 a cycle at 4.2 GHz, 266 G int16 multiply-adds/s); llama.cpp's int8
// vpdpbusd does twice the multiply-adds per instruction, at half the activations' precision.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "types_k.h"
#include "types_q4.h"
#include "types_q8.h"

namespace tw {

// Activations for Q6_K's lanes: in each step of 16 blocks of 16 values, value i of block l sits
// in int16 vector v = 2 (i / 4) + i % 2 at position 2 l + (i % 4) / 2; i.e. a lane holds values
// 4d + k and 4d + 2 + k (k = v % 2, d = v / 2), the pair a dword of quant bytes gives.
struct ActI16Lanes16 {
  static constexpr const char* kName = "i16_lanes16";
  static constexpr int kBlock = 16;
  static int64_t stride(int64_t K) { return (K / 16 + 15) / 16 * 256; }  // whole steps
  static int64_t base(int64_t j) { return j / 16 * 256 + 2 * (j % 16); }
  static constexpr int64_t slot(int64_t i) { return (2 * (i / 4) + i % 2) * 32 + (i % 4) / 2; }
};

#ifdef TW_AVX512
// activation rows per unpacked step (lanes_matmul's cases go to 4); 8 measured 10-15% slower
// (registers: v, 2 per row, dots)
constexpr int kLanesRows = 4;

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1);
}

// A type's lane step: Lanes<T>::step(row, nb, s, count, v, scale, offset) unpacks the `count`
// blocks of step s of a row (the lanes past them zero) and their weight scales and offsets (what
// multiplies the activations' exact sums) in lane order: Act (the activation format), kVecs
// (int16 vectors a step), kLanesPerBlock (1: 16 blocks a step; 2: 8 blocks, each in two lanes),
// kHasOffset.
template <class T>
struct Lanes {
  static constexpr bool kHas = false;  // the types below: true
};

template <class A, int kVecsPerStep, int kLanesOfBlock, bool kOffset>
struct LaneTraits {
  static constexpr bool kHas = true;
  using Act = A;
  static constexpr int kVecs = kVecsPerStep;
  static constexpr int kLanesPerBlock = kLanesOfBlock;
  static constexpr bool kHasOffset = kOffset;
};

// Activations for Q4_0, Q4_1, Q4_K: blocks of 32 values (one scale each), a step of 8 blocks,
// each block in two lanes: its values 16 h .. 16 h + 15 in lane 2 (j % 8) + h, placed
// in the lane as ActI16Lanes16 places a block's 16
struct ActI16LaneHalves {
  static constexpr const char* kName = "i16_lane_halves";
  static constexpr int kBlock = 32;
  static int64_t stride(int64_t K) { return (K / 32 + 7) / 8 * 256; }  // whole steps
  static int64_t base(int64_t j) { return j / 8 * 256 + 4 * (j % 8); }
  static constexpr int64_t slot(int64_t i) { return (2 * (i % 16 / 4) + i % 2) * 32 + 2 * (i / 16) + (i % 4) / 2; }
};

// Eight int16 vectors from 128 bytes of nibbles (z0, z1): lane l takes dword base[l] + d of them
// (d = 0..3) and its low nibbles (nibble[l] = 0) or high ones (4), byte pairs as ActI16LaneHalves
// pairs a lane's values
inline void nibble_lanes(__m512i z0, __m512i z1, __m512i base, __m512i nibble, __m512i v[8]) {
  const __m512i m = _mm512_set1_epi32(0x000f000f);
  for (int d = 0; d < 4; ++d) {
    const __m512i q = _mm512_srlv_epi32(_mm512_permutex2var_epi32(z0, _mm512_add_epi32(base, _mm512_set1_epi32(d)), z1), nibble);
    v[2 * d] = _mm512_and_si512(q, m);
    v[2 * d + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 8), m);
  }
}

// The nibbles of 8 32-weight blocks (16 quant bytes each, byte i holding weights i and i + 16),
// block t in lanes 2 t (low nibbles) and 2 t + 1 (high): lanes 2 t, 2 t + 1 read the same
// dwords, shifted by 0 or 4
inline void q4_halves(const uint8_t* quants, int64_t count, __m512i v[8]) {
  const __m512i z0 = _mm512_maskz_loadu_epi32(first_lanes(std::min<int64_t>(4 * count, 16)), quants);
  const __m512i z1 = _mm512_maskz_loadu_epi32(first_lanes(std::max<int64_t>(4 * count - 16, 0)), quants + 64);
  nibble_lanes(z0, z1, _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28),
               _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4), v);
}

// lanes 2 t and 2 t + 1 from lane t: a value per block into both lanes of its half-block pair
inline __m512 paired(__m256 f) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(f));
}

// 8 fp16 values (blocks 8 s ..) each into two lanes, from the first `count`
inline __m512 halves8_paired(const uint8_t* p, int64_t count) {
  return paired(_mm256_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>(first_lanes(count)), p)));
}

// Q4_0 (offset -8 d) and Q4_1 (offset m), 8 blocks a step
template <class T>
struct LanesQ4 : LaneTraits<ActI16LaneHalves, 8, 2, true> {
  static void step(const uint8_t* row, int64_t nb, int64_t s, int64_t count, __m512i v[8], __m512& scale,
                   __m512& offset) {
    q4_halves(T::part(row, nb, T::kQuantPart) + 128 * s, count, v);
    scale = halves8_paired(T::part(row, nb, T::kScalePart) + 16 * s, count);
    // the offset meets the block's sum once: in its first lane
    if constexpr (T::kId == Q4_0::kId) offset = _mm512_maskz_mul_ps(0x5555, scale, _mm512_set1_ps(-8.0f));
    else offset = _mm512_maskz_mov_ps(0x5555, halves8_paired(T::part(row, nb, T::kMinPart) + 16 * s, count));
  }
};
template <>
struct Lanes<Q4_0> : LanesQ4<Q4_0> {};
template <>
struct Lanes<Q4_1> : LanesQ4<Q4_1> {};

// Q8_0: 8 blocks a step, block t's 32 int8 in lanes 2 t (bytes 0-15) and 2 t + 1 (16-31), as
// ActI16LaneHalves pairs them: a dword transpose (two blocks a vector in, lanes of 8 blocks out),
// each dword's bytes sign-extended into two pairs. Eight blocks rather than 16 a step: a row of
// 576 (SmolLM2's lm_head, 18 blocks) fills 24 lanes of blocks instead of 32.
template <>
struct Lanes<Q8_0> : LaneTraits<ActI16LaneHalves, 8, 2, false> {
  static void step(const uint8_t* row, int64_t nb, int64_t s, int64_t count, __m512i v[8], __m512& scale,
                   __m512& offset) {
    const uint8_t* quants = Q8_0::part(row, nb, Q8_0::kQuantPart) + 256 * s;
    __m512i z[4];
    for (int i = 0; i < 4; ++i)
      z[i] = _mm512_maskz_loadu_epi32(first_lanes(std::clamp<int64_t>(8 * count - 16 * i, 0, 16)), quants + 64 * i);
    // lanes 0-7 (block t = lane / 2, half h = lane % 2): dword 8 t + 4 h + d of a pair of
    // vectors; lanes 8-15: the same for d + 2
    const __m512i base = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 2, 6, 10, 14, 18, 22, 26, 30);
    for (int d = 0; d < 2; ++d) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(d));
      const __m512i a = _mm512_permutex2var_epi32(z[0], idx, z[1]), b = _mm512_permutex2var_epi32(z[2], idx, z[3]);
      const __m512i t[2] = {_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xee)};
      for (int e = 0; e < 2; ++e) {  // dword d + 2 e of each half
        const int dw = d + 2 * e;
        v[2 * dw] = _mm512_srai_epi16(_mm512_slli_epi16(t[e], 8), 8);
        v[2 * dw + 1] = _mm512_srai_epi16(t[e], 8);
      }
    }
    scale = halves8_paired(Q8_0::part(row, nb, Q8_0::kScalePart) + 16 * s, count);
    offset = _mm512_setzero_ps();
  }
};

// Q4_K: a step is one super-block, a lane half a 32-weight sub-block t (chunk t / 2's nibble
// t % 2): lane 2 t + h holds bytes 16 h .. 16 h + 15 of the chunk. Halves rather than whole
// sub-blocks over two super-blocks: one permute per dword from the super-block's own 128 bytes
// instead of two and a merge (measured, 8192x2048 one core, M = 1: 0.48 -> 0.33 ms)
template <>
struct Lanes<Q4_K> : LaneTraits<ActI16LaneHalves, 8, 2, true> {
  static void step(const uint8_t* row, int64_t nb, int64_t s, int64_t, __m512i v[8], __m512& scale,
                   __m512& offset) {
    const uint8_t* b = row + s * Q4_K::kBlockBytes;
    // lane 2 t + h: dword 8 (t / 2) + 4 h + d of the 128 quant bytes, shifted by 4 (t % 2)
    nibble_lanes(_mm512_loadu_si512(b + 16), _mm512_loadu_si512(b + 80),
                 _mm512_setr_epi32(0, 4, 0, 4, 8, 12, 8, 12, 16, 20, 16, 20, 24, 28, 24, 28),
                 _mm512_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4), v);
    alignas(16) uint8_t sc[16] = {}, mn[16] = {};
    k4_scales(b + 4, sc, mn);
    __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int*>(b)));  // d, dmin
    auto bytes8 = [](const uint8_t* p) {  // 8 bytes, each into two lanes
      return paired(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
    };
    scale = _mm512_mul_ps(_mm512_set1_ps(_mm_cvtss_f32(both)), bytes8(sc));
    // the offset meets the block's sum once: in its first lane
    offset = _mm512_maskz_mul_ps(0x5555, _mm512_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(both))), bytes8(mn));
  }
};

// Q6_K: a step is one super-block, a lane one 16-weight sub-block; weight w of the super-block
// is nibble w % 128 / 64 of ql byte 64 (w / 128) + w % 64 with bits 2 (w % 128 / 32) of qh byte
// 32 (w / 128) + w % 32 above it, minus 32 (the -32 goes with the activations' sums)
template <>
struct Lanes<Q6_K> : LaneTraits<ActI16Lanes16, 8, 1, true> {
  static void step(const uint8_t* row, int64_t nb, int64_t s, int64_t, __m512i v[8], __m512& scale,
                   __m512& offset) {
    const uint8_t* b = row + s * Q6_K::kBlockBytes;
    const __m512i z0 = _mm512_loadu_si512(b), z1 = _mm512_loadu_si512(b + 64), zh = _mm512_loadu_si512(b + 128);
    // lane l: ql dword 16 (l / 8) + 4 (l % 4) + d, qh dword 8 (l / 8) + 4 (l % 2) + d
    const __m512i ql_base = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 16, 20, 24, 28, 16, 20, 24, 28);
    const __m512i qh_base = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 8, 12, 8, 12, 8, 12, 8, 12);
    const __m512i ql_shift = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i qh_shift = _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 0, 0, 2, 2, 4, 4, 6, 6);
    const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(0x30), m = _mm512_set1_epi32(0x00ff00ff);
    for (int d = 0; d < 4; ++d) {
      const __m512i dd = _mm512_set1_epi32(d);
      const __m512i lo = _mm512_srlv_epi32(_mm512_permutex2var_epi32(z0, _mm512_add_epi32(ql_base, dd), z1), ql_shift);
      const __m512i hi = _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_add_epi32(qh_base, dd), zh), qh_shift);
      const __m512i q = _mm512_or_si512(_mm512_and_si512(lo, low), _mm512_and_si512(_mm512_slli_epi32(hi, 4), high));
      v[2 * d] = _mm512_and_si512(q, m);
      v[2 * d + 1] = _mm512_srli_epi16(q, 8);
    }
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    scale = _mm512_mul_ps(_mm512_set1_ps(half_to_float(b + 208)), sc);
    offset = _mm512_mul_ps(scale, _mm512_set1_ps(-32.0f));
  }
};

// The activations' block scales and exact sums as the lanes of each step take them (a block's
// in each of its lanes, zero past the last block): one load per step and row.
struct LaneScales {
  std::vector<float> scale, sum;
  int64_t steps = 0;

  void fill(const QuantizedActivations& a, int64_t M, int lanes_per_block) {
    const int64_t step_blocks = 16 / lanes_per_block;
    steps = (a.nb + step_blocks - 1) / step_blocks;
    scale.assign(M * steps * 16, 0.0f);
    sum.assign(M * steps * 16, 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < a.nb; ++j)
        for (int h = 0; h < lanes_per_block; ++h) {
          const int64_t lane = (m * steps + j / step_blocks) * 16 + (j % step_blocks) * lanes_per_block + h;
          scale[lane] = a.scale[m * a.nb + j];
          sum[lane] = a.sum[m * a.nb + j];
        }
  }
};

constexpr int64_t kLanesChunk = 64;  // weight rows per pass of every group of activation rows

// out[m0 + c, n] for c < C, n in [n0, n1) (at most kLanesChunk rows): each step unpacked once for
// the C rows; per (weight row, activation row) the block dots times weight scale * activation
// scale, and the offsets times the activations' exact sums, in two accumulators of 16 lanes,
// step after step, summed at the end. The steps go in panels whose activations (C rows) stay in
// L1 while the weight rows pass, the accumulators kept between panels: the order of the sums is
// the same for any C and panel. `stream`: the first pass over these rows (from memory, not L2)
// prefetches the next row as it goes. Without it the split rows of a long K stalled: one core,
// M = 1, 8192x8192 Q4_0 3.58 -> 1.18 ms, Q8_0 6.37 -> 1.91, Q4_K 1.58 -> 1.30 (two cores: Q4_0
// 1.78 -> 0.60, Q6_K 0.99 -> 0.77); 65536x2048 about the same.
template <class T, int C>
void lanes_rows(const QuantizedActivations& a, const LaneScales& ls, int64_t m0, int64_t K, const uint8_t* w,
                int64_t n0, int64_t n1, float* out, int64_t N, bool stream) {
  using L = Lanes<T>;
  constexpr int64_t kStepValues = L::kVecs * 32, kStepBlocks = 16 / L::kLanesPerBlock;
  // 16 KB of int16 activations per panel (L1 is 48 KB on Zen 5)
  constexpr int64_t kPanel = std::max<int64_t>(1, 8192 / (C * kStepValues));
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBlockBytes;
  const int64_t units = K / L::Act::kBlock, steps = (units + kStepBlocks - 1) / kStepBlocks;
  const int64_t whole = units / kStepBlocks;
  const int64_t fetch = (row_bytes + steps - 1) / steps;
  struct Sums {
    __m512 acc[C], extra[C];
  };
  thread_local std::vector<Sums> kept;
  const bool panels = steps > kPanel;
  if (panels) {
    kept.resize(kLanesChunk);
    for (int64_t n = n0; n < n1; ++n)
      for (int c = 0; c < C; ++c) kept[n - n0].acc[c] = kept[n - n0].extra[c] = _mm512_setzero_ps();
  }
  for (int64_t p0 = 0; p0 < steps; p0 += kPanel) {
    const int64_t p1 = std::min(steps, p0 + kPanel);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      __m512 acc[C], extra[C];
      for (int c = 0; c < C; ++c) {
        acc[c] = panels ? kept[n - n0].acc[c] : _mm512_setzero_ps();
        extra[c] = panels ? kept[n - n0].extra[c] : _mm512_setzero_ps();
      }
      auto step = [&](int64_t s, int64_t count) __attribute__((always_inline)) {
        if (stream)  // the next row, a step's share at a time
          for (int64_t o = s * fetch; o < std::min(row_bytes, (s + 1) * fetch); o += 64)
            _mm_prefetch(reinterpret_cast<const char*>(row + row_bytes + o), _MM_HINT_T0);
        __m512i v[L::kVecs];
        __m512 scale, offset;
        L::step(row, nb, s, count, v, scale, offset);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const int16_t* x = a.q.data() + (m0 + c) * a.stride + s * kStepValues;
          // independent sums (vpdpwssd's latency is ~5 cycles, two issue per cycle; fewer with
          // more rows, which interleave): integer sums, so the same dots in any grouping
          constexpr int kParts = C >= 4 ? 1 : C == 1 ? 4 : 2;
          __m512i part[kParts];
          for (auto& q : part) q = _mm512_setzero_si512();
#pragma GCC unroll 16
          for (int i = 0; i < L::kVecs; ++i)
            part[i % kParts] = _mm512_dpwssd_epi32(part[i % kParts], v[i], _mm512_loadu_si512(x + 32 * i));
          __m512i dots = part[0];
          for (int i = 1; i < kParts; ++i) dots = _mm512_add_epi32(dots, part[i]);
          const int64_t u = ((m0 + c) * ls.steps + s) * 16;
          acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scale, _mm512_loadu_ps(ls.scale.data() + u)), acc[c]);
          if constexpr (L::kHasOffset) extra[c] = _mm512_fmadd_ps(offset, _mm512_loadu_ps(ls.sum.data() + u), extra[c]);
        }
      };
      // whole steps with a constant count (no masks), then a short last one
      for (int64_t s = p0; s < std::min(p1, whole); ++s) step(s, kStepBlocks);
      if (whole < p1) step(whole, units - whole * kStepBlocks);
      if (p1 < steps) {
        for (int c = 0; c < C; ++c) {
          kept[n - n0].acc[c] = acc[c];
          kept[n - n0].extra[c] = extra[c];
        }
      } else {
        for (int c = 0; c < C; ++c) out[c * N + n] = _mm512_reduce_add_ps(acc[c]) + _mm512_reduce_add_ps(extra[c]);
      }
    }
  }
}

// any number of rows: groups of kLanesRows activation rows over chunks of 64 weight rows (kept
// in L2 while every group passes)
template <class T>
void lanes_matmul(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                  float* out, int64_t N) {
  thread_local LaneScales ls;
  ls.fill(a, M, Lanes<T>::kLanesPerBlock);
  for (int64_t c0 = n0; c0 < n1; c0 += kLanesChunk) {
    const int64_t c1 = std::min(n1, c0 + kLanesChunk);
    for (int64_t m = 0; m < M; m += kLanesRows) {
      float* o = out + m * N;
      switch (std::min<int64_t>(kLanesRows, M - m)) {
        case 1: lanes_rows<T, 1>(a, ls, m, K, w, c0, c1, o, N, m == 0); break;
        case 2: lanes_rows<T, 2>(a, ls, m, K, w, c0, c1, o, N, m == 0); break;
        case 3: lanes_rows<T, 3>(a, ls, m, K, w, c0, c1, o, N, m == 0); break;
        default: lanes_rows<T, kLanesRows>(a, ls, m, K, w, c0, c1, o, N, m == 0); break;
      }
    }
  }
}
#endif

}  // namespace tw
