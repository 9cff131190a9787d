// The super-block types' tile conversions (tiles_types.h has the 32-weight ones and IQ4's):
// Q4_K and Q5_K (TileK45: 8 units a super-block, their 6-bit scales and mins), Q6_K (two
// 16-weight halves a unit, its blocks reordered in pairs for the laid-out form).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "tiles_types.h"
#include "types_k.h"

namespace tw {

#ifdef TW_AVX2
// byte b of each dword as a float (unsigned / signed)
template <int B>
inline TF byte_u(TI v) {
  using V = TileIsa;
  return V::cvt(V::and_(V::srli<8 * B>(v), V::set1(0xff)));
}
template <int B>
inline TF byte_s(TI v) {
  using V = TileIsa;
  return V::cvt(V::srai<24>(V::slli<24 - 8 * B>(v)));
}

// Q4_K, Q5_K: per super-block its first 16 bytes (d, dmin, the 12 scale bytes: k4_scales' bit
// layout, here on all rows' dwords at once), Q5_K's 32 qh bytes, then 4 chunks of 32 quant
// bytes, chunk c holding sub-block 2 c in its low nibbles and 2 c + 1 in its high ones (Q5_K:
// bit 2 c, 2 c + 1 of qh byte i above value i of each). Weight d sc q - dmin m = d sc (q - z) +
// (z d sc - dmin m), z = 8 (Q4_K) or 16 (Q5_K: ActI8's -8 sum taken twice): d sc, z d sc and
// dmin m are exact in fp32 (11- by 6-bit), the offset rounds once.
template <class T, bool kHigh>
struct TileK45 : SameImage<T> {
  static constexpr bool kHas = true, kOffset = true, kSigned = false;
  static bool laid(int64_t) { return true; }
  static constexpr int kHalves = 1, kBias = 0, kBiasTimes = kHigh ? 2 : 1, kSum16 = sum16_of(kHigh ? 31 : 15);
  static constexpr int kQuants = kHigh ? 48 : 16;  // where a block's nibbles start
  // the 8 sub-blocks' d sc and z d sc - dmin m, lanes = rows, from the transposed first 16
  // bytes of a block
  static void scales(const TI h[4], TF s0[8], TF s1[8]) {
    using V = TileIsa;
    const TI low6 = V::set1(0x3f3f3f3f), low4 = V::set1(0x0f0f0f0f), top2 = V::set1(0x30303030);
    const TF d = V::half_lo(h[0]), dmin = V::half_hi(h[0]);
    const TI sc_lo = V::and_(h[1], low6), m_lo = V::and_(h[2], low6);
    const TI sc_hi = V::or_(V::and_(h[3], low4), V::and_(V::srli<2>(h[1]), top2));
    const TI m_hi = V::or_(V::and_(V::srli<4>(h[3]), low4), V::and_(V::srli<2>(h[2]), top2));
    const TF sc[8] = {byte_u<0>(sc_lo), byte_u<1>(sc_lo), byte_u<2>(sc_lo), byte_u<3>(sc_lo),
                      byte_u<0>(sc_hi), byte_u<1>(sc_hi), byte_u<2>(sc_hi), byte_u<3>(sc_hi)};
    const TF mn[8] = {byte_u<0>(m_lo), byte_u<1>(m_lo), byte_u<2>(m_lo), byte_u<3>(m_lo),
                      byte_u<0>(m_hi), byte_u<1>(m_hi), byte_u<2>(m_hi), byte_u<3>(m_hi)};
    for (int sub = 0; sub < 8; ++sub) {
      s0[sub] = V::mul(d, sc[sub]);
      s1[sub] = V::sub(V::mul(V::setf(kHigh ? 16.0f : 8.0f), s0[sub]), V::mul(dmin, mn[sub]));
    }
  }
  template <class Src, class Sink>
  static void convert(const Src& src, int64_t nb, Sink&& sink) {
    using V = TileIsa;
    const TI low4 = V::set1(0x0f0f0f0f);
    for (int64_t s = 0; s < nb; ++s) {
      const int64_t base = s * T::kBlockBytes;
      TI h[4], hq[8];
      src.get(base, h);
      if constexpr (kHigh) {
        src.get(base + 16, hq);
        src.get(base + 32, hq + 4);
      }
      TF s0[8], s1[8];
      scales(h, s0, s1);
      for (int c = 0; c < 4; ++c) {
        TI q[8];
        src.get(base + kQuants + 32 * c, q);
        src.get(base + kQuants + 16 + 32 * c, q + 4);
        for (int half = 0; half < 2; ++half) {
          const int sub = 2 * c + half;
          TI u[kUnitVecs];
          for (int k = 0; k < 8; ++k) {
            u[k] = V::and_(half ? V::srli<4>(q[k]) : q[k], low4);
            if constexpr (kHigh) u[k] = V::or_(u[k], V::and_(V::slli<4>(V::srl(hq[k], sub)), V::set1(0x10101010)));
          }
          u[8] = V::as_i(s0[sub]);
          u[9] = V::as_i(s1[sub]);
          sink(8 * s + sub, u);
        }
      }
    }
  }
};
template <>
struct Tile<Q4_K> : TileK45<Q4_K, false> {};
template <>
struct Tile<Q5_K> : TileK45<Q5_K, true> {};

// Q6_K: per half of 128 weights, value r = 32 t + i (unit t) is nibble t / 2 of ql byte
// 32 (t % 2) + i with bits 2 t of qh byte i above it; each 16 its int8 scale. Units keep q
// (0..63) with z = 32 by halves (ActI8's sums of values 0-15 and 16-31), and the two halves'
// d * scale (exact) as the two float vectors.
//
// Its 210-byte blocks put every other one at 2 mod 4, so its laid-out image takes blocks in
// pairs: the two d, then each block's bytes in the order convert reads them (scales, then per
// half its 64 ql and 32 qh bytes): 420 bytes, 105 dwords, read front to back. An odd last
// block keeps its place, its d at the row's end (the group's tail).
template <>
struct Tile<Q6_K> {
  static constexpr bool kHas = true, kOffset = false, kSigned = false;
  static constexpr int kHalves = 2, kBias = 1, kBiasTimes = 1, kSum16 = sum16_of(63);
  static bool laid(int64_t) { return true; }
  // where block s's fields start: scales, ql of half h, qh of half h, and d (image: d's pair
  // dword, or the tail)
  struct Fields {
    int64_t sc, ql[2], qh[2], d;
  };
  static Fields raw_fields(int64_t s) { return {210 * s + 192, {210 * s, 210 * s + 64}, {210 * s + 128, 210 * s + 160}, 210 * s + 208}; }
  static Fields image_fields(int64_t s, int64_t nb) {
    const bool alone = nb % 2 == 1 && s == nb - 1;
    const int64_t pair = 420 * (s / 2), body = alone ? pair : pair + 4 + 208 * (s % 2);
    return {body, {body + 16, body + 112}, {body + 80, body + 176}, alone ? pair + 208 : pair + 2 * (s % 2)};
  }
  template <bool kToImage>
  static void reorder(const uint8_t* from, int64_t nb, uint8_t* to) {
    for (int64_t s = 0; s < nb; ++s) {
      const Fields r = raw_fields(s), i = image_fields(s, nb);
      const std::pair<int64_t, int64_t> at[] = {{r.sc, i.sc}, {r.ql[0], i.ql[0]}, {r.ql[1], i.ql[1]},
                                                {r.qh[0], i.qh[0]}, {r.qh[1], i.qh[1]}, {r.d, i.d}};
      const int64_t bytes[] = {16, 64, 64, 32, 32, 2};
      for (int f = 0; f < 6; ++f)
        std::memcpy(to + (kToImage ? at[f].second : at[f].first), from + (kToImage ? at[f].first : at[f].second), bytes[f]);
    }
  }
  static void to_image(const uint8_t* row, int64_t nb, uint8_t* out) { reorder<true>(row, nb, out); }
  static void from_image(const uint8_t* image, int64_t nb, uint8_t* out) { reorder<false>(image, nb, out); }
  template <class Src, class Sink>
  static void convert(const Src& src, int64_t nb, Sink&& sink) {
    using V = TileIsa;
    const TI low4 = V::set1(0x0f0f0f0f), two = V::set1(0x30303030);
    for (int64_t s = 0; s < nb; ++s) {
      const Fields f = Src::kImage ? image_fields(s, nb) : raw_fields(s);
      TI sv[4], dv[4];
      TF d;
      if constexpr (!Src::kImage) {
        src.get(f.d - 14, dv);  // ends at the block's end: d is dword 3's high half
        d = V::half_hi(dv[3]);
      } else if (nb % 2 == 1 && s == nb - 1) {
        d = src.tail_halves();
      } else {
        src.get(f.d - 2 * (s % 2), dv);  // the pair's two d: dword 0
        d = s % 2 ? V::half_hi(dv[0]) : V::half_lo(dv[0]);
      }
      src.get(f.sc, sv);
      TF scale[16];
      for (int i = 0; i < 4; ++i) {
        scale[4 * i] = V::mul(d, byte_s<0>(sv[i]));
        scale[4 * i + 1] = V::mul(d, byte_s<1>(sv[i]));
        scale[4 * i + 2] = V::mul(d, byte_s<2>(sv[i]));
        scale[4 * i + 3] = V::mul(d, byte_s<3>(sv[i]));
      }
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t) {
          const int unit = 4 * h + t;
          TI l[8], hb[8], u[kUnitVecs];
          src.get(f.ql[h] + 32 * (t % 2), l);  // value r = 32 t + i: ql byte 32 (t % 2) + i
          src.get(f.ql[h] + 32 * (t % 2) + 16, l + 4);
          src.get(f.qh[h], hb);
          src.get(f.qh[h] + 16, hb + 4);
          for (int k = 0; k < 8; ++k) {
            const TI lo = V::and_(t / 2 ? V::srli<4>(l[k]) : l[k], low4);
            TI hi;
            switch (t) {  // bits 2t, 2t + 1 of each qh byte to bits 4, 5
              case 0: hi = V::slli<4>(hb[k]); break;
              case 1: hi = V::slli<2>(hb[k]); break;
              case 2: hi = hb[k]; break;
              default: hi = V::srli<2>(hb[k]); break;
            }
            u[k] = V::or_(lo, V::and_(hi, two));
          }
          u[8] = V::as_i(scale[2 * unit]);
          u[9] = V::as_i(scale[2 * unit + 1]);
          sink(8 * s + unit, u);
        }
    }
  }
};
#endif

}  // namespace tw
