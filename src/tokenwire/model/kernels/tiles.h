// The register-tiled integer matmul of the common types (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), for any
// number of activation rows, decode included: ONE arithmetic per type whatever M is.
//
// Activations: int8, one scale per 32 values (round to nearest, scale = max|x| / 127), with each
// block's exact fp32 sum and its integer sums (ActI8, one format for the five types). Weights:
// each thread converts a strip of kTileRows weight rows (16 with AVX-512, 8 with AVX2) into an
// L1/L2 buffer (tiles_types.h): per 32-weight unit, 8 vectors whose dword lane r holds 4
// consecutive unsigned weights of row r, and two vectors of per-row floats (scale, offset). The
// micro-kernel then multiplies the buffer by up to kTileTokens activation rows at once: per
// token one accumulator whose lanes are the strip's rows (no horizontal sums), 4 activation
// bytes broadcast per vpdpbusd (AVX2: vpmaddubsw, two summed in int16, then vpmaddwd), the
// buffer shared by every token of the call.
//
// Batch invariance: per (weight row, activation row) the sum is, unit after unit,
//   acc = fma(float(idot_u), wscale_u * xscale_u, acc)   (Q6_K: its two 16-weight halves, one
//   fma each), offset types also off = fma(woffset_u, xsum_u, off), and acc + off at the end,
// where idot_u is an exact integer. The lanes are rows and the tokens have accumulators of their
// own, so neither the strip a row falls in nor the tokens beside it can change its bits: alone,
// in a batch of 32, a prefill chunk, speculative verification, decode.
//
// Centring: the unsigned weights carry their zero point z (Q4_*: 8, Q6_K: 32, Q8_0: 128 on
// AVX-512) and the integer dot subtracts z * (the activations' integer sum) exactly, so the
// activation rounding errors meet q - z (|q - 8| <= 8) rather than q (<= 15): the int8 error of
// a Q4 dot is about half what it would be uncentred. Q4_1's minimum and Q4_K's (with the 8 d sc
// the centring moved) multiply the exact fp32 block sums.
//
// Measured (Zen 5 EPYC VM, 2 threads, 8192x2048, GFLOP/s, min of calls; old = the int16 kernels
// of the commit before, same sitting; the machine shared with other work):
//                      M = 1          M = 32          M = 256
//   AVX-512  Q4_0    72 -> 164      90 -> 424      187 -> 527
//            Q4_1   130 -> 151     192 -> 477      153 -> 537
//            Q8_0   121 ->  94     171 -> 398      167 -> 598
//            Q4_K   116 -> 116     169 -> 380      190 -> 482
//            Q6_K    98 ->  65     166 -> 372      201 -> 505
//   AVX2     Q4_0   113 ->  90      88 -> 222       91 -> 268
//            Q4_1   101 -> 108      96 -> 309      132 -> 318
//            Q8_0   102 ->  56      99 -> 167      142 -> 177
//            Q4_K   123 ->  82     145 -> 212      145 -> 219
//            Q6_K    85 ->  52      94 -> 192       94 -> 230
// (M = 1: the strips on AVX2, the unit lanes on AVX-512; decode rows, M < 4, now take
// tiles_decode.h's row lanes on both builds, its header has their figures.) One core, M = 256:
// 250-310 GFLOP/s.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "blocks.h"

namespace tw {

// The int8 activation format: 32 values a block, stored in order (4 bytes a dword, the order
// the buffers' dword lanes take). Per block also, in QuantizedActivations::bias, its integer
// sums times minus each zero point: [-8 sum, -32 sum(0..15), -32 sum(16..31), -128 sum].
struct ActI8 {
  static constexpr const char* kName = "i8_32";
  static constexpr int kBlock = 32;
  static constexpr int kBias = 4;
  static int64_t stride(int64_t K) { return K / 2; }  // int16 slots: K bytes
};

// 32 int8 values into block j of a row, with their integer sums times minus each zero point
inline void store_block_i8(const int32_t q[32], int16_t* row, int64_t j, int32_t* bias) {
  int8_t* dst = reinterpret_cast<int8_t*>(row) + 32 * j;
  int32_t lo = 0, hi = 0;
  for (int i = 0; i < 32; ++i) {
    dst[i] = static_cast<int8_t>(q[i]);
    (i < 16 ? lo : hi) += q[i];
  }
  bias[0] = -8 * (lo + hi);
  bias[1] = -32 * lo;
  bias[2] = -32 * hi;
  bias[3] = -128 * (lo + hi);
}

inline void quantize_block_i8(const float* xb, int16_t* row, int64_t j, float* scale, float* sum, int32_t* bias) {
  float mx = 0, total = 0;
  for (int i = 0; i < 32; ++i) total += xb[i];  // one serial chain in value order (blocks.h)
  int32_t q[32];
#ifdef TW_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (const float lane : lanes) mx = std::max(mx, lane);
  const __m256 inv = _mm256_set1_ps(mx > 0 ? 127.0f / mx : 0.0f);
  for (int i = 0; i < 32; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv)));
#else
  for (int i = 0; i < 32; ++i) mx = std::max(mx, std::fabs(xb[i]));
  const float inv = mx > 0 ? 127.0f / mx : 0.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
#endif
  store_block_i8(q, row, j, bias);
  *scale = mx / 127.0f;
  *sum = total;
}

// The lm_head's activations: ~15 bits in two int8 rows. Per block q = round(x * 16256 / max|x|)
// = 128 h + l with h in [-127, 127] and l in [-64, 63] (both inside the +-127 the kernels take,
// AVX2's vpmaddubsw sums included): row m of `out` holds h (scale 128 s,
// the block's exact sum), row M + m holds l (scale s, sum 0: the offset terms count once), so
// one tiled matmul over 2M rows gives both halves and out[m] + out[M + m] is the product with
// x rounded to 1/16256 of its block's maximum instead of 1/127. The integer dots stay exact,
// each half is a row like any other (its bits whatever its company), and the two are added in
// one fixed order. Why the head: `tokenwire bench quality` on the shipped SmolLM2 (Q8_0 head),
// 2,000 tokens, against the exact model: int8 everywhere top-1 96.25%, mean |dlogprob| 6.43e-2;
// the head's input exact (the rest int8) 96.80%, 5.50e-2; llama.cpp on the same file 96.35%,
// 5.96e-2. The head is ~20% of a 32-stream step's arithmetic (this doubles it) and one row of
// a prefill chunk's.
inline void quantize_rows_i8_pair(const float* x, int64_t M, int64_t K, const ActFormat& i8, QuantizedActivations& out) {
  out.reset(2 * M, K, i8);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < out.nb; ++j) {
      const float* xb = x + m * K + 32 * j;
      float mx = 0, total = 0;
      for (int i = 0; i < 32; ++i) total += xb[i];  // the same serial chain as quantize_block_i8
      for (int i = 0; i < 32; ++i) mx = std::max(mx, std::fabs(xb[i]));
      const float inv = mx > 0 ? 16256.0f / mx : 0.0f;
      int32_t h[32], l[32];
      for (int i = 0; i < 32; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
        h[i] = (q + 64) >> 7;  // q / 128 rounded (arithmetic shift)
        l[i] = q - 128 * h[i];
      }
      const int64_t hb = m * out.nb + j, lb = (M + m) * out.nb + j;
      store_block_i8(h, out.q.data() + m * out.stride, j, out.bias.data() + hb * ActI8::kBias);
      store_block_i8(l, out.q.data() + (M + m) * out.stride, j, out.bias.data() + lb * ActI8::kBias);
      out.scale[hb] = mx * 128.0f / 16256.0f;
      out.scale[lb] = mx / 16256.0f;
      out.sum[hb] = total;
      out.sum[lb] = 0.0f;
    }
  }
}

#ifdef TW_AVX2
// 16 bytes at offset `off` of 8 rows -> out[k] lane r = dword k of row r: the AVX2 strips'
// conversion step, and tiles_decode.h's row lanes' per-row scales (on either build)
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

// ---------------------------------------------------------------------------------------------
// The instruction sets: a strip of kRows weight rows, one per dword lane.
#ifdef TW_AVX512
struct TileIsa {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;
  static constexpr int kTokens = 8;  // accumulators: 8 tokens x (int, float, offset) + weights
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
  // the fp16 values in the low / high halves of each dword
  static F half_lo(I a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a)); }
  static F half_hi(I a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16))); }
  // acc + the dot of 4 unsigned weight bytes (per lane) and 4 signed activation bytes at x
  static I dp2(I acc, I w0, I w1, const int8_t* x) {
    int32_t a, b;
    std::memcpy(&a, x, 4);
    std::memcpy(&b, x + 4, 4);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, w0, _mm512_set1_epi32(a)), w1, _mm512_set1_epi32(b));
  }
  static constexpr bool kSignedQ8 = false;  // Q8_0 runs as unsigned q + 128 (vpdpbusd)
  static I dp2_signed(I acc, I w0, I w1, const int8_t* x) { return dp2(acc, w0, w1, x); }  // unused
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
  static F half_lo(I a) {  // the low halves (packus keeps 0..65535), lanes' order restored
    const I lo = _mm256_and_si256(a, _mm256_set1_epi32(0xffff));
    const I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
  }
  static F half_hi(I a) { return half_lo(_mm256_srli_epi32(a, 16)); }
  // two vpmaddubsw summed in int16 (4-bit weights: |sum| <= 4 * 15 * 127; Q6_K's 6-bit: <= 4 *
  // 63 * 127 = 32004, still inside int16), then one vpmaddwd: 1.33x the multiply-adds per
  // instruction of a vpmaddwd per pair
  static I dp2(I acc, I w0, I w1, const int8_t* x) {
    int32_t a, b;
    std::memcpy(&a, x, 4);
    std::memcpy(&b, x + 4, 4);
    const I s = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(a)), _mm256_maddubs_epi16(w1, _mm256_set1_epi32(b)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  }
  // Q8_0's signed weights: |w| times x with w's sign (vpsignb), one vpmaddubsw each (|w| 128 *
  // 127 * 2 fits int16; two would not)
  static constexpr bool kSignedQ8 = true;
  static I dp2_signed(I acc, I w0, I w1, const int8_t* x) {
    int32_t a, b;
    std::memcpy(&a, x, 4);
    std::memcpy(&b, x + 4, 4);
    const I one = _mm256_set1_epi16(1);
    const I p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(_mm256_set1_epi32(a), w0));
    const I p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(_mm256_set1_epi32(b), w1));
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(p0, one), _mm256_madd_epi16(p1, one)));
  }
  static void transpose(const uint8_t* const* rows, int64_t off, I out[4]) { transpose8(rows, off, out); }
};
#endif

using TI = TileIsa::I;
using TF = TileIsa::F;
constexpr int kTileRows = TileIsa::kRows;
constexpr int kTileTokens = TileIsa::kTokens;
// a converted 32-weight unit: 8 weight vectors, then two of per-row floats
constexpr int kUnitVecs = 10;

// A type's tile traits (tiles_types.h): Tile<T>::kHas, kHalves (1: one scale a unit; 2: Q6_K's
// two 16-weight halves, each its own scale), kOffset (an offset times the exact block sums),
// kBias (which of ActI8's integer sums starts the dot: 0 z = 8, 1 z = 32 by halves, 3 z = 128,
// -1 none) and kBiasTimes (that sum taken twice: Q5's z = 16), kSigned (weights signed: Q8_0 on
// AVX2), and convert(rows, nb, buf).
template <class T>
struct Tile {
  static constexpr bool kHas = false;
};

// out[t][r] for tokens [m0, m0 + NT) against a strip's converted units
template <class T, int NT>
void tile_tokens(const TI* buf, int64_t units, const QuantizedActivations& a, int64_t m0, float* res) {
  using V = TileIsa;
  using Tr = Tile<T>;
  constexpr int H = Tr::kHalves;
  const int8_t* x0 = reinterpret_cast<const int8_t*>(a.q.data()) + m0 * a.stride * 2;
  const int64_t xstride = a.stride * 2, nb = a.nb;
  const float* xs0 = a.scale.data() + m0 * nb;
  const float* xsum0 = a.sum.data() + m0 * nb;
  const int32_t* bias0 = a.bias.data() + m0 * nb * ActI8::kBias;
  TF acc[NT], off[NT];
  for (int t = 0; t < NT; ++t) acc[t] = off[t] = V::zerof();
  for (int64_t u = 0; u < units; ++u) {
    const TI* w = buf + u * kUnitVecs;
    TI ia[NT][H];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < H; ++h) {
        const int32_t* b = bias0 + (t * nb + u) * ActI8::kBias;
        ia[t][h] = Tr::kBias < 0 ? V::set1(0) : V::set1(Tr::kBiasTimes * b[H == 2 ? 1 + h : Tr::kBias]);
      }
#pragma GCC unroll 4
    for (int k = 0; k < 8; k += 2) {
      const TI w0 = w[k], w1 = w[k + 1];
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        const int8_t* x = x0 + t * xstride + 32 * u + 4 * k;
        TI& dst = ia[t][H == 2 ? k / 4 : 0];
        if constexpr (Tr::kSigned) dst = V::dp2_signed(dst, w0, w1, x);
        else dst = V::dp2(dst, w0, w1, x);
      }
    }
    const TF s0 = V::as_f(w[8]), s1 = V::as_f(w[9]);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const TF xs = V::bcastf(xs0 + t * nb + u);
      acc[t] = V::fma(V::cvt(ia[t][0]), V::mul(s0, xs), acc[t]);
      if constexpr (H == 2) acc[t] = V::fma(V::cvt(ia[t][1]), V::mul(s1, xs), acc[t]);
      if constexpr (Tr::kOffset) off[t] = V::fma(s1, V::bcastf(xsum0 + t * nb + u), off[t]);
    }
  }
  for (int t = 0; t < NT; ++t) V::storef(res + t * kTileRows, Tr::kOffset ? V::add(acc[t], off[t]) : acc[t]);
}

// out[m, n] = x[m] . W[n] for n in [n0, n1), any M: strips of kTileRows rows (a short last one
// repeats its last row, computed and not stored), each converted once and run against every
// group of kTileTokens activation rows
template <class T>
void tile_matmul(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                 float* out, int64_t N) {
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBlockBytes, units = K / 32;
  thread_local std::vector<uint8_t> storage;  // the strip's units, 64-byte aligned
  storage.resize(units * kUnitVecs * sizeof(TI) + 64);
  TI* buf = reinterpret_cast<TI*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  alignas(64) float res[kTileTokens * kTileRows];
  for (int64_t s = n0; s < n1; s += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, n1 - s);
    const uint8_t* ptrs[kTileRows];
    for (int r = 0; r < kTileRows; ++r) ptrs[r] = w + (s + std::min<int64_t>(r, rows - 1)) * row_bytes;
    // the next strip into L2 while this one converts: 16 rows read side by side outrun the
    // hardware's stream prefetchers
    if (s + kTileRows < n1)
      for (int64_t o = 0; o < std::min<int64_t>(kTileRows, n1 - s - kTileRows) * row_bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + (s + kTileRows) * row_bytes + o), _MM_HINT_T1);
    Tile<T>::convert(ptrs, nb, buf);
    for (int64_t m = 0; m < M; m += kTileTokens) {
      const int64_t count = std::min<int64_t>(kTileTokens, M - m);
      switch (count) {
#define TW_TILE_CASE(n) \
  case n: tile_tokens<T, (n <= kTileTokens ? n : kTileTokens)>(buf, units, a, m, res); break;
        TW_TILE_CASE(1) TW_TILE_CASE(2) TW_TILE_CASE(3) TW_TILE_CASE(4) TW_TILE_CASE(5) TW_TILE_CASE(6)
        TW_TILE_CASE(7) TW_TILE_CASE(8)
#undef TW_TILE_CASE
      }
      for (int64_t t = 0; t < count; ++t)
        for (int64_t r = 0; r < rows; ++r) out[(m + t) * N + s + r] = res[t * kTileRows + r];
    }
  }
}
#endif

}  // namespace tw
