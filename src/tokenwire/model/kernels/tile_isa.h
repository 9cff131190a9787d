// The instruction sets of the tiled int8 matmul (tiles.h): a strip of TileIsa::kRows weight rows,
// one per dword lane (AVX-512: 16, vpdpbusd; AVX2: 8, vpmaddubsw + vpmaddwd), their vector
// operations, the transposes that read split rows, and a unit's integer dots.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via tiles.h).
#pragma once

#include "blocks.h"

namespace tw {

#ifdef TW_AVX2
// 16 bytes at offset `off` of 8 rows -> out[k] lane r = dword k of row r: the AVX2 strips'
// conversion step
inline void transpose8(const uint8_t* const* rows, int64_t off, __m256i out[4]) {
  using I = __m256i;
  I v[4];
  for (int p = 0; p < 4; ++p) {
    auto ld = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + off)); };
    v[p] = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(p)), ld(4 + p), 1);
  }
  const I t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const I t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// a converted 32-weight unit: 8 weight vectors, then two of per-row floats
constexpr int kUnitVecs = 10;

// ---------------------------------------------------------------------------------------------
// The instruction sets: a strip of kRows weight rows, one per dword lane.
#ifdef TW_AVX512
struct TileIsa {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;
  static constexpr int kTokens = 8;  // accumulators: 8 tokens x (int, float, offset) + weights
  // Decode prefetches each laid-out read (tiles.h's LaidSrc: 4 vectors at p) 12 KB ahead, into
  // L2, where more lines can be in flight than into L1. It streams every weight once, so this
  // sets how much of DRAM's bandwidth it gets: 2 threads, M = 1, ten 8960x1536 / 1536x8960 Q4_K
  // and 8192x2048 Q6_K matrices in turn, GB/s, three rounds interleaved: into L1 8 KB ahead
  // (the setting before, still AVX2's) 33/30/30, 27/31/29, 28/24/25; L2 12 KB 30/34/27,
  // 38/37/33, 38/39/28; L2 16 KB 29-39 (a torch sum reads 47-52 GB/s there). qwen2.5-1.5b
  // Q4_K_M greedy decode, this code against L1 8 KB (medians of 3 x 64 tokens, 3 interleaved
  // pairs): 25.8 -> 41.9, 24.4 -> 30.8, 27.3 -> 30.0 tok/s; llama-1b 37.3 -> 56.5, 35.5 -> 40.3,
  // 37.5 -> 40.8. The last line: p is unaligned in Q6_K's odd rows.
  static void prefetch_ahead(const I* p) {
    const char* at = reinterpret_cast<const char*>(p) + 12288;
    for (int line = 0; line < 4; ++line) _mm_prefetch(at + 64 * line, _MM_HINT_T1);
    _mm_prefetch(at + 4 * sizeof(I) - 1, _MM_HINT_T1);
  }
  static I set1(int v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I srl(I a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
  template <int S> static I srli(I a) { return _mm512_srli_epi32(a, S); }
  template <int S> static I slli(I a) { return _mm512_slli_epi32(a, S); }
  template <int S> static I srai(I a) { return _mm512_srai_epi32(a, S); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F setf(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F bcastf(const float* p) { return _mm512_set1_ps(*p); }
  static I bcasti(const int32_t* p) { return _mm512_set1_epi32(*p); }
  static F as_f(I a) { return _mm512_castsi512_ps(a); }
  static I as_i(F a) { return _mm512_castps_si512(a); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static I load(const I* p) { return _mm512_loadu_si512(p); }
  static void store(I* p, I v) { _mm512_store_si512(p, v); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // each byte (0..15) replaced by that byte of `table` (IQ4's non-linear values)
  static I lookup16(__m128i table, I idx) { return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), idx); }
  // the fp16 values in the low / high halves of each dword
  static F half_lo(I a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a)); }
  static F half_hi(I a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16))); }
  // a unit's integer dots, for S strips side by side (w: S units of kUnitVecs vectors):
  // ia[j][t][h] += weight vector k of strip j (4 unsigned bytes a lane) times the 4 activation
  // bytes at xu + t xstride + 4 k, k in half h (Tr::kHalves = 2: k / 4): one vpdpbusd each
  // (Q8_0 runs as unsigned q + 128, so Tr::kSigned is never set)
  static constexpr bool kSignedQ8 = false;
  template <class Tr, int S, int NT, int H>
  static void unit_dots(const I* w, const int8_t* xu, int64_t xstride, I ia[S][NT][H]) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k)
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        int32_t a;
        std::memcpy(&a, xu + t * xstride + 4 * k, 4);
        const I xb = _mm512_set1_epi32(a);
        for (int j = 0; j < S; ++j) {
          I& dst = ia[j][t][H == 2 ? k / 4 : 0];
          dst = _mm512_dpbusd_epi32(dst, w[j * kUnitVecs + k], xb);
        }
      }
  }
  // 16 bytes at offset `off` of each row -> 4 vectors, vector k lane r = dword k of row r: row
  // 4 L + p in lane L of vector p, then a 4x4 dword transpose inside each 128-bit lane
  static void transpose(const uint8_t* const* rows, int64_t off, I out[4]) {
    I v[4];
    for (int p = 0; p < 4; ++p) {
      auto ld = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + off)); };
      const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(p)), ld(4 + p), 1);
      const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(8 + p)), ld(12 + p), 1);
      v[p] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const I t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    const I t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
  }
};
#else
struct TileIsa {
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;
  static constexpr int kTokens = 4;  // 16 registers: 4 tokens x (int, float, offset) + weights
  // Decode's prefetches (as AVX-512's): into L1 8 KB ahead, one a vector. AVX2's decode is
  // bound by its arithmetic more than by DRAM (from L3, 2 threads: Q4_K 46-49 GB/s, Q6_K 34-39;
  // AVX-512 72 and 64) and wants its bytes in L1: same matrices as AVX-512's, GB/s, three
  // rounds: L1 8 KB 35/29/33, 34/31/32, 32/28/30; L2 12 KB 31/30/29, 32/32/27, 30/30/27.
  static void prefetch_ahead(const I* p) {
    for (int k = 0; k < 4; ++k) _mm_prefetch(reinterpret_cast<const char*>(p + k) + 8192, _MM_HINT_T0);
  }
  static I set1(int v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I srl(I a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
  template <int S> static I srli(I a) { return _mm256_srli_epi32(a, S); }
  template <int S> static I slli(I a) { return _mm256_slli_epi32(a, S); }
  template <int S> static I srai(I a) { return _mm256_srai_epi32(a, S); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F setf(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F bcastf(const float* p) { return _mm256_broadcast_ss(p); }
  static I bcasti(const int32_t* p) { return _mm256_set1_epi32(*p); }
  static F as_f(I a) { return _mm256_castsi256_ps(a); }
  static I as_i(F a) { return _mm256_castps_si256(a); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static I load(const I* p) { return _mm256_loadu_si256(p); }
  static void store(I* p, I v) { _mm256_store_si256(p, v); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I lookup16(__m128i table, I idx) { return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), idx); }
  static F half_lo(I a) {  // the low halves (packus keeps 0..65535), lanes' order restored
    const I lo = _mm256_and_si256(a, _mm256_set1_epi32(0xffff));
    const I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
  }
  static F half_hi(I a) { return half_lo(_mm256_srli_epi32(a, 16)); }
  // a unit's integer dots (as AVX-512's): per weight vector one vpmaddubsw (4 unsigned bytes a
  // lane times the 4 activation bytes, in int16 pairs; Q8_0's signed weights, Tr::kSigned: |w|
  // times x with w's sign, vpsignb), Tr::kSum16 of them summed in int16 before one vpmaddwd
  // widens them. 4-bit weights: all 8 (|sum| <= 16 * 15 * 127 = 30480), one vpmaddwd a unit
  // where a vpmaddwd per two took 4. Each activation broadcast serves the S strips.
  static constexpr bool kSignedQ8 = true;
  template <class Tr, int S, int NT, int H>
  static void unit_dots(const I* w, const int8_t* xu, int64_t xstride, I ia[S][NT][H]) {
    constexpr int G = Tr::kSum16;
    static_assert(H == 1 || G <= 4, "a sum never crosses Q6_K's halves");
    auto product = [](I wk, const int8_t* x) {
      int32_t a;
      std::memcpy(&a, x, 4);
      const I xb = _mm256_set1_epi32(a);
      return Tr::kSigned ? _mm256_maddubs_epi16(_mm256_abs_epi8(wk), _mm256_sign_epi8(xb, wk)) : _mm256_maddubs_epi16(wk, xb);
    };
    auto widen_into = [](I& dst, I s16) { dst = _mm256_add_epi32(dst, _mm256_madd_epi16(s16, _mm256_set1_epi16(1))); };
#pragma GCC unroll 8
    for (int g = 0; g < 8; g += G) {
      const int h = H == 2 ? g / 4 : 0;  // the half the group's weights are in
      // G <= 2 (Q6_K, Q8_0): a token's group at a time, no sums held across tokens (the order
      // below measured 3-10 % slower for Q6_K: its two halves' sums take the registers)
      if constexpr (G <= 2) {
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t)
          for (int j = 0; j < S; ++j) {
            I s16 = product(w[j * kUnitVecs + g], xu + t * xstride + 4 * g);
            for (int k = g + 1; k < g + G; ++k) s16 = _mm256_add_epi16(s16, product(w[j * kUnitVecs + k], xu + t * xstride + 4 * k));
            widen_into(ia[j][t][h], s16);
          }
      } else {  // a weight vector at a time, each activation broadcast serving the S strips
        I s16[S][NT];
#pragma GCC unroll 8
        for (int k = g; k < g + G; ++k) {
          I wk[S];
          for (int j = 0; j < S; ++j) wk[j] = w[j * kUnitVecs + k];
#pragma GCC unroll 8
          for (int t = 0; t < NT; ++t)
            for (int j = 0; j < S; ++j) {
              const I p = product(wk[j], xu + t * xstride + 4 * k);
              s16[j][t] = k == g ? p : _mm256_add_epi16(s16[j][t], p);
              // opaque to the compiler: GCC otherwise re-associates the sums into a tree, issues
              // every product first and spills them (measured 18 % slower than the pairs before)
              asm("" : "+x"(s16[j][t]));
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t)
          for (int j = 0; j < S; ++j) widen_into(ia[j][t][h], s16[j][t]);
      }
    }
  }
  static void transpose(const uint8_t* const* rows, int64_t off, I out[4]) { transpose8(rows, off, out); }
};
#endif

using TI = TileIsa::I;
using TF = TileIsa::F;
constexpr int kTileRows = TileIsa::kRows;
constexpr int kTileTokens = TileIsa::kTokens;
#endif

}  // namespace tw
