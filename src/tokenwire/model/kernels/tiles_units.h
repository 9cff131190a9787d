// The tiled types' decode rows (M < kUnitTokens) on AVX-512: the same bits as tiles.h's strips,
// without their transposition of every weight. A row's 16 consecutive units are unpacked from
// its own contiguous bytes (a few permutes, lane = unit), the integer dots run in unit lanes, and
// only the results are transposed (16 x 16 per 16 rows and 16 units, 32x fewer values than the
// weights): per row r and unit u the same integer dot, the same product wscale * xscale, and the
// same fma chain over u with lanes = rows as the strips, so a row's bits do not depend on the path.
// Why these and not tiles_decode.h's row lanes on AVX-512: rows read one after the other, the
// next prefetched, stream from DRAM better than 8 rows side by side. Real-model decode, llama-1b
// Q4_K_M shape, greedy, median of 5, same sitting: unit lanes 29.8 tok/s, row lanes with their
// strip prefetch 27.3 (the row lanes win on cache-warm 8192x2048 matrices, tiles_decode.h's
// table, and on AVX2, where there are no unit lanes: 25.5 against the strips' 20.0).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via tiles_decode.h).
#pragma once

#include "tiles_types.h"

namespace tw {

#ifdef TW_AVX512
constexpr int64_t kUnitTokens = 4;  // fewer activation rows than this take the unit lanes

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1);
}

// r[i] lane j -> r[j] lane i
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}

// the activations of a few rows in unit lanes: per token and group of 16 units, 8 vectors (lane
// u: bytes 4k .. 4k + 3 of unit u), ActI8's 4 integer sums, scales and exact sums by lane
struct UnitActs {
  std::vector<int32_t> x, bias;
  std::vector<float> xs, xsum;
  int64_t groups = 0;
  void fill(const QuantizedActivations& a, int64_t M) {
    const int64_t units = a.nb;
    groups = (units + 15) / 16;
    x.assign(M * groups * 128, 0);
    bias.assign(M * groups * 64, 0);
    xs.assign(M * groups * 16, 0.0f);
    xsum.assign(M * groups * 16, 0.0f);
    for (int64_t t = 0; t < M; ++t) {
      const int8_t* row = reinterpret_cast<const int8_t*>(a.q.data()) + t * a.stride * 2;
      for (int64_t u = 0; u < units; ++u) {
        const int64_t g = u / 16, lane = u % 16, base = t * groups + g;
        for (int k = 0; k < 8; ++k) std::memcpy(&x[(base * 8 + k) * 16 + lane], row + 32 * u + 4 * k, 4);
        for (int b = 0; b < 4; ++b) bias[(base * 4 + b) * 16 + lane] = a.bias[(t * units + u) * 4 + b];
        xs[base * 16 + lane] = a.scale[t * units + u];
        xsum[base * 16 + lane] = a.sum[t * units + u];
      }
    }
  }
};

inline __m512i dwords_from_pairs(__m512i a0, __m512i a1, __m512i b0, __m512i b1, __m512i idx) {
  // lanes 0-7 from (a0, a1), 8-15 from (b0, b1), the same index vector
  return _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(a0, idx, a1), _mm512_permutex2var_epi32(b0, idx, b1));
}

// A type's unit lanes: group g (units 16 g .. 16 g + count - 1) of a row -> W[k] lane u the
// unsigned bytes 4k .. 4k + 3 of unit u, s0 / s1 its two floats (tiles_types.h's u[8], u[9])
template <class T>
struct UnitLanes;

template <class T>
struct UnitLanes32 {
  static void group(const uint8_t* row, int64_t nb, int64_t g, int64_t count, __m512i W[8], __m512& s0, __m512& s1) {
    using V = TileIsa;
    const int64_t j = 16 * g;
    const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(count), row + nb * T::part_offset(T::kScalePart) + 2 * j));
    s0 = d;
    if constexpr (Block32<T>::kMin) {
      const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(count), row + nb * T::part_offset(T::kMinPart) + 2 * j));
      s1 = V::add(m, V::mul(V::setf(Block32<T>::kZero), d));
    } else {
      s1 = _mm512_setzero_ps();
    }
    const uint8_t* q = row + nb * T::part_offset(T::kQuantPart);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if constexpr (T::kId == Q8_0::kId) {  // 32 bytes a unit: 8 vectors of 2 units
      __m512i z[8];
      for (int i = 0; i < 8; ++i)
        z[i] = _mm512_maskz_loadu_epi32(first_lanes(std::clamp<int64_t>(8 * count - 16 * i, 0, 16)), q + 32 * j + 64 * i);
      const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
      for (int k = 0; k < 8; ++k) {  // lane u: dword 8 (u % 4) + k of pair u / 4
        const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(3)), 3), _mm512_set1_epi32(k));
        const __m512i lo = dwords_from_pairs(z[0], z[1], z[4], z[5], idx), hi = dwords_from_pairs(z[2], z[3], z[6], z[7], idx);
        W[k] = _mm512_xor_si512(_mm512_mask_blend_epi32(0xf0f0, lo, hi), flip);
      }
    } else if constexpr (Block32<T>::kFive) {
      // 20 bytes a unit, dwords 5 u (qh) .. 5 u + 4 (nibbles): dwords 0-79 of the group in five
      // vectors, lane u of a pick takes dword 5 u + c from the first two, the next two or the
      // last one (vpgatherdd measured slower than the strips: gemma3-1b 43.7 vs 47.0 tok/s)
      __m512i z[5];
      for (int i = 0; i < 5; ++i)
        z[i] = _mm512_maskz_loadu_epi32(first_lanes(std::clamp<int64_t>(5 * count - 16 * i, 0, 16)), q + 20 * j + 64 * i);
      const __m512i five = _mm512_mullo_epi32(lane, _mm512_set1_epi32(5));
      auto pick = [&](int c) {
        const __m512i idx = _mm512_add_epi32(five, _mm512_set1_epi32(c));
        const __m512i a = _mm512_permutex2var_epi32(z[0], idx, z[1]), b = _mm512_permutex2var_epi32(z[2], idx, z[3]);
        const __m512i e = _mm512_permutexvar_epi32(idx, z[4]);
        const __mmask16 in_b = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32));
        const __mmask16 in_e = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(64));
        return _mm512_mask_blend_epi32(in_e, _mm512_mask_blend_epi32(in_b, a, b), e);
      };
      const __m512i low = _mm512_set1_epi32(0x0f0f0f0f);
      for (int k = 0; k < 4; ++k) {
        const __m512i v = pick(1 + k);
        W[k] = _mm512_and_si512(v, low);
        W[4 + k] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
      }
      add_q5_high(pick(0), W);
    } else {  // 16 bytes a unit: 4 vectors of 4 units
      __m512i z[4];
      for (int i = 0; i < 4; ++i)
        z[i] = _mm512_maskz_loadu_epi32(first_lanes(std::clamp<int64_t>(4 * count - 16 * i, 0, 16)), q + 16 * j + 64 * i);
      const __m512i low = _mm512_set1_epi32(0x0f0f0f0f);
      for (int k = 0; k < 4; ++k) {  // lane u: dword 4 (u % 8) + k of (z0, z1) or (z2, z3)
        const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(7)), 2), _mm512_set1_epi32(k));
        const __m512i v = dwords_from_pairs(z[0], z[1], z[2], z[3], idx);
        W[k] = _mm512_and_si512(v, low);
        W[4 + k] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
      }
    }
  }
};
template <>
struct UnitLanes<Q4_0> : UnitLanes32<Q4_0> {};
template <>
struct UnitLanes<Q4_1> : UnitLanes32<Q4_1> {};
template <>
struct UnitLanes<Q8_0> : UnitLanes32<Q8_0> {};
template <>
struct UnitLanes<Q5_0> : UnitLanes32<Q5_0> {};
template <>
struct UnitLanes<Q5_1> : UnitLanes32<Q5_1> {};


// Q4_K, Q5_K: a group is two super-blocks (the second absent where count is 8); Q5_K's high
// bits: lane u takes qh dword k of its super-block, bit u % 8 of each byte
template <class T, bool kHigh>
struct UnitLanesK45 {
  static void group(const uint8_t* row, int64_t, int64_t g, int64_t count, __m512i W[8], __m512& s0, __m512& s1) {
    using V = TileIsa;
    constexpr int q0 = Tile<T>::kQuants;
    const uint8_t* a = row + 2 * g * T::kBlockBytes;
    const uint8_t* b = count > 8 ? a + T::kBlockBytes : a;
    // both super-blocks' 6-bit scales and minimums at once (k4_scales' bit layout on dwords):
    // scalar unpacking was a third of this path's time (perf, Q4_K 8192x2048 M = 1)
    const __m128i xa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 4));
    const __m128i xb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i p = _mm_unpacklo_epi32(xa, xb), c = _mm_unpackhi_epi32(xa, xb);  // [A B] [C .]
    const __m128i low6 = _mm_set1_epi32(0x3f3f3f3f), low4 = _mm_set1_epi32(0x0f0f0f0f), top2 = _mm_set1_epi32(0x30303030);
    const __m128i lo = _mm_and_si128(p, low6);  // sc bytes 0-3 of a, of b; m bytes 0-3 of a, of b
    const __m128i top = _mm_and_si128(_mm_srli_epi32(p, 2), top2);
    const __m128i sc_hi = _mm_or_si128(_mm_and_si128(c, low4), top);
    const __m128i m_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(c, 4), low4), _mm_unpackhi_epi64(top, top));
    const __m128i sc = _mm_unpacklo_epi32(lo, sc_hi), mn = _mm_unpacklo_epi32(_mm_unpackhi_epi64(lo, lo), m_hi);
    auto bytes16 = [](__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); };
    // d, dmin of a and of b in one conversion, then spread: lanes 0-7 a's, 8-15 b's
    int32_t ha, hb;
    std::memcpy(&ha, a, 4);
    std::memcpy(&hb, b, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(ha), _mm_cvtsi32_si128(hb)));
    const __m512 dd4 = _mm512_castps128_ps512(dd);
    const __m512i pick_d = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512 d = _mm512_permutexvar_ps(pick_d, dd4);
    const __m512 dmin = _mm512_permutexvar_ps(_mm512_add_epi32(pick_d, _mm512_set1_epi32(1)), dd4);
    s0 = V::mul(d, bytes16(sc));
    s1 = V::sub(V::mul(V::setf(kHigh ? 16.0f : 8.0f), s0), V::mul(dmin, bytes16(mn)));
    const __m512i qa0 = _mm512_loadu_si512(a + q0), qa1 = _mm512_loadu_si512(a + q0 + 64);
    const __m512i qb0 = _mm512_loadu_si512(b + q0), qb1 = _mm512_loadu_si512(b + q0 + 64);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // unit u of a super-block: chunk u / 2 (dwords 8 (u / 2) ..), nibble u % 2
    const __m512i chunk = _mm512_slli_epi32(_mm512_srli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(7)), 1), 3);
    const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(1)), 2);
    const __m512i low = _mm512_set1_epi32(0x0f0f0f0f);
    for (int k = 0; k < 8; ++k) {
      const __m512i v = dwords_from_pairs(qa0, qa1, qb0, qb1, _mm512_add_epi32(chunk, _mm512_set1_epi32(k)));
      W[k] = _mm512_and_si512(_mm512_srlv_epi32(v, shift), low);
    }
    if constexpr (kHigh) {
      const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16))),
                                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)), 1);
      const __m512i block = _mm512_and_si512(lane, _mm512_set1_epi32(8)), sub = _mm512_and_si512(lane, _mm512_set1_epi32(7));
      for (int k = 0; k < 8; ++k) {
        const __m512i hv = _mm512_permutexvar_epi32(_mm512_add_epi32(block, _mm512_set1_epi32(k)), qh);
        W[k] = _mm512_or_si512(W[k], _mm512_and_si512(_mm512_slli_epi32(_mm512_srlv_epi32(hv, sub), 4), _mm512_set1_epi32(0x10101010)));
      }
    }
  }
};
template <>
struct UnitLanes<Q4_K> : UnitLanesK45<Q4_K, false> {};
template <>
struct UnitLanes<Q5_K> : UnitLanesK45<Q5_K, true> {};

// Q6_K: two super-blocks a group; unit u = 4 h + t of one: ql dword 16 h + 8 (t % 2) + k,
// nibble t / 2; qh dword 8 h + k, bits 2 t
template <>
struct UnitLanes<Q6_K> {
  static void group(const uint8_t* row, int64_t, int64_t g, int64_t count, __m512i W[8], __m512& s0, __m512& s1) {
    const uint8_t* a = row + 2 * g * Q6_K::kBlockBytes;
    const uint8_t* b = count > 8 ? a + Q6_K::kBlockBytes : a;
    // the 16 int8 scales of each: even ones (first halves of units) and odd ones, a then b
    const __m128i pick = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i sa = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 192)), pick);
    const __m128i sb = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), pick);
    auto bytes16 = [](__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); };
    const __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half_to_float(a + 208)), _mm512_set1_ps(half_to_float(b + 208)));
    s0 = _mm512_mul_ps(d, bytes16(_mm_unpacklo_epi64(sa, sb)));
    s1 = _mm512_mul_ps(d, bytes16(_mm_unpackhi_epi64(sa, sb)));
    const __m512i la0 = _mm512_loadu_si512(a), la1 = _mm512_loadu_si512(a + 64), ha = _mm512_loadu_si512(a + 128);
    const __m512i lb0 = _mm512_loadu_si512(b), lb1 = _mm512_loadu_si512(b + 64), hb = _mm512_loadu_si512(b + 128);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i u = _mm512_and_si512(lane, _mm512_set1_epi32(7));
    const __m512i h = _mm512_srli_epi32(u, 2), t = _mm512_and_si512(u, _mm512_set1_epi32(3));
    const __m512i ql_idx = _mm512_add_epi32(_mm512_slli_epi32(h, 4), _mm512_slli_epi32(_mm512_and_si512(t, _mm512_set1_epi32(1)), 3));
    const __m512i qh_idx = _mm512_slli_epi32(h, 3);
    const __m512i ql_shift = _mm512_slli_epi32(_mm512_srli_epi32(t, 1), 2), qh_shift = _mm512_slli_epi32(t, 1);
    const __m512i low = _mm512_set1_epi32(0x0f0f0f0f), two = _mm512_set1_epi32(0x30303030);
    for (int k = 0; k < 8; ++k) {
      const __m512i kk = _mm512_set1_epi32(k);
      const __m512i l = dwords_from_pairs(la0, la1, lb0, lb1, _mm512_add_epi32(ql_idx, kk));
      const __m512i hi_idx = _mm512_add_epi32(qh_idx, kk);
      const __m512i hv = _mm512_mask_blend_epi32(0xff00, _mm512_permutexvar_epi32(hi_idx, ha), _mm512_permutexvar_epi32(hi_idx, hb));
      W[k] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(l, ql_shift), low),
                             _mm512_and_si512(_mm512_slli_epi32(_mm512_srlv_epi32(hv, qh_shift), 4), two));
    }
  }
};

// rows [s, s + rows) (rows <= 16) for NT tokens: res[t * 16 + r]. Each row is read start to
// end (the strip is one contiguous run of memory: the hardware's prefetcher follows it; 16 rows
// side by side a group at a time stalled on loads, measured Q6_K 8192x2048 M = 1 2.5 ms), its
// results kept per group until the strip's 16 rows are in; then per group the transposes and
// the fma chain over the group's units.
template <class T, int NT>
void unit_rows(const UnitActs& ua, int64_t K, const uint8_t* w, int64_t s, int64_t rows, float* res) {
  using Tr = Tile<T>;
  constexpr int H = Tr::kHalves;
  constexpr int kPer = 2 * NT * H + 1;  // P and C per token and half, S1: 16 vectors each
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBlockBytes, units = K / 32;
  const int64_t fetch = (row_bytes + ua.groups - 1) / ua.groups;
  thread_local std::vector<uint8_t> storage;
  storage.resize(ua.groups * kPer * 16 * 64 + 64);
  __m512i* kept = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  auto P = [&](int64_t g, int t, int hh) { return kept + (g * kPer + (t * H + hh)) * 16; };
  auto C = [&](int64_t g, int t, int hh) { return kept + (g * kPer + NT * H + (t * H + hh)) * 16; };
  auto S1 = [&](int64_t g) { return kept + (g * kPer + 2 * NT * H) * 16; };
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = w + (s + std::min<int64_t>(r, rows - 1)) * row_bytes;
    for (int64_t g = 0; g < ua.groups; ++g) {
      const int64_t count = std::min<int64_t>(16, units - 16 * g);
      // the next row, a group's share at a time (lanes_avx512.h measured why: the split rows'
      // parts stall without it, one core 8192x8192 Q8_0 6.37 -> 1.91 ms)
      for (int64_t o = g * fetch; o < std::min(row_bytes, (g + 1) * fetch); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + row_bytes + o), _MM_HINT_T0);
      __m512i W[8];
      __m512 s0, s1;
      UnitLanes<T>::group(row, nb, g, count, W, s0, s1);
      S1(g)[r] = _mm512_castps_si512(s1);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const int64_t base = t * ua.groups + g;
        const int32_t* bias = ua.bias.data() + base * 64;
        const int32_t* x = ua.x.data() + base * 128;
        // two chains of four vpdpbusd (then one exact integer add where H is 1): one chain of
        // eight bounded M = 1 by its latency
        __m512i ia[2];
        for (int hh = 0; hh < 2; ++hh)
          ia[hh] = H == 2                         ? _mm512_loadu_si512(bias + 16 * (1 + hh))
                   : hh == 0 || Tr::kBiasTimes == 2 ? _mm512_loadu_si512(bias + 16 * Tr::kBias)  // Q5: twice
                                                    : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) ia[k / 4] = _mm512_dpbusd_epi32(ia[k / 4], W[k], _mm512_loadu_si512(x + 16 * k));
        if constexpr (H == 1) ia[0] = _mm512_add_epi32(ia[0], ia[1]);
        const __m512 xs = _mm512_loadu_ps(ua.xs.data() + base * 16);
        P(g, t, 0)[r] = _mm512_castps_si512(_mm512_cvtepi32_ps(ia[0]));
        C(g, t, 0)[r] = _mm512_castps_si512(_mm512_mul_ps(s0, xs));
        if constexpr (H == 2) {
          P(g, t, H - 1)[r] = _mm512_castps_si512(_mm512_cvtepi32_ps(ia[H - 1]));
          C(g, t, H - 1)[r] = _mm512_castps_si512(_mm512_mul_ps(s1, xs));
        }
      }
    }
  }
  __m512 acc[NT], off[NT];
  for (int t = 0; t < NT; ++t) acc[t] = off[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ua.groups; ++g) {
    const int64_t count = std::min<int64_t>(16, units - 16 * g);
    for (int t = 0; t < NT; ++t)
      for (int hh = 0; hh < H; ++hh) {
        transpose16(P(g, t, hh));
        transpose16(C(g, t, hh));
      }
    if constexpr (Tr::kOffset) transpose16(S1(g));
    for (int64_t u = 0; u < count; ++u)
      for (int t = 0; t < NT; ++t) {
        acc[t] = _mm512_fmadd_ps(_mm512_castsi512_ps(P(g, t, 0)[u]), _mm512_castsi512_ps(C(g, t, 0)[u]), acc[t]);
        if constexpr (H == 2)
          acc[t] = _mm512_fmadd_ps(_mm512_castsi512_ps(P(g, t, H - 1)[u]), _mm512_castsi512_ps(C(g, t, H - 1)[u]), acc[t]);
        if constexpr (Tr::kOffset)
          off[t] = _mm512_fmadd_ps(_mm512_castsi512_ps(S1(g)[u]), _mm512_set1_ps(ua.xsum[(t * ua.groups + g) * 16 + u]), off[t]);
      }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(res + 16 * t, Tr::kOffset ? _mm512_add_ps(acc[t], off[t]) : acc[t]);
}

template <class T>
void unit_matmul(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                 float* out, int64_t N) {
  thread_local UnitActs ua;
  ua.fill(a, M);
  alignas(64) float res[kUnitTokens * 16];
  for (int64_t s = n0; s < n1; s += 16) {
    const int64_t rows = std::min<int64_t>(16, n1 - s);
    switch (M) {
      case 1: unit_rows<T, 1>(ua, K, w, s, rows, res); break;
      case 2: unit_rows<T, 2>(ua, K, w, s, rows, res); break;
      default: unit_rows<T, 3>(ua, K, w, s, rows, res); break;
    }
    for (int64_t t = 0; t < M; ++t)
      for (int64_t r = 0; r < rows; ++r) out[t * N + s + r] = res[t * 16 + r];
  }
}
#endif

}  // namespace tw
