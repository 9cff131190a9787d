// The tiled types' decode rows (M < kDecodeTokens) in row lanes: the same bits as tiles.h's strips
// without transposing a single weight. The AVX2 build's decode path; an AVX-512 build takes
// tiles_units.h's unit lanes instead, which stream a real model's weights from DRAM faster (that
// header says by how much; the AVX-512 figures below are these lanes with vpdpbusd on ymm). Eight weight rows at a
// time, each read in its own byte order (a 32-byte load is one or two whole units of a row); the
// activations meet it in that order, so vpmaddubsw + vpmaddwd (AVX-512: vpdpbusd on ymm) give 8
// partial sums of one row, and unpack-and-add steps fold the 8 rows' partials into lanes = rows,
// one vector per unit (Q6_K: per half unit), exact in int32 whatever the order of the adds. From
// there on it is the strips' arithmetic: per unit acc = fma(float(idot + bias), wscale * xscale,
// acc), the per-row scales made by the strips' own conversion steps (16 bytes of every row
// transposed, here in 8-row ymm form), so a row's bits do not depend on the path, the strip
// height (8 or 16) or the rows beside it (tests/model/test_tiles.py, both builds).
//
// Why: a strip moves every weight byte through an 8- or 16-row transpose and an L1 buffer, which
// the tokens of a prefill share but one token does not (AVX2 M = 1 lost 20-45 % to the int16
// kernels); here only the scales and the int32 results cross lanes. The AVX-512 unit lanes this
// replaces (a row's 16 units unpacked by vpermt2d, results transposed 16 x 16) measured at or
// below it on every type (the table's strips* column). Two rows a zmm (AVX-512) measured slower
// than one a ymm (Q4_K M = 1 148 vs 163, Q6_K M = 3 142 vs 156); vphaddd for the folds 3-9 %
// slower than unpack + add (Q6_K AVX2 74.7 vs 76.9, AVX-512 79.5 vs 81.9). The next strip is
// prefetched: in these cache-warm figures it won 2-3 % on Q4_0 / Q6_K and lost 10 % on Q8_0, but
// a real model streams its weights from DRAM, where 8 rows read side by side outrun the stream
// prefetchers: llama-1b Q4_K_M single-stream decode without it 18.9 tok/s (AVX-512) and 17.9
// (AVX2) against the strips' / unit lanes' 28.9 and 19.4; with it 27.3 and 25.5 (against 29.8 and
// 20.0, same sitting; greedy, 64 tokens, median of 5).
//
// Measured (Zen 5 EPYC VM, 2 threads, 8192x2048, GFLOP/s, best of 3 rounds of the min of 200
// calls; int16 = main's kernels before issue 42, strips = this branch before these lanes; one
// sitting, the machine shared with other work):
//                int16     strips*    rows       (* AVX-512: the unit lanes this replaces)
//   AVX-512 M=1  Q4_0 136 162 188, Q4_1 138 152 159, Q8_0 131 104 145, Q4_K 116 112 165, Q6_K 98 83 84
//           M=2  Q4_0 206 216 283, Q4_1 171 216 236, Q8_0 194 163 229, Q4_K 183 164 217, Q6_K 157 121 122
//           M=3  Q4_0 234 252 315, Q4_1 230 206 264, Q8_0 222 195 238, Q4_K 214 180 240, Q6_K 188 143 152
//   AVX2    M=1  Q4_0 139 122 174, Q4_1 126 107 146, Q8_0 129  85 132, Q4_K 122 114 141, Q6_K 85 74 77
//           M=2  Q4_0 147 183 229, Q4_1 144 163 200, Q8_0 143 129 152, Q4_K 137 170 185, Q6_K 92 123 111
//           M=3  Q4_0 133 229 253, Q4_1 133 209 222, Q8_0 151 153 174, Q4_K 152 215 198, Q6_K 99 160 126
// Q6_K M = 1 stays 0.86-0.91x the int16 kernels (its 6-bit unpacking and a fold per unit against
// their one sum a row); on AVX2 the strips beat these lanes for Q6_K at M = 2-3 and Q4_K at M = 3.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "tiles_types.h"
#include "tiles_units.h"

namespace tw {

// compiled where they run: an AVX2 build without AVX-512
#if defined(TW_AVX2) && !defined(TW_AVX512)
constexpr int64_t kDecodeTokens = 4;  // fewer activation rows than this take row lanes

namespace rows8 {

using I = __m256i;
using F = __m256;

inline I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline I load16(const void* p) {  // 16 bytes, the upper half zero
  return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline I nibbles_lo(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline I nibbles_hi(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }

// per dword lane the dot of 4 unsigned weight bytes w (<= 63) and 4 signed activation bytes x
inline I dot(I w, I x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)); }
// the same of two pairs, summed (4-bit weights: two vpmaddubsw add in int16, |sum| <= 4 * 15 * 127)
inline I dot2(I w0, I x0, I w1, I x1) {
  const I s = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
  return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}
// Q8_0's signed weights: |q| times x with q's sign (the AVX2 strips' choice, Tile<Q8_0>::kSigned)
inline I dot_q8(I w, I x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

// Folding 8 rows' partial sums into lanes = rows. pair(v_r, v_r+1) is the first level, taken
// as each pair of rows is done (the tokens' partials stay few); fold2 then takes the 4 pairs of
// vectors whose lanes 0-3 summed give one value A and 4-7 another B -> A and B, lanes = rows
// (vphaddd adds within 128-bit halves: two levels leave rows 0-3 of A low, of B high)
inline I pair(I v0, I v1) { return _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1)); }
inline I pair64(I v0, I v1) { return _mm256_add_epi32(_mm256_unpacklo_epi64(v0, v1), _mm256_unpackhi_epi64(v0, v1)); }
inline void fold2(const I h[4], I& a, I& b) {
  const I q0 = pair64(h[0], h[1]), q1 = pair64(h[2], h[3]);
  a = _mm256_permute2x128_si256(q0, q1, 0x20);
  b = _mm256_permute2x128_si256(q0, q1, 0x31);
}
// all 8 lanes of each row's partials -> one value, lanes = rows
inline I fold1(const I h[4]) {
  I a, b;
  fold2(h, a, b);
  return _mm256_add_epi32(a, b);
}

inline F half_lo(I a) {  // the fp16 in each dword's low half (exact, as tiles.h's)
  const I lo = _mm256_and_si256(a, _mm256_set1_epi32(0xffff));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08)));
}
inline F half_hi(I a) { return half_lo(_mm256_srli_epi32(a, 16)); }
template <int B>
inline F byte_u(I v) { return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * B), _mm256_set1_epi32(0xff))); }
template <int B>
inline F byte_s(I v) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * B), 24)); }

}  // namespace rows8

// A type's group of up to 8 units (32-weight types: units j .. j + count - 1; K-quants: the
// super-block j / 8) for 8 rows and NT activation rows x[t] (the unit j's bytes): d[t][u][h]
// the integer dots (no bias yet), s0[u] / s1[u] the strips' two per-row floats (tiles_types.h's
// u[8], u[9]).
template <class T>
struct RowDots;

template <class T>
struct RowDots32 {
  // units a, a + 1 (the second absent where !both) of a row's quants: values i in lo, i + 16
  // in hi, byte i of unit a then of unit b. Q5: a unit's 16 nibble bytes after its 4 qh bytes;
  // value i's high bit (qh bit i) to bit 4 of its byte: qh byte i / 8 spread over 8 bytes, each
  // byte's own bit tested.
  static void weights(const uint8_t* q, int64_t a, bool both, rows8::I& lo, rows8::I& hi) {
    using namespace rows8;
    if constexpr (Block32<T>::kFive) {
      const uint8_t* qa = q + 20 * a;
      const __m128i qs_b = both ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + 24)) : _mm_setzero_si128();
      int32_t ha, hb = 0;
      std::memcpy(&ha, qa, 4);
      if (both) std::memcpy(&hb, qa + 20, 4);
      const I qs = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + 4))), qs_b, 1);
      const I qh = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtsi32_si128(ha)), _mm_cvtsi32_si128(hb), 1);
      const I pick_lo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const I bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull)), four = _mm256_set1_epi8(0x10);
      auto high = [&](I pick) {
        return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, pick), bit), bit), four);
      };
      lo = _mm256_or_si256(nibbles_lo(qs), high(pick_lo));
      hi = _mm256_or_si256(nibbles_hi(qs), high(_mm256_add_epi8(pick_lo, _mm256_set1_epi8(2))));
    } else {
      const uint8_t* qa = q + 16 * a;
      const I w = both ? load(qa) : load16(qa);
      lo = nibbles_lo(w);
      hi = nibbles_hi(w);
    }
  }
  template <int NT>
  static void group(const uint8_t* const* rows, int64_t nb, int64_t j, int64_t count, const int8_t* const* x,
                    rows8::I d[][8][1], rows8::F s0[8], rows8::F s1[8]) {
    using namespace rows8;
    I d2[4], m2[4];
    transpose8(rows, nb * T::part_offset(T::kScalePart) + 2 * j, d2);
    if constexpr (Block32<T>::kMin) transpose8(rows, nb * T::part_offset(T::kMinPart) + 2 * j, m2);
    for (int e = 0; e < 8; ++e) {
      s0[e] = e % 2 ? half_hi(d2[e / 2]) : half_lo(d2[e / 2]);
      if constexpr (Block32<T>::kMin) {  // d q + m = d (q - z) + (m + z d)
        const F m = e % 2 ? half_hi(m2[e / 2]) : half_lo(m2[e / 2]);
        s1[e] = _mm256_add_ps(m, _mm256_mul_ps(_mm256_set1_ps(Block32<T>::kZero), s0[e]));
      }
    }
    const int64_t q_off = nb * T::part_offset(T::kQuantPart);
    if constexpr (T::kId == Q8_0::kId) {
      for (int64_t u = 0; u < count; ++u) {
        I xu[NT], h[NT][4];
        for (int t = 0; t < NT; ++t) xu[t] = load(x[t] + 32 * u);
        for (int r = 0; r < 8; r += 2) {
          const I w0 = load(rows[r] + q_off + 32 * (j + u)), w1 = load(rows[r + 1] + q_off + 32 * (j + u));
          for (int t = 0; t < NT; ++t) h[t][r / 2] = pair(dot_q8(w0, xu[t]), dot_q8(w1, xu[t]));
        }
        for (int t = 0; t < NT; ++t) d[t][u][0] = fold1(h[t]);
      }
    } else {  // two units a load: byte i of unit a, then of unit b (values i, i + 16 of each)
      for (int64_t u = 0; u < count; u += 2) {
        const bool both = u + 1 < count;
        I xlo[NT], xhi[NT], h[NT][4];
        for (int t = 0; t < NT; ++t) {
          const I xa = load(x[t] + 32 * u), xb = both ? load(x[t] + 32 * u + 32) : _mm256_setzero_si256();
          xlo[t] = _mm256_permute2x128_si256(xa, xb, 0x20);
          xhi[t] = _mm256_permute2x128_si256(xa, xb, 0x31);
        }
        for (int r = 0; r < 8; r += 2) {
          I l0, h0, l1, h1;
          weights(rows[r] + q_off, j + u, both, l0, h0);
          weights(rows[r + 1] + q_off, j + u, both, l1, h1);
          for (int t = 0; t < NT; ++t) h[t][r / 2] = pair(dot2(l0, xlo[t], h0, xhi[t]), dot2(l1, xlo[t], h1, xhi[t]));
        }
        for (int t = 0; t < NT; ++t) fold2(h[t], d[t][u][0], d[t][u + 1][0]);
      }
    }
  }
};
template <>
struct RowDots<Q4_0> : RowDots32<Q4_0> {};
template <>
struct RowDots<Q4_1> : RowDots32<Q4_1> {};
template <>
struct RowDots<Q8_0> : RowDots32<Q8_0> {};
template <>
struct RowDots<Q5_0> : RowDots32<Q5_0> {};
template <>
struct RowDots<Q5_1> : RowDots32<Q5_1> {};


// Q4_K, Q5_K: chunk c of a super-block's quants (32 bytes) is unit 2 c in its low nibbles, 2 c +
// 1 in its high ones, each in value order (Q5_K: qh byte i's bits 2 c, 2 c + 1 above value i);
// the scales as TileK45::convert takes them
template <class T, bool kHigh>
struct RowDotsK45 {
  template <int NT>
  static void group(const uint8_t* const* rows, int64_t, int64_t j, int64_t, const int8_t* const* x,
                    rows8::I d[][8][1], rows8::F s0[8], rows8::F s1[8]) {
    using namespace rows8;
    const int64_t base = (j / 8) * T::kBlockBytes;
    constexpr int q0 = Tile<T>::kQuants;
    I h[4];
    transpose8(rows, base, h);
    Tile<T>::scales(h, s0, s1);
    for (int c = 0; c < 4; ++c) {
      I xa[NT], xb[NT], ha[NT][4], hb[NT][4];
      for (int t = 0; t < NT; ++t) {
        xa[t] = load(x[t] + 64 * c);
        xb[t] = load(x[t] + 64 * c + 32);
      }
      for (int r = 0; r < 8; r += 2) {
        const I w0 = load(rows[r] + base + q0 + 32 * c), w1 = load(rows[r + 1] + base + q0 + 32 * c);
        I l0 = nibbles_lo(w0), h0 = nibbles_hi(w0), l1 = nibbles_lo(w1), h1 = nibbles_hi(w1);
        if constexpr (kHigh) {  // bits 2 c, 2 c + 1 of qh byte i to bit 4 of value i's byte
          const I bit4 = _mm256_set1_epi8(0x10), qa = load(rows[r] + base + 16), qb = load(rows[r + 1] + base + 16);
          const __m128i lo_n = _mm_cvtsi32_si128(2 * c), hi_n = _mm_cvtsi32_si128(2 * c + 1);
          l0 = _mm256_or_si256(l0, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qa, lo_n), 4), bit4));
          h0 = _mm256_or_si256(h0, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qa, hi_n), 4), bit4));
          l1 = _mm256_or_si256(l1, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qb, lo_n), 4), bit4));
          h1 = _mm256_or_si256(h1, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qb, hi_n), 4), bit4));
        }
        for (int t = 0; t < NT; ++t) {
          ha[t][r / 2] = pair(dot(l0, xa[t]), dot(l1, xa[t]));
          hb[t][r / 2] = pair(dot(h0, xb[t]), dot(h1, xb[t]));
        }
      }
      for (int t = 0; t < NT; ++t) {
        d[t][2 * c][0] = fold1(ha[t]);
        d[t][2 * c + 1][0] = fold1(hb[t]);
      }
    }
  }
};

template <>
struct RowDots<Q4_K> : RowDotsK45<Q4_K, false> {};
template <>
struct RowDots<Q5_K> : RowDotsK45<Q5_K, true> {};

// Q6_K: unit t of half h (values 32 t + i) is nibble t / 2 of ql byte 64 h + 32 (t % 2) + i
// with bits 2 t of qh byte 128 + 32 h + i above it: one 32-byte load of each in value order.
// Its two halves' dots fold out of one vector (lanes 0-3: values 0-15, 4-7: 16-31).
template <>
struct RowDots<Q6_K> {
  template <int NT>
  static void group(const uint8_t* const* rows, int64_t, int64_t j, int64_t, const int8_t* const* x,
                    rows8::I d[][8][2], rows8::F s0[8], rows8::F s1[8]) {
    using namespace rows8;
    const int64_t base = (j / 8) * Q6_K::kBlockBytes;
    I sv[4], dv[4];
    transpose8(rows, base + 192, sv);
    transpose8(rows, base + 194, dv);  // ends at the block's end: d is dword 3's high half
    const F dd = half_hi(dv[3]);
    F scale[16];
    for (int i = 0; i < 4; ++i) {
      scale[4 * i] = _mm256_mul_ps(dd, rows8::byte_s<0>(sv[i]));
      scale[4 * i + 1] = _mm256_mul_ps(dd, rows8::byte_s<1>(sv[i]));
      scale[4 * i + 2] = _mm256_mul_ps(dd, rows8::byte_s<2>(sv[i]));
      scale[4 * i + 3] = _mm256_mul_ps(dd, rows8::byte_s<3>(sv[i]));
    }
    for (int u = 0; u < 8; ++u) {
      s0[u] = scale[2 * u];
      s1[u] = scale[2 * u + 1];
    }
    const I two = _mm256_set1_epi8(0x30);
    for (int hf = 0; hf < 2; ++hf)
      for (int t4 = 0; t4 < 4; ++t4) {
        I xu[NT], h[NT][4];
        for (int t = 0; t < NT; ++t) xu[t] = load(x[t] + 32 * (4 * hf + t4));
        auto weights = [&](const uint8_t* row) {
          const I l = load(row + base + 64 * hf + 32 * (t4 % 2)), qh = load(row + base + 128 + 32 * hf);
          I hi;
          switch (t4) {  // bits 2 t, 2 t + 1 of each qh byte to bits 4, 5
            case 0: hi = _mm256_slli_epi16(qh, 4); break;
            case 1: hi = _mm256_slli_epi16(qh, 2); break;
            case 2: hi = qh; break;
            default: hi = _mm256_srli_epi16(qh, 2); break;
          }
          return _mm256_or_si256(t4 / 2 ? nibbles_hi(l) : nibbles_lo(l), _mm256_and_si256(hi, two));
        };
        for (int r = 0; r < 8; r += 2) {
          const I w0 = weights(rows[r]), w1 = weights(rows[r + 1]);
          for (int t = 0; t < NT; ++t) h[t][r / 2] = pair(dot(w0, xu[t]), dot(w1, xu[t]));
        }
        for (int t = 0; t < NT; ++t) fold2(h[t], d[t][4 * hf + t4][0], d[t][4 * hf + t4][1]);
      }
  }
};

// 8 rows (pointers; a short strip repeats its last) for NT activation rows: res[t * 8 + r]
template <class T, int NT>
void row_strip(const QuantizedActivations& a, int64_t K, const uint8_t* const* rows, float* res, const uint8_t* next,
               int64_t next_bytes) {
  using Tr = Tile<T>;
  constexpr int H = Tr::kHalves;
  const int64_t nb = K / T::kBlock, units = K / 32;
  const int8_t* x0 = reinterpret_cast<const int8_t*>(a.q.data());
  const int64_t xstride = a.stride * 2;
  rows8::F acc[NT], off[NT];
  for (int t = 0; t < NT; ++t) acc[t] = off[t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < units; j += 8) {
    const int64_t count = std::min<int64_t>(8, units - j);
    if (next_bytes > 0) {  // the next strip, a group's share at a time: 8 rows read side by side
      const int64_t share = (next_bytes * 8 + units - 1) / units;  // outrun the stream prefetchers
      for (int64_t o = share * (j / 8); o < std::min(next_bytes, share * (j / 8 + 1)); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
    }
    const int8_t* x[NT];
    for (int t = 0; t < NT; ++t) x[t] = x0 + t * xstride + 32 * j;
    rows8::I d[NT][8][H];
    rows8::F s0[8], s1[8];
    RowDots<T>::template group<NT>(rows, nb, j, count, x, d, s0, s1);
    for (int64_t u = 0; u < count; ++u)
      for (int t = 0; t < NT; ++t) {
        const int64_t b = t * units + j + u;
        const rows8::F xs = _mm256_set1_ps(a.scale[b]);
        for (int h = 0; h < H; ++h) {
          rows8::I ia = d[t][u][h];
          if constexpr (Tr::kBias >= 0)
            ia = _mm256_add_epi32(
                ia, _mm256_set1_epi32(Tr::kBiasTimes * a.bias[b * ActI8::kBias + (H == 2 ? 1 + h : Tr::kBias)]));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(h ? s1[u] : s0[u], xs), acc[t]);
        }
        if constexpr (Tr::kOffset) off[t] = _mm256_fmadd_ps(s1[u], _mm256_set1_ps(a.sum[b]), off[t]);
      }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(res + 8 * t, Tr::kOffset ? _mm256_add_ps(acc[t], off[t]) : acc[t]);
}

// out[m, n] = x[m] . W[n] for n in [n0, n1), M < kDecodeTokens (8-row strips, 1-3 tokens)
template <class T>
void row_matmul(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                float* out, int64_t N) {
  const int64_t row_bytes = K / T::kBlock * T::kBlockBytes;
  alignas(32) float res[3 * 8];
  for (int64_t s = n0; s < n1; s += 8) {
    const int64_t rows = std::min<int64_t>(8, n1 - s);
    const uint8_t* ptrs[8];
    for (int r = 0; r < 8; ++r) ptrs[r] = w + (s + std::min<int64_t>(r, rows - 1)) * row_bytes;
    const int64_t next_bytes = std::min<int64_t>(8, std::max<int64_t>(0, n1 - s - 8)) * row_bytes;
    const uint8_t* next = w + (s + 8) * row_bytes;
    switch (M) {
      case 1: row_strip<T, 1>(a, K, ptrs, res, next, next_bytes); break;
      case 2: row_strip<T, 2>(a, K, ptrs, res, next, next_bytes); break;
      default: row_strip<T, 3>(a, K, ptrs, res, next, next_bytes); break;
    }
    for (int64_t t = 0; t < M; ++t)
      for (int64_t r = 0; r < rows; ++r) out[t * N + s + r] = res[t * 8 + r];
  }
}
#endif

#ifdef TW_AVX2
// a tiled type's matmul: decode rows in unit lanes (AVX-512, tiles_units.h) or row lanes (AVX2),
// strips otherwise; all three the same bits
template <class T>
void tiled_matmul(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                  float* out, int64_t N) {
#ifdef TW_AVX512
  if (M < kUnitTokens) return unit_matmul<T>(a, M, K, w, n0, n1, out, N);
#else
  if (M < kDecodeTokens) return row_matmul<T>(a, M, K, w, n0, n1, out, N);
#endif
  tile_matmul<T>(a, M, K, w, n0, n1, out, N);
}
#endif

}  // namespace tw
