// Weight types Q4_0 and Q4_1: 32 weights per block, an fp16 scale d (Q4_1: and an fp16 minimum
// m), 16 quant bytes; weight i < 16 is the low nibble of byte i, weight i + 16 its high nibble.
// Q4_0 weighs d*(q-8), Q4_1 d*q+m, exactly as gguf's reference dequantiser.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "blocks.h"

namespace tw {

// Activations for a Q4 integer dot. The weights are widened to int16 with shifts and masks on
// whole 16-bit words, not with vpmovzxbw (a shuffle per 16 weights, one shuffle port on Zen 3):
// a word of two quant bytes yields its four nibbles as four vectors. A block pair (32 quant
// bytes = 16 words) is read as four vectors of 16 nibbles: vector k holds nibble k of each word.
// Word v of a block (v < 8) is quant bytes 2v, 2v+1, whose nibbles are weights 2v, 2v+16, 2v+1,
// 2v+17. Activations of a pair take 64 int16 slots [k][word]; a trailing single block takes the
// first 8 words of each k. Measured on one core, SmolLM2's shapes (us, vpmovzxbw -> this):
// gate/up 3072x576 160 -> 133, down 576x1536 73 -> 51, qkv 960x576 57 -> 49.
constexpr int64_t q4_slot(int64_t i) {  // i: index within a block pair (0..63)
  const int64_t block = i / 32, b = i % 32;
  const int64_t byte = b % 16, high = b / 16;         // nibble of quant byte `byte`
  const int64_t word = block * 8 + byte / 2;           // 16-bit word within the pair
  const int64_t k = (byte % 2) * 2 + high;             // nibble of that word
  return k * 16 + word;
}

struct ActI16Q4Pairs {
  static constexpr const char* kName = "i16_q4_pairs";
  static constexpr int kBlock = 32;
  static int64_t stride(int64_t K) { return (K / kBlock + 1) / 2 * 64; }
  // block j's first slot (a pair's second block is 8 words on from its first) and value i's
  // slot from there: q4_slot(32 + i) = q4_slot(i) + 8
  static int64_t base(int64_t j) { return j / 2 * 64 + (j % 2) * 8; }
  static constexpr int64_t slot(int64_t i) { return q4_slot(i); }
};

#ifdef TW_AVX2
// integer dots of a Q4 block pair: 8 int32 lanes, lanes 0-3 summing to the first block's dot,
// 4-7 to the second's
inline __m256i pair_dot_q4(const uint8_t* q, const int16_t* x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i low = _mm256_set1_epi16(0x0f);
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  __m256i s = _mm256_madd_epi16(_mm256_and_si256(w, low), _mm256_loadu_si256(xv));
  s = dot_acc(s, _mm256_and_si256(_mm256_srli_epi16(w, 4), low), _mm256_loadu_si256(xv + 1));
  s = dot_acc(s, _mm256_and_si256(_mm256_srli_epi16(w, 8), low), _mm256_loadu_si256(xv + 2));
  return dot_acc(s, _mm256_srli_epi16(w, 12), _mm256_loadu_si256(xv + 3));
}

// a trailing single Q4 block (its activations in the first 8 words of each nibble vector), as
// a pair's lanes with the absent second block zero
inline __m256i single_dot_q4(const uint8_t* q, const int16_t* x) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low = _mm_set1_epi16(0x0f);
  auto xk = [x](int k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * k)); };
  __m128i s = _mm_madd_epi16(_mm_and_si128(w, low), xk(0));
  s = _mm_add_epi32(s, _mm_madd_epi16(_mm_and_si128(_mm_srli_epi16(w, 4), low), xk(1)));
  s = _mm_add_epi32(s, _mm_madd_epi16(_mm_and_si128(_mm_srli_epi16(w, 8), low), xk(2)));
  s = _mm_add_epi32(s, _mm_madd_epi16(_mm_srli_epi16(w, 12), xk(3)));
  return _mm256_inserti128_si256(_mm256_setzero_si256(), s, 0);
}

// the integer dots of Q4 blocks j..j+count-1 (count <= 8, j even), block t in lane t, the rest 0:
// four pairs, whose hadds leave blocks in lanes [0 2 4 6 | 1 3 5 7]
inline __m256i dots8_q4(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
  const uint8_t* q = quants + j * 16;
  const int16_t* xp = x + j / 2 * 64;
  __m256i p[4];
  for (int t = 0; t < 4; ++t) {
    if (2 * t + 1 < count) p[t] = pair_dot_q4(q + 32 * t, xp + 64 * t);
    else if (2 * t < count) p[t] = single_dot_q4(q + 32 * t, xp + 64 * t);
    else p[t] = _mm256_setzero_si256();
  }
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// a block's 32 nibbles as four vectors of 8 int32 (weights 0..7, 8..15, 16..23, 24..31)
inline void nibbles_avx2(const uint8_t* q, __m256i ints[4]) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(packed, mask);                     // weights 0..15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // weights 16..31
  ints[0] = _mm256_cvtepu8_epi32(lo);
  ints[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
  ints[2] = _mm256_cvtepu8_epi32(hi);
  ints[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}
#endif

// Traits of a type in the 32-weight block family (type_kernels.h's templates take these):
// kId, kName, kBlock, the SplitLayout, kScalePart / kQuantPart, Act (activation format),
// dequant_block_scalar / _avx2, dots8 (integer dots of 8 blocks) and kHasOffset / offset8 (the
// per-block term that multiplies the activations' exact fp32 block sum: -8d, m, or none).
struct Q4_0 : SplitLayout<2, 16> {
  static constexpr int64_t kId = 2;
  static constexpr const char* kName = "Q4_0";
  static constexpr int kBlock = 32;
  static constexpr int kScalePart = 0, kQuantPart = 1;
  using Act = ActI16Q4Pairs;

  static void dequant_block_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(part(row, nb, kScalePart) + 2 * j);
    const uint8_t* q = part(row, nb, kQuantPart) + 16 * j;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
      out[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
    }
  }
#ifdef TW_AVX2
  static void dequant_block_avx2(const uint8_t* row, int64_t nb, int64_t j, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(part(row, nb, kScalePart) + 2 * j));
    __m256i ints[4];
    nibbles_avx2(part(row, nb, kQuantPart) + 16 * j, ints);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ints[i], eight)));
  }
  static __m256i dots8(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
    return dots8_q4(quants, x, j, count);
  }
  static constexpr bool kHasOffset = true;
  static __m256 offset8(const uint8_t*, int64_t, int64_t, __m256 d) { return _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)); }
#endif
};

struct Q4_1 : SplitLayout<2, 2, 16> {
  static constexpr int64_t kId = 3;
  static constexpr const char* kName = "Q4_1";
  static constexpr int kBlock = 32;
  static constexpr int kScalePart = 0, kMinPart = 1, kQuantPart = 2;
  using Act = ActI16Q4Pairs;

  static void dequant_block_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(part(row, nb, kScalePart) + 2 * j);
    const float m = half_to_float(part(row, nb, kMinPart) + 2 * j);
    const uint8_t* q = part(row, nb, kQuantPart) + 16 * j;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(q[i] & 0x0f) + m;
      out[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
    }
  }
#ifdef TW_AVX2
  static void dequant_block_avx2(const uint8_t* row, int64_t nb, int64_t j, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(part(row, nb, kScalePart) + 2 * j));
    __m256i ints[4];
    nibbles_avx2(part(row, nb, kQuantPart) + 16 * j, ints);
    const __m256 m = _mm256_set1_ps(half_to_float(part(row, nb, kMinPart) + 2 * j));
    // d*q is exact in fp32 (11-bit by 4-bit mantissas): the fused form rounds once, like d*q+m
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(ints[i]), m);
  }
  static __m256i dots8(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
    return dots8_q4(quants, x, j, count);
  }
  static constexpr bool kHasOffset = true;
  static __m256 offset8(const uint8_t* row, int64_t nb, int64_t j, __m256) { return halves8(part(row, nb, kMinPart), j); }
#endif
};

}  // namespace tw
