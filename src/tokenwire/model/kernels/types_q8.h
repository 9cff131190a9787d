// Weight type Q8_0: 32 weights per block, an fp16 scale d and 32 int8 quants; weight i is d*q[i].
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "blocks.h"

namespace tw {

// Activations for a Q8_0 integer dot: a block's 32 bytes are read as 16 words whose even and
// odd bytes are sign-extended by shifts (no shuffle), so the activations of a block are stored
// even values then odd ones (see types_q4.h for the measurements of this choice).
constexpr int64_t q8_slot(int64_t b) { return (b % 2) * 16 + b / 2; }

struct ActI16Q8EvenOdd {
  static constexpr const char* kName = "i16_q8_even_odd";
  static constexpr int kBlock = 32;
  static int64_t stride(int64_t K) { return K; }
  static int64_t base(int64_t j) { return j * kBlock; }
  static constexpr int64_t slot(int64_t i) { return q8_slot(i); }
};

#ifdef TW_AVX2
// integer dot of a Q8_0 block as 8 int32 lanes: sign-extended even and odd bytes of each word
inline __m256i block_dot_q8(const uint8_t* q, const int16_t* x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), odd = _mm256_srai_epi16(w, 8);
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  return dot_acc(_mm256_madd_epi16(even, _mm256_loadu_si256(xv)), odd, _mm256_loadu_si256(xv + 1));
}
#endif

// Traits (the members are described at Q4_0 in types_q4.h).
struct Q8_0 : SplitLayout<2, 32> {
  static constexpr int64_t kId = 8;
  static constexpr const char* kName = "Q8_0";
  static constexpr int kBlock = 32;
  static constexpr int kScalePart = 0, kQuantPart = 1;
  using Act = ActI16Q8EvenOdd;

  static void dequant_block_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(part(row, nb, kScalePart) + 2 * j);
    const int8_t* q = reinterpret_cast<const int8_t*>(part(row, nb, kQuantPart) + 32 * j);
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(q[i]);
  }
#ifdef TW_AVX2
  static void dequant_block_avx2(const uint8_t* row, int64_t nb, int64_t j, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(part(row, nb, kScalePart) + 2 * j));
    const uint8_t* q = part(row, nb, kQuantPart) + 32 * j;
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    }
  }
  static __m256i dots8(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
    __m256i v[8];
    for (int t = 0; t < 8; ++t)
      v[t] = t < count ? block_dot_q8(quants + (j + t) * 32, x + (j + t) * kBlock) : _mm256_setzero_si256();
    return sum_lanes8(v);
  }
  static constexpr bool kHasOffset = false;
  static __m256 offset8(const uint8_t*, int64_t, int64_t, __m256) { return _mm256_setzero_ps(); }
#endif
};

}  // namespace tw
