// Each tiled type's conversion of a strip of kTileRows weight rows into tiles.h's units: 8
// vectors of unsigned weight bytes (vector k, lane r: weights 4k .. 4k + 3 of the unit in row r)
// and two of per-row floats. All reads go through TileIsa::transpose (16 bytes of every row of
// the strip into 4 vectors of dword lanes), so a type adds only its bit unpacking here.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "tiles.h"
#include "types_q4.h"
#include "types_q5_iq4.h"
#include "types_q8.h"

namespace tw {

#ifdef TW_AVX2
// 32 unsigned values a unit from 16 bytes of nibbles (byte i: values i, i + 16): low nibbles
// are values 0-15, high ones 16-31
inline void q4_unit(const TI q[4], TI* u) {
  using V = TileIsa;
  const TI low = V::set1(0x0f0f0f0f);
  for (int k = 0; k < 4; ++k) {
    u[k] = V::and_(q[k], low);
    u[4 + k] = V::and_(V::srli<4>(q[k]), low);
  }
}

// The 32-weight types' shared facts. Q5_0, Q5_1: value i of a block is the nibble of quant
// byte i % 16 (low for i < 16) with bit i of the 4 qh bytes above it (0..31), a unit 20 bytes.
// Units keep q with zero point z = 8 (Q4) or 16 (Q5: ActI8's -8 sum taken twice); the types
// with a minimum: d q + m = d (q - z) + (m + z d).
// Measured for Q5 (gemma3-1b Q4_K_M shape, whose K = 1152 projections llama.cpp stores as
// Q5_0): prefill 1k was 0.73x llama.cpp while these types took int16 rows three at a time.
template <class T>
struct Block32 {
  static constexpr bool kFive = T::kId == Q5_0::kId || T::kId == Q5_1::kId;
  static constexpr bool kMin = T::kId == Q4_1::kId || T::kId == Q5_1::kId;
  static constexpr float kZero = kFive ? 16.0f : 8.0f;
};

// Q5's high bits into a unit's 8 vectors: vector K byte b <- qh bit 4 K + b, at bit 4. (x & 15)
// * 0x02040810 puts bit b of x at 8 b + 4 (and copies at bits that never meet one another: no
// carries), the mask keeps those.
template <int K = 0>
inline void add_q5_high(TI qh, TI* u) {
  using V = TileIsa;
  const TI x = V::and_(V::srli<4 * K>(qh), V::set1(15));
  u[K] = V::or_(u[K], V::and_(V::mullo(x, V::set1(0x02040810)), V::set1(0x10101010)));
  if constexpr (K < 7) add_q5_high<K + 1>(qh, u);
}

// A type's row in tiles.h's laid-out form: its image (the split row itself for all but Q6_K),
// and whether a row of nb blocks can be laid out (every read at a multiple of 4 bytes)
template <class T>
struct SameImage {
  static void to_image(const uint8_t* row, int64_t nb, uint8_t* out) { std::memcpy(out, row, nb * T::kBlockBytes); }
  static void from_image(const uint8_t* image, int64_t nb, uint8_t* out) { std::memcpy(out, image, nb * T::kBlockBytes); }
};

// IQ4_NL, IQ4_XS: a unit is 16 bytes of nibbles (as Q4_0's) that index the non-linear table
// (kIq4Values, -127..113) with one byte shuffle. AVX-512 takes the table + 128 (1..241, unsigned
// for vpdpbusd, zero point 128: ActI8's -128 sum); AVX2 takes it signed (vpmaddubsw would
// saturate 241 x 127 pairs), |w| times x with w's sign, one product an int16 sum (as Q8_0).
// The unit's one float is its scale: IQ4_NL's d, IQ4_XS's d (ls - 32) (exact: 11 by 6 bits).
// Before (int16 byte-pair rows, no GEMM): types_q5_iq4.h.
struct TileIq4 {
  static constexpr bool kHas = true, kOffset = false, kSigned = TileIsa::kSignedQ8;
  static constexpr int kHalves = 1, kBias = kSigned ? -1 : 3, kBiasTimes = 1, kSum16 = sum16_of(127);
  static bool laid(int64_t nb) { return nb % 2 == 0; }  // every part then starts at a multiple of 4
  // 16 nibble bytes -> a unit's 8 weight vectors
  static void unit(const TI q[4], TI* u) {
    const __m128i table = iq4_table(!kSigned);
    q4_unit(q, u);
    for (int k = 0; k < 8; ++k) u[k] = TileIsa::lookup16(table, u[k]);
  }
};

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: groups of 8 blocks (16 bytes of fp16 scales a row, one
// transpose); a scale's 16 bytes may run past its part into the next one of the same row (only
// the first nb - j of them are used). Split rows keep each part whole (the scales, the mins,
// the quants); the laid-out image puts each group's parts side by side instead (its 8 scales,
// its 8 mins, its 8 blocks' quants: the same bytes), so a decode streams one range front to
// back. Why: split parts are two or three streams a row, and AVX2 decode (8 KB prefetch into
// L1) read them from DRAM far below its arithmetic: M = 1, 2 threads, eight 8192x2048 matrices
// in turn, GB/s of weights (from L3: one matrix), Zen 4 EPYC: Q4_0 25.5-27.7 (57-59), Q4_1
// 24.8-26.2 (54), Q8_0 34-36 (86), while Q4_K, one stream a super-block, read 41-42 (49).
template <class T>
struct Tile32 {
  static constexpr bool kHas = true;
  static bool laid(int64_t nb) { return nb % 2 == 0; }  // every part of a group starts at 4 n
  static constexpr int kHalves = 1, kBiasTimes = Block32<T>::kFive ? 2 : 1;
  static constexpr int kSum16 = sum16_of(T::kId == Q8_0::kId ? 128 : Block32<T>::kFive ? 31 : 15);
  static constexpr int kHeads = Block32<T>::kMin ? 2 : 1;  // fp16 fields a block: d (and m)
  static constexpr int64_t kQuantBytes = T::kBlockBytes - 2 * kHeads;
  // where group j (blocks [j, j + count)) keeps part `head` (0: d, 1: m) and block j + e's quants
  struct Offsets {
    int64_t heads[2], quants;
    int64_t quant(int64_t e) const { return quants + kQuantBytes * e; }
  };
  template <bool kImage>
  static Offsets offsets(int64_t nb, int64_t j) {
    if constexpr (kImage) {
      const int64_t at = j * T::kBlockBytes, count = std::min<int64_t>(8, nb - j);
      return {{at, at + 2 * count}, at + 2 * kHeads * count};
    } else {
      return {{2 * j, 2 * nb + 2 * j}, 2 * kHeads * nb + kQuantBytes * j};
    }
  }
  template <bool kToImage>
  static void reorder(const uint8_t* from, int64_t nb, uint8_t* to) {
    for (int64_t j = 0; j < nb; j += 8) {
      const Offsets split = offsets<false>(nb, j), image = offsets<true>(nb, j);
      const int64_t count = std::min<int64_t>(8, nb - j);
      auto move = [&](int64_t s, int64_t i, int64_t bytes) {
        std::memcpy(to + (kToImage ? i : s), from + (kToImage ? s : i), bytes);
      };
      for (int h = 0; h < kHeads; ++h) move(split.heads[h], image.heads[h], 2 * count);
      move(split.quants, image.quants, kQuantBytes * count);
    }
  }
  static void to_image(const uint8_t* row, int64_t nb, uint8_t* out) { reorder<true>(row, nb, out); }
  static void from_image(const uint8_t* image, int64_t nb, uint8_t* out) { reorder<false>(image, nb, out); }
  template <class Src, class Sink>
  static void convert(const Src& src, int64_t nb, Sink&& sink) {
    using V = TileIsa;
    for (int64_t j = 0; j < nb; j += 8) {
      const Offsets at = offsets<Src::kImage>(nb, j);
      TI d2[4], m2[4];
      src.get(at.heads[0], d2);
      if constexpr (Block32<T>::kMin) src.get(at.heads[1], m2);
      for (int64_t e = 0; e < std::min<int64_t>(8, nb - j); ++e) {
        TI u[kUnitVecs];
        const TF d = e % 2 ? V::half_hi(d2[e / 2]) : V::half_lo(d2[e / 2]);
        TI q[4];
        if constexpr (T::kId == Q8_0::kId) {
          src.get(at.quant(e), q);
          TI r[4];
          src.get(at.quant(e) + 16, r);
          const TI flip = V::set1(V::kSignedQ8 ? 0 : static_cast<int>(0x80808080u));  // q + 128
          for (int k = 0; k < 4; ++k) {
            u[k] = V::xor_(q[k], flip);
            u[4 + k] = V::xor_(r[k], flip);
          }
        } else if constexpr (Block32<T>::kFive) {
          TI h[4];
          src.get(at.quant(e), h);  // h[0]: each row's 4 qh bytes
          src.get(at.quant(e) + 4, q);
          q4_unit(q, u);
          add_q5_high(h[0], u);
        } else {
          src.get(at.quant(e), q);
          if constexpr (T::kId == IQ4_NL::kId) TileIq4::unit(q, u);
          else q4_unit(q, u);
        }
        u[8] = V::as_i(d);
        if constexpr (Block32<T>::kMin) {
          const TF m = e % 2 ? V::half_hi(m2[e / 2]) : V::half_lo(m2[e / 2]);
          u[9] = V::as_i(V::add(m, V::mul(V::setf(Block32<T>::kZero), d)));
        } else {
          u[9] = V::as_i(V::zerof());
        }
        sink(j + e, u);
      }
    }
  }
};

template <>
struct Tile<Q4_0> : Tile32<Q4_0> {
  static constexpr bool kOffset = false, kSigned = false;
  static constexpr int kBias = 0;
};
template <>
struct Tile<Q4_1> : Tile32<Q4_1> {
  static constexpr bool kOffset = true, kSigned = false;
  static constexpr int kBias = 0;
};
template <>
struct Tile<Q8_0> : Tile32<Q8_0> {
  static constexpr bool kOffset = false, kSigned = TileIsa::kSignedQ8;
  static constexpr int kBias = kSigned ? -1 : 3;
};

template <>
struct Tile<Q5_0> : Tile32<Q5_0> {
  static constexpr bool kOffset = false, kSigned = false;
  static constexpr int kBias = 0;
};
template <>
struct Tile<Q5_1> : Tile32<Q5_1> {
  static constexpr bool kOffset = true, kSigned = false;
  static constexpr int kBias = 0;
};
template <>
struct Tile<IQ4_NL> : Tile32<IQ4_NL> {  // Tile32's reads, TileIq4's table and products
  static constexpr bool kOffset = false, kSigned = TileIq4::kSigned;
  static constexpr int kBias = TileIq4::kBias, kSum16 = TileIq4::kSum16;
};

// IQ4_XS: sub-block t of super-block s is unit 8 s + t, its nibbles the 16 bytes at 16 t of the
// super-block's qs, its scale d (ls - 32), ls = the nibble at bit 4 t of scales_l's dword with
// bits 2 t, 2 t + 1 of scales_h above it. Split rows put 2-byte d and scales_h parts first, so
// with an odd number of super-blocks (qwen2.5's FFN width 8960: 35) scales_h would start at 2
// mod 4; the laid-out image pairs them instead, a dword a super-block (d low, scales_h high),
// so every part starts at a multiple of 4 and any row can be laid out (the same bytes).
template <>
struct Tile<IQ4_XS> : TileIq4 {
  using T = IQ4_XS;
  static bool laid(int64_t) { return true; }
  template <bool kToImage>
  static void reorder(const uint8_t* from, int64_t nb, uint8_t* to) {
    for (int64_t s = 0; s < nb; ++s)
      for (int part = 0; part < 2; ++part) {  // d, scales_h: split at 2 nb part + 2 s, image at 4 s + 2 part
        const int64_t split = 2 * nb * part + 2 * s, image = 4 * s + 2 * part;
        std::memcpy(to + (kToImage ? image : split), from + (kToImage ? split : image), 2);
      }
    std::memcpy(to + 4 * nb, from + 4 * nb, nb * (T::kBlockBytes - 4));  // scales_l and qs as they are
  }
  static void to_image(const uint8_t* row, int64_t nb, uint8_t* out) { reorder<true>(row, nb, out); }
  static void from_image(const uint8_t* image, int64_t nb, uint8_t* out) { reorder<false>(image, nb, out); }
  template <class Src, class Sink>
  static void convert(const Src& src, int64_t nb, Sink&& sink) {
    using V = TileIsa;
    const int64_t q_off = nb * T::part_offset(T::kQuantPart), l_off = nb * T::part_offset(T::kLowPart);
    for (int64_t j = 0; j < nb; j += 8) {
      // per super-block e of these 8: a dword lane holding its d (low half) and scales_h (high)
      TI dh[8], l4[8];
      if constexpr (Src::kImage) {
        src.get(4 * j, dh);
        if (nb - j > 4) src.get(4 * j + 16, dh + 4);
      } else {
        TI d2[4], h2[4];
        src.get(nb * T::part_offset(T::kScalePart) + 2 * j, d2);
        src.get(nb * T::part_offset(T::kHighPart) + 2 * j, h2);
        const TI low16 = V::set1(0xffff);
        for (int e = 0; e < 8; ++e)
          dh[e] = e % 2 ? V::or_(V::srli<16>(d2[e / 2]), V::and_(h2[e / 2], V::set1(static_cast<int>(0xffff0000u))))
                        : V::or_(V::and_(d2[e / 2], low16), V::slli<16>(h2[e / 2]));
      }
      src.get(l_off + 4 * j, l4);
      if (nb - j > 4) src.get(l_off + 4 * j + 16, l4 + 4);
      for (int64_t e = 0; e < std::min<int64_t>(8, nb - j); ++e) {
        const TF d = V::half_lo(dh[e]);
        const TI high = V::srli<16>(dh[e]), low = l4[e];
        for (int t = 0; t < 8; ++t) {
          const TI ls = V::or_(V::and_(V::srl(low, 4 * t), V::set1(15)), V::slli<4>(V::and_(V::srl(high, 2 * t), V::set1(3))));
          TI q[4], u[kUnitVecs];
          src.get(q_off + 128 * (j + e) + 16 * t, q);
          unit(q, u);
          u[8] = V::as_i(V::mul(d, V::sub(V::cvt(ls), V::setf(32.0f))));
          u[9] = V::as_i(V::zerof());
          sink(8 * (j + e) + t, u);
        }
      }
    }
  }
};
#endif

}  // namespace tw
