// Weight types Q5_0, Q5_1 and IQ4_NL: 32 weights per block and an fp16 scale d, like Q4_0/Q4_1,
// and one activation format for the three of them (i16_byte_pairs); IQ4_XS (at the end: 256-weight
// super-blocks of IQ4_NL's sub-blocks) takes it too.
//   Q5_0: d, 4 bytes of high bits qh, 16 nibble bytes qs: weight i is d*(q-16), q = its nibble
//         (the low nibble of qs[i] for i < 16, the high nibble of qs[i-16] after) + 16 * bit i of
//         qh (little-endian).
//   Q5_1: d, a minimum m, qh, qs: d*q + m.
//   IQ4_NL: d, qs: d * kIq4Values[nibble] (a non-linear 16-entry table of int8).
// Exactly as gguf's reference dequantiser: d*q and d*k are exact in fp32, so d*q+m rounds once.
//
// Split rows: a Q5 row keeps each block's qh and qs together (one 20-byte part): the block pair
// dot below reads both, and the type_kernels.h driver hands a type's dots one part of the row.
//
// The integer dot builds a block pair's weights as bytes (0..31 for Q5, 1..241 for IQ4_NL: the
// table plus 128, whose -128 d term goes with the exact activation sums like Q4_0's -8 d), then
// widens them as Q8_0 does, even and odd bytes of 16-bit words with a mask and a shift:
//   nibbles: one 32-byte load for two blocks' qs, a mask and a shift (as Q4);
//   Q5's fifth bit: the pair's qh broadcast per 128-bit lane, a vpshufb giving each byte its qh
//   byte, its bit isolated (and), 16 where set (vpsignb), or-ed into the nibble;
//   IQ4_NL: the nibble indexes the table with one vpshufb;
//   4 vpmaddwd against the pair's int16 activations (i16_byte_pairs' slot order).
// The decode matvec (M=1, int16 activations; fp32: the eager path's) is bound by its instructions,
// not by memory: Q4_0 runs ~80 a group of 8 blocks, IQ4_NL ~100, IQ4_XS ~112, Q5 ~130. F16/BF16
// (no integer dot, types_float.h) stream at the memory's pace. Measured on the 2-core AMD EPYC
// (Zen 5, 32 MiB L3: every matrix below fits but F16/BF16 8192x2048, 32 MiB) with other work on
// the machine; min of 30 calls, torch.set_num_threads(1); us per call (GB/s of weight bytes):
//                    2048x2048                  8192x2048
//             int16        fp32          int16        fp32
//   Q4_0     82 (28.7)   268 ( 8.8)     317 (29.7)  1057 ( 8.9)
//   Q5_0    143 (20.1)   390 ( 7.4)     559 (20.7)  1560 ( 7.4)
//   Q5_1    144 (21.9)   362 ( 8.7)     575 (21.9)  1459 ( 8.6)
//   IQ4_NL   98 (24.0)   251 ( 9.4)     381 (24.8)  1000 ( 9.4)
//   IQ4_XS  116 (19.2)   256 ( 8.7)     450 (19.8)  1023 ( 8.7)
//   F16          -       138 (60.8)         -        826 (40.6)
//   BF16         -       136 (61.6)         -        866 (38.7)
// Two threads, when the other core was free (else a call took a time slice, ~8 ms), int16 (F16,
// BF16: fp32) us at 2048x2048 / 8192x2048: Q4_0 49 / 171, Q5_0 77 / 287, Q5_1 77 / 287, IQ4_NL
// 55 / 197, IQ4_XS 75 / 231, F16 74 / 275, BF16 73 / 280 (8192x2048: 55, 40, 44, 48, 39, 122, 120
// GB/s). Q5 costs ~1.7x Q4_0: its fifth bits take 4 operations per 32 weights (vpshufb, and,
// vpsignb, or); keeping qh apart from qs in the split row (one load less and no blend per pair)
// would save ~2 of ~32 a pair more, but the driver hands dots8 only one part of the row.
//
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "blocks.h"

namespace tw {

// IQ4_NL's table (ggml's kvalues_iq4nl): the weight of nibble n is d * kIq4Values[n]
inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Activations for a byte-pair dot. A block pair's 64 weights are two vectors of 32 bytes: `lo`
// holds weights 0..15 of the first block then 0..15 of the second, `hi` weights 16..31 of each;
// each vector is read as 16 words, its even bytes (mask) and odd bytes (shift) as two int16
// vectors. Activations of a pair take 64 slots [lo even, lo odd, hi even, hi odd] x 16 words; a
// trailing single block takes the first 8 words of each (its partner's bytes are zero).
constexpr int64_t byte_pair_slot(int64_t i) {  // i: index within a block pair (0..63)
  const int64_t block = i / 32, b = i % 32;
  const int64_t vec = b / 16, byte = block * 16 + b % 16;  // byte `byte` of vector lo or hi
  return vec * 32 + (byte % 2) * 16 + byte / 2;
}

struct ActI16BytePairs {
  static constexpr const char* kName = "i16_byte_pairs";
  static constexpr int kBlock = 32;
  static int64_t stride(int64_t K) { return (K / kBlock + 1) / 2 * 64; }
  // a pair's second block is 8 words on from its first: byte_pair_slot(32 + i) = byte_pair_slot(i) + 8
  static int64_t base(int64_t j) { return j / 2 * 64 + (j % 2) * 8; }
  static constexpr int64_t slot(int64_t i) { return byte_pair_slot(i); }
};

// a Q5 block's 5-bit value of weight i (qh_qs: its 20 bytes, qh then qs)
inline int q5_value(const uint8_t* qh_qs, int i) {
  const int nibble = i < 16 ? qh_qs[4 + i] & 0x0f : qh_qs[4 + i - 16] >> 4;
  return nibble | (((qh_qs[i / 8] >> (i % 8)) & 1) << 4);
}

#ifdef TW_AVX2
inline __m256i bp_load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i bp_load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline int32_t bp_load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// the integer dots of a block pair from its weight bytes (unsigned): 8 int32 lanes, lanes 0-3
// summing to the first block's dot, 4-7 to the second's (as pair_dot_q4)
inline __m256i byte_pair_dot(__m256i lo, __m256i hi, const int16_t* x) {
  const __m256i even = _mm256_set1_epi16(0x00ff);
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  __m256i s = _mm256_madd_epi16(_mm256_and_si256(lo, even), _mm256_loadu_si256(xv));
  s = dot_acc(s, _mm256_srli_epi16(lo, 8), _mm256_loadu_si256(xv + 1));
  s = dot_acc(s, _mm256_and_si256(hi, even), _mm256_loadu_si256(xv + 2));
  return dot_acc(s, _mm256_srli_epi16(hi, 8), _mm256_loadu_si256(xv + 3));
}

// Q5 weight bytes (0..31) of blocks j, j+1 of a row's qh_qs part; with kSingle block j alone,
// reading only its own 20 bytes, the second block's bytes zero
template <bool kSingle>
inline void q5_pair_bytes(const uint8_t* qh_qs, int64_t j, __m256i& lo, __m256i& hi) {
  const uint8_t* a = qh_qs + 20 * j;
  __m256i qs, h;  // qs: the nibble bytes of a | b; h: a's qh in each dword of the low lane, b's of the high
  if (kSingle) {
    qs = _mm256_zextsi128_si256(bp_load16(a + 4));
    h = _mm256_zextsi128_si256(_mm_set1_epi32(bp_load4(a)));
  } else {
    qs = _mm256_inserti128_si256(_mm256_castsi128_si256(bp_load16(a + 4)), bp_load16(a + 24), 1);
    h = _mm256_blend_epi32(_mm256_set1_epi32(bp_load4(a)), _mm256_set1_epi32(bp_load4(a + 20)), 0xf0);
  }
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  lo = _mm256_and_si256(qs, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), nibble);
  // byte p of lo is weight p (p < 16 within its lane): bit p%8 of qh byte p/8; of hi, weight
  // 16 + p: qh byte 2 + p/8. The bit, isolated, is 0 or 2^(p%8) as a signed byte: vpsignb of 16
  // by it gives 0 or 16 (the byte of bit 7 is negative: -16 there, whose sign flips back).
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i sixteen = _mm256_set1_epi64x(static_cast<int64_t>(0xf010101010101010ull));
  const __m256i pick_lo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                           0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m256i pick_hi = _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,  //
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  lo = _mm256_or_si256(lo, _mm256_sign_epi8(sixteen, _mm256_and_si256(_mm256_shuffle_epi8(h, pick_lo), bit)));
  hi = _mm256_or_si256(hi, _mm256_sign_epi8(sixteen, _mm256_and_si256(_mm256_shuffle_epi8(h, pick_hi), bit)));
}

// IQ4_NL's table as bytes: kIq4Values + 128 (for the dot) or as they are (dequantisation)
inline __m128i iq4_table(bool biased) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  return biased ? _mm_add_epi8(t, _mm_set1_epi8(static_cast<char>(0x80))) : t;
}

// IQ4_NL weight bytes (table + 128: 1..241) of blocks j, j+1 of a row's qs part (kSingle: as Q5)
template <bool kSingle>
inline void iq4_pair_bytes(const uint8_t* qs, int64_t j, __m256i& lo, __m256i& hi) {
  const __m256i v = kSingle ? _mm256_zextsi128_si256(bp_load16(qs + 16 * j)) : bp_load32(qs + 16 * j);
  const __m256i nibble = _mm256_set1_epi8(0x0f), table = _mm256_broadcastsi128_si256(iq4_table(true));
  lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, nibble));
  hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
  if (kSingle) {  // the absent block's zero nibbles looked up table[0]: zero it again
    lo = _mm256_zextsi128_si256(_mm256_castsi256_si128(lo));
    hi = _mm256_zextsi128_si256(_mm256_castsi256_si128(hi));
  }
}

// the integer dots of blocks j..j+count-1 (count <= 8, j even), block t in lane t, the rest 0:
// four pairs, whose hadds leave blocks in lanes [0 2 4 6 | 1 3 5 7] (as dots8_q4). Pair / Single:
// a type's pair bytes, <false> and <true>.
template <void (*Pair)(const uint8_t*, int64_t, __m256i&, __m256i&),
          void (*Single)(const uint8_t*, int64_t, __m256i&, __m256i&)>
inline __m256i dots8_byte_pairs(const uint8_t* part, const int16_t* x, int64_t j, int64_t count) {
  const int16_t* xp = x + j / 2 * 64;
  auto pair = [&](int t) __attribute__((always_inline)) {
    __m256i lo, hi;
    if (2 * t + 1 < count) {
      Pair(part, j + 2 * t, lo, hi);
    } else if (2 * t < count) {
      Single(part, j + 2 * t, lo, hi);
    } else {
      return _mm256_setzero_si256();
    }
    return byte_pair_dot(lo, hi, xp + 64 * t);
  };
  // pairs hadded as they come (fewer live vectors: 16 registers)
  const __m256i h01 = _mm256_hadd_epi32(pair(0), pair(1));
  const __m256i h = _mm256_hadd_epi32(h01, _mm256_hadd_epi32(pair(2), pair(3)));
  return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 16 bytes (the low lanes of lo and hi: weights 0..15, 16..31 of a block) as four vectors of 8 int32
inline void bytes_to_ints(__m128i lo, __m128i hi, __m256i ints[4], bool is_signed) {
  if (is_signed) {
    ints[0] = _mm256_cvtepi8_epi32(lo);
    ints[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
    ints[2] = _mm256_cvtepi8_epi32(hi);
    ints[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
  } else {
    ints[0] = _mm256_cvtepu8_epi32(lo);
    ints[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    ints[2] = _mm256_cvtepu8_epi32(hi);
    ints[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
  }
}

// an IQ4 block's (16 nibble bytes') 32 weights: scale * table[nibble], as four vectors of 8
inline void iq4_values(const uint8_t* q16, __m256 scale, __m256 w[4]) {
  const __m128i q = bp_load16(q16), nibble = _mm_set1_epi8(0x0f), table = iq4_table(false);
  __m256i ints[4];
  bytes_to_ints(_mm_shuffle_epi8(table, _mm_and_si128(q, nibble)),
                _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), nibble)), ints, true);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(ints[i]));
}

// a Q5 block's 32 values (0..31) as four vectors of 8 int32
inline void q5_ints(const uint8_t* qh_qs, int64_t j, __m256i ints[4]) {
  __m256i lo, hi;
  q5_pair_bytes<true>(qh_qs, j, lo, hi);
  bytes_to_ints(_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi), ints, false);
}
#endif

// Traits (the members are described at Q4_0 in types_q4.h).
struct Q5_0 : SplitLayout<2, 20> {
  static constexpr int64_t kId = 6;
  static constexpr const char* kName = "Q5_0";
  static constexpr int kBlock = 32;
  static constexpr int kScalePart = 0, kQuantPart = 1;
  using Act = ActI16BytePairs;

  static void dequant_block_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(part(row, nb, kScalePart) + 2 * j);
    const uint8_t* q = part(row, nb, kQuantPart) + 20 * j;
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(q5_value(q, i) - 16);
  }
#ifdef TW_AVX2
  static void dequant_block_avx2(const uint8_t* row, int64_t nb, int64_t j, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(part(row, nb, kScalePart) + 2 * j));
    __m256i ints[4];
    q5_ints(part(row, nb, kQuantPart), j, ints);
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ints[i], sixteen)));
  }
  static __m256i dots8(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
    return dots8_byte_pairs<&q5_pair_bytes<false>, &q5_pair_bytes<true>>(quants, x, j, count);
  }
  static constexpr bool kHasOffset = true;
  static __m256 offset8(const uint8_t*, int64_t, int64_t, __m256 d) { return _mm256_mul_ps(d, _mm256_set1_ps(-16.0f)); }
#endif
};

struct Q5_1 : SplitLayout<2, 2, 20> {
  static constexpr int64_t kId = 7;
  static constexpr const char* kName = "Q5_1";
  static constexpr int kBlock = 32;
  static constexpr int kScalePart = 0, kMinPart = 1, kQuantPart = 2;
  using Act = ActI16BytePairs;

  static void dequant_block_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(part(row, nb, kScalePart) + 2 * j);
    const float m = half_to_float(part(row, nb, kMinPart) + 2 * j);
    const uint8_t* q = part(row, nb, kQuantPart) + 20 * j;
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(q5_value(q, i)) + m;
  }
#ifdef TW_AVX2
  static void dequant_block_avx2(const uint8_t* row, int64_t nb, int64_t j, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(part(row, nb, kScalePart) + 2 * j));
    const __m256 m = _mm256_set1_ps(half_to_float(part(row, nb, kMinPart) + 2 * j));
    __m256i ints[4];
    q5_ints(part(row, nb, kQuantPart), j, ints);
    // d*q is exact in fp32 (11-bit by 5-bit mantissas): the fused form rounds once, like d*q+m
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(ints[i]), m);
  }
  static __m256i dots8(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
    return dots8_byte_pairs<&q5_pair_bytes<false>, &q5_pair_bytes<true>>(quants, x, j, count);
  }
  static constexpr bool kHasOffset = true;
  static __m256 offset8(const uint8_t* row, int64_t nb, int64_t j, __m256) { return halves8(part(row, nb, kMinPart), j); }
#endif
};

struct IQ4_NL : SplitLayout<2, 16> {
  static constexpr int64_t kId = 20;
  static constexpr const char* kName = "IQ4_NL";
  static constexpr int kBlock = 32;
  static constexpr int kScalePart = 0, kQuantPart = 1;
  using Act = ActI16BytePairs;

  static void dequant_block_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(part(row, nb, kScalePart) + 2 * j);
    const uint8_t* q = part(row, nb, kQuantPart) + 16 * j;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(kIq4Values[q[i] & 0x0f]);
      out[i + 16] = d * static_cast<float>(kIq4Values[q[i] >> 4]);
    }
  }
#ifdef TW_AVX2
  static void dequant_block_avx2(const uint8_t* row, int64_t nb, int64_t j, __m256 w[4]) {
    iq4_values(part(row, nb, kQuantPart) + 16 * j, _mm256_set1_ps(half_to_float(part(row, nb, kScalePart) + 2 * j)), w);
  }
  static __m256i dots8(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
    return dots8_byte_pairs<&iq4_pair_bytes<false>, &iq4_pair_bytes<true>>(quants, x, j, count);
  }
  static constexpr bool kHasOffset = true;  // the table's +128
  static __m256 offset8(const uint8_t*, int64_t, int64_t, __m256 d) { return _mm256_mul_ps(d, _mm256_set1_ps(-128.0f)); }
#endif
};

// IQ4_XS: super-blocks of 256 weights in 136 bytes: an fp16 d, then 8 sub-blocks of 32 weights,
// each with a 6-bit scale ls (its low 4 bits in scales_l, 4 bytes of nibbles; its high 2 in
// scales_h, a little-endian uint16) and IQ4_NL's nibbles (16 bytes a sub-block, as an IQ4_NL
// block's): weight = (d * (ls - 32)) * table[nibble], exact in fp32 (11 + 6 + 8 bits), as gguf.
// A sub-block is a block of the activations (i16_byte_pairs): the integer dot of a super-block
// is IQ4_NL's of 8 blocks, scaled by its 8 sub-block scales as one vector. Its own row functions
// (make_own_row): type_kernels.h's templates take one fp16 scale per block.
struct IQ4_XS : SplitLayout<2, 2, 4, 128> {
  static constexpr int64_t kId = 23;
  static constexpr const char* kName = "IQ4_XS";
  static constexpr int kBlock = 256;
  static constexpr int kScalePart = 0, kHighPart = 1, kLowPart = 2, kQuantPart = 3;
  static constexpr bool kIntDot = true;
  using Act = ActI16BytePairs;

  // the scale of sub-block t of super-block j: d * (ls - 32)
  static float sub_scale(const uint8_t* row, int64_t nb, int64_t j, int t) {
    uint16_t high;
    std::memcpy(&high, part(row, nb, kHighPart) + 2 * j, 2);
    const int low = part(row, nb, kLowPart)[4 * j + t / 2] >> (4 * (t % 2)) & 0x0f;
    const int ls = low | (high >> (2 * t) & 3) << 4;
    return half_to_float(part(row, nb, kScalePart) + 2 * j) * static_cast<float>(ls - 32);
  }
#ifdef TW_AVX2
  // the eight sub-block scales of super-block j as one vector
  static __m256 scales8(const uint8_t* row, int64_t nb, int64_t j) {
    uint16_t high;
    std::memcpy(&high, part(row, nb, kHighPart) + 2 * j, 2);
    const __m256i low4 = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(bp_load4(part(row, nb, kLowPart) + 4 * j)),
                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(0x0f));
    const __m256i high2 = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(high), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_or_si256(low4, _mm256_slli_epi32(high2, 4));
    const __m256 d = _mm256_set1_ps(half_to_float(part(row, nb, kScalePart) + 2 * j));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
  }
#endif

  // super-block j's 256 weights
  static void dequant_super(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const uint8_t* q = part(row, nb, kQuantPart) + 128 * j;
#ifdef TW_AVX2
    float scales[8];
    _mm256_storeu_ps(scales, scales8(row, nb, j));
    for (int t = 0; t < 8; ++t) {
      __m256 w[4];
      iq4_values(q + 16 * t, _mm256_set1_ps(scales[t]), w);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 32 * t + 8 * i, w[i]);
    }
#else
    for (int t = 0; t < 8; ++t) {
      const float dl = sub_scale(row, nb, j, t);
      for (int i = 0; i < 16; ++i) {
        out[32 * t + i] = dl * static_cast<float>(kIq4Values[q[16 * t + i] & 0x0f]);
        out[32 * t + i + 16] = dl * static_cast<float>(kIq4Values[q[16 * t + i] >> 4]);
      }
    }
#endif
  }

  static void dequant_row(const uint8_t* row, int64_t nb, float* out) {
    for (int64_t j = 0; j < nb; ++j) dequant_super(row, nb, j, out + 256 * j);
  }

  // fp32 activations, M < 4: as matmul_small_avx2, a sub-block's weights in registers at a time
  template <int M>
  static void matmul_small_m(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                             int64_t N) {
    const int64_t nb = K / kBlock, row_bytes = nb * kBlockBytes;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
#ifdef TW_AVX2
      constexpr int kAcc = M == 1 ? 4 : 2;
      __m256 acc[M][kAcc];
      for (int m = 0; m < M; ++m)
        for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm256_setzero_ps();
      for (int64_t j = 0; j < nb; ++j) {
        float scales[8];
        _mm256_storeu_ps(scales, scales8(row, nb, j));
        const uint8_t* q = part(row, nb, kQuantPart) + 128 * j;
        for (int t = 0; t < 8; ++t) {
          __m256 wv[4];
          iq4_values(q + 16 * t, _mm256_set1_ps(scales[t]), wv);
          for (int m = 0; m < M; ++m) {
            const float* xb = x + m * K + 256 * j + 32 * t;
            for (int i = 0; i < 4; ++i)
              acc[m][i % kAcc] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb + 8 * i), acc[m][i % kAcc]);
          }
        }
      }
      for (int m = 0; m < M; ++m) {
        __m256 total = acc[m][0];
        for (int a = 1; a < kAcc; ++a) total = _mm256_add_ps(total, acc[m][a]);
        out[m * N + n] = hsum(total);
      }
#else
      float acc[M] = {}, wb[kBlock];
      for (int64_t j = 0; j < nb; ++j) {
        dequant_super(row, nb, j, wb);
        for (int m = 0; m < M; ++m)
          for (int i = 0; i < kBlock; ++i) acc[m] += wb[i] * x[m * K + j * kBlock + i];
      }
      for (int m = 0; m < M; ++m) out[m * N + n] = acc[m];
#endif
    }
  }

  static void matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                           float* out, int64_t N) {
    if (M == 1) matmul_small_m<1>(x, K, w, n0, n1, out, N);
    else if (M == 2) matmul_small_m<2>(x, K, w, n0, n1, out, N);
    else matmul_small_m<3>(x, K, w, n0, n1, out, N);
  }

#ifdef TW_AVX2
  // int16 activations, M < 4: as type_kernels.h's matmul_small_i16 with a super-block for a
  // group of 8 blocks, scaled by its sub-block scales (the table's -128 with exact sums)
  template <int M>
  static void matmul_small_i16_m(const QuantizedActivations& a, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                                 float* out, int64_t N) {
    const int64_t nb = K / kBlock, row_bytes = nb * kBlockBytes;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      const uint8_t* quants = part(row, nb, kQuantPart);
      __m256 acc[M], extra[M];
      for (int m = 0; m < M; ++m) acc[m] = extra[m] = _mm256_setzero_ps();
      for (int64_t j = 0; j < nb; ++j) {
        const __m256 scales = scales8(row, nb, j), offset = _mm256_mul_ps(scales, _mm256_set1_ps(-128.0f));
        for (int m = 0; m < M; ++m) {
          const int64_t r = m * a.nb + 8 * j;
          const __m256i dots = dots8_byte_pairs<&iq4_pair_bytes<false>, &iq4_pair_bytes<true>>(
              quants, a.q.data() + m * a.stride, 8 * j, 8);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scales, _mm256_loadu_ps(a.scale.data() + r)), acc[m]);
          extra[m] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(a.sum.data() + r), extra[m]);
        }
      }
      for (int m = 0; m < M; ++m) out[m * N + n] = hsum(acc[m]) + hsum(extra[m]);
    }
  }

  static void matmul_small_i16(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0,
                               int64_t n1, float* out, int64_t N) {
    if (M == 1) matmul_small_i16_m<1>(a, K, w, n0, n1, out, N);
    else if (M == 2) matmul_small_i16_m<2>(a, K, w, n0, n1, out, N);
    else matmul_small_i16_m<3>(a, K, w, n0, n1, out, N);
  }
#endif
};

}  // namespace tw
