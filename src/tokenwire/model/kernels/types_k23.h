// Weight types Q2_K and Q3_K: 256-weight super-blocks of 2-bit quants (Q3_K: and a third bit)
// with a scale per 16 weights, weighed exactly as gguf's reference dequantiser:
//   Q2_K: 16 scale bytes (low nibble sc, high nibble m, one per 16 weights), 64 bytes qs, fp16
//     d, dmin. In each half of 128 weights, weight 32t + i is bits 2t.. of qs byte i (of the
//     half's 32); it weighs (d*sc) * q - dmin*m (d*sc*q exact: one rounding).
//   Q3_K: 32 bytes hmask, 64 bytes qs (as Q2_K's), 12 bytes of 6-bit scales, fp16 d. Weight
//     32g + i (g = 0..7) is q = ql - 4 + 4 * (bit g of hmask byte i); it weighs (d*(sc - 32)) * q
//     (exact).
// The rows' layout, drivers and timing notes are types_k.h's (these are its K types' kin).
//
// Decode matvec (M = 1, int16 activations), measured with types_k.h's table (the same runs):
//                 one thread                       two threads
//            2048x2048       8192x2048        2048x2048       8192x2048
//   Q4_0     80.3 29.4 GB/s  308 30.7 GB/s    53.6 44.0 GB/s  186 50.6 GB/s
//   Q3_K      158 11.4 GB/s  620 11.6 GB/s    85.7 21.0 GB/s  329 21.9 GB/s
//   Q2_K      103 13.4 GB/s  405 13.6 GB/s    58.0 23.7 GB/s  216 25.5 GB/s
// Per weight these do as many vpmaddwd as the 4-bit types (int16 activations: 16 per 256), so
// their time is about Q4_K's while their bytes are fewer; Q3_K's third bit costs three more
// operations per 16 weights.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "types_k.h"

namespace tw {

// Activations for Q2_K and Q3_K: one scale (and exact sum) per 16 values, their sub-blocks (the
// min of Q2_K and the -4 of Q3_K go with the sums). A qs byte holds four 2-bit weights of four
// 32-weight blocks; its 32-byte half of a super-block is read as 16 words, and the masks of
// field t on a word and on the word shifted by 8 give block t's even and odd weights: a 32-value
// block is stored even values, then odd ones (as Q8_0's, in 16-value halves).
struct ActI16EvenOdd16 {
  static constexpr const char* kName = "i16_even_odd16";
  static constexpr int kBlock = 16;
  static int64_t stride(int64_t K) { return K; }
  static int64_t base(int64_t j) { return j / 2 * 32 + (j % 2) * 8; }
  static constexpr int64_t slot(int64_t i) { return (i % 2) * 16 + i / 2; }
};

#ifdef TW_AVX2
// field t of a word is 4^t q: sub-blocks 2t, 2t + 1 of a half (sub_dots16's lanes) are block t's
inline __m256 k23_fields() { return _mm256_setr_ps(1, 1, 0.25f, 0.25f, 0.0625f, 0.0625f, 0.015625f, 0.015625f); }
#endif

// ---------------------------------------------------------------------------------------------
struct Q2_K : KLayout<kSplitK, 16, 64, 2, 2> {
  static constexpr int64_t kId = 10;
  static constexpr const char* kName = "Q2_K";
  static constexpr int kBlock = kQK;
  static constexpr int kScales = 0, kQs = 1, kD = 2, kDmin = 3;
  using Act = ActI16EvenOdd16;

  static void dequant_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(field(row, nb, j, kD)), dmin = half_to_float(field(row, nb, j, kDmin));
    const uint8_t* scales = field(row, nb, j, kScales);
    const uint8_t* qs = field(row, nb, j, kQs);
    for (int w = 0; w < kQK; ++w) {
      const int h = w / 128, t = w % 128 / 32, i = w % 32, sc = scales[w / 16];
      const int q = (qs[32 * h + i] >> (2 * t)) & 3;
      out[w] = (d * static_cast<float>(sc & 0x0f)) * static_cast<float>(q) - dmin * static_cast<float>(sc >> 4);
    }
  }

#ifdef TW_AVX2
  static void dequant_avx2(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(field(row, nb, j, kD)), dmin = half_to_float(field(row, nb, j, kDmin));
    const uint8_t* scales = field(row, nb, j, kScales);
    const uint8_t* qs = field(row, nb, j, kQs);
    const __m256i three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      __m256i w = load256(qs + 32 * h);
      for (int t = 0; t < 4; ++t, w = _mm256_srli_epi16(w, 2)) {
        const int s = 8 * h + 2 * t;  // the 32 weights' two 16-weight sub-blocks
        auto dl = [&](int k) { return _mm256_set1_ps(d * static_cast<float>(scales[k] & 0x0f)); };
        auto ml = [&](int k) { return _mm256_set1_ps(-(dmin * static_cast<float>(scales[k] >> 4))); };
        store_affine_u8(_mm256_and_si256(w, three), dl(s), ml(s), dl(s + 1), ml(s + 1), out + 128 * h + 32 * t);
      }
    }
  }

  // acc[m] += the super-block's dot with activation row m (int16, ActI16EvenOdd16): per half,
  // 8 sub-block dots (sub_dots16) times d*sc/4^t and the activation scales, less dmin*m times
  // the exact sums
  template <int M>
  static void dot_i16(const uint8_t* row, int64_t nb, int64_t j, const QuantizedActivations& a, __m256 acc[M]) {
    __m256 d, dmin;
    d_dmin<Q2_K, kD, kDmin>(row, nb, j, d, dmin);
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(field(row, nb, j, kScales)));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    const __m128i sc = _mm_and_si128(s, nibble), m = _mm_and_si128(_mm_srli_epi16(s, 4), nibble);
    const __m256 dq = _mm256_mul_ps(d, k23_fields());
    const __m256 ds[2] = {_mm256_mul_ps(dq, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))),
                          _mm256_mul_ps(dq, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8))))};
    const __m256 ms[2] = {_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))),
                          _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m, 8))))};
    const uint8_t* qs = field(row, nb, j, kQs);
    for (int r = 0; r < M; ++r) {
      const int16_t* x = a.q.data() + r * a.stride + j * kQK;
      for (int h = 0; h < 2; ++h) {
        const __m256i w = load256(qs + 32 * h), w8 = _mm256_srli_epi16(w, 8);
        __m256i v[4];
        for (int t = 0; t < 4; ++t) {
          const __m256i field_t = _mm256_set1_epi16(static_cast<int16_t>(3 << (2 * t)));
          const __m256i* xv = reinterpret_cast<const __m256i*>(x + 128 * h + 32 * t);
          v[t] = dot_acc(_mm256_madd_epi16(_mm256_and_si256(w, field_t), _mm256_loadu_si256(xv)),
                         _mm256_and_si256(w8, field_t), _mm256_loadu_si256(xv + 1));
        }
        const int64_t blocks = r * a.nb + j * 16 + 8 * h;
        const __m256 xscale = _mm256_loadu_ps(a.scale.data() + blocks), xsum = _mm256_loadu_ps(a.sum.data() + blocks);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sub_dots16(v)), _mm256_mul_ps(ds[h], xscale), acc[r]);
        acc[r] = _mm256_fnmadd_ps(ms[h], xsum, acc[r]);
      }
    }
  }
#endif
};

// ---------------------------------------------------------------------------------------------
struct Q3_K : KLayout<kSplitK, 32, 64, 12, 2> {
  static constexpr int64_t kId = 11;
  static constexpr const char* kName = "Q3_K";
  static constexpr int kBlock = kQK;
  static constexpr int kHmask = 0, kQs = 1, kScales = 2, kD = 3;
  using Act = ActI16EvenOdd16;

  // the 16 6-bit scales as 4 little-endian words of bytes (scale + 32): low nibbles from bytes
  // 0..7 (scales 0..7), their high nibbles (8..15); two high bits each from bytes 8..11, bits 2k
  // of byte 8 + s % 4 for scale s = 4k + s % 4
  static void scale_words(const uint8_t* p, uint32_t words[4]) {
    uint32_t a, b, c;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    std::memcpy(&c, p + 8, 4);
    const uint32_t low = 0x0f0f0f0fu, two = 0x03030303u;
    words[0] = (a & low) | ((c & two) << 4);
    words[1] = (b & low) | (((c >> 2) & two) << 4);
    words[2] = ((a >> 4) & low) | (((c >> 4) & two) << 4);
    words[3] = ((b >> 4) & low) | (((c >> 6) & two) << 4);
  }
  static void scales(const uint8_t* p, int8_t out[16]) {
    uint32_t words[4];
    scale_words(p, words);
    uint8_t bytes[16];
    std::memcpy(bytes, words, 16);
    for (int i = 0; i < 16; ++i) out[i] = static_cast<int8_t>(bytes[i] - 32);
  }

  static void dequant_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(field(row, nb, j, kD));
    int8_t sc[16];
    scales(field(row, nb, j, kScales), sc);
    const uint8_t* hmask = field(row, nb, j, kHmask);
    const uint8_t* qs = field(row, nb, j, kQs);
    for (int w = 0; w < kQK; ++w) {
      const int h = w / 128, t = w % 128 / 32, i = w % 32;
      const int q = ((qs[32 * h + i] >> (2 * t)) & 3) - (((hmask[i] >> (w / 32)) & 1) ? 0 : 4);
      out[w] = (d * static_cast<float>(sc[w / 16])) * static_cast<float>(q);
    }
  }

#ifdef TW_AVX2
  static void dequant_avx2(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(field(row, nb, j, kD));
    int8_t sc[16];
    scales(field(row, nb, j, kScales), sc);
    const uint8_t* qs = field(row, nb, j, kQs);
    __m256i hb = load256(field(row, nb, j, kHmask));  // bit g of byte i: weight 32g + i
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int h = 0; h < 2; ++h) {
      __m256i w = load256(qs + 32 * h);
      for (int t = 0; t < 4; ++t, w = _mm256_srli_epi16(w, 2), hb = _mm256_srli_epi16(hb, 1)) {
        const int s = 8 * h + 2 * t;
        const __m256i high = _mm256_and_si256(_mm256_slli_epi16(hb, 2), four);  // 4 * bit
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(w, three), high), four);
        store_scaled_i8(q, _mm256_set1_ps(d * static_cast<float>(sc[s])), _mm256_set1_ps(d * static_cast<float>(sc[s + 1])),
                        out + 128 * h + 32 * t);
      }
    }
  }

  // acc[m] += the super-block's dot with activation row m (int16, ActI16EvenOdd16): the integer
  // dots are of q + 4 in [0, 7] (hmask bit g moved to bit 2t + 2 beside field t), times
  // d*sc/4^t and the activation scales, less 4 d*sc times the exact sums
  template <int M>
  static void dot_i16(const uint8_t* row, int64_t nb, int64_t j, const QuantizedActivations& a, __m256 acc[M]) {
    const __m256 d = _mm256_set1_ps(half_to_float(field(row, nb, j, kD)));
    uint32_t words[4];
    scale_words(field(row, nb, j, kScales), words);
    const __m128i s = _mm_sub_epi8(_mm_setr_epi32(static_cast<int>(words[0]), static_cast<int>(words[1]),
                                                  static_cast<int>(words[2]), static_cast<int>(words[3])),
                                   _mm_set1_epi8(32));
    const __m256 dq = _mm256_mul_ps(d, k23_fields());
    const __m256 ds[2] = {_mm256_mul_ps(dq, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s))),
                          _mm256_mul_ps(dq, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))))};
    const __m256 offset = _mm256_setr_ps(4, 4, 16, 16, 64, 64, 256, 256);  // 4 * 4^t
    const uint8_t* qs = field(row, nb, j, kQs);
    const __m256i hm = load256(field(row, nb, j, kHmask));
    for (int r = 0; r < M; ++r) {
      const int16_t* x = a.q.data() + r * a.stride + j * kQK;
      for (int h = 0; h < 2; ++h) {
        const __m256i w = load256(qs + 32 * h), w8 = _mm256_srli_epi16(w, 8);
        // hmask bit 4h + t of the even byte, 8 + 4h + t of the odd one, moved to bit t + 2: then
        // shifted once more per t, it sits at 2t + 2
        __m256i even = h == 0 ? _mm256_slli_epi16(hm, 2) : _mm256_srli_epi16(hm, 2);
        __m256i odd = h == 0 ? _mm256_srli_epi16(hm, 6) : _mm256_srli_epi16(hm, 10);
        __m256i v[4];
        for (int t = 0; t < 4; ++t) {
          const __m256i field_t = _mm256_set1_epi16(static_cast<int16_t>(3 << (2 * t)));
          const __m256i bit_t = _mm256_set1_epi16(static_cast<int16_t>(4 << (2 * t)));
          const __m256i e = _mm256_or_si256(_mm256_and_si256(w, field_t), _mm256_and_si256(even, bit_t));
          const __m256i o = _mm256_or_si256(_mm256_and_si256(w8, field_t), _mm256_and_si256(odd, bit_t));
          even = _mm256_slli_epi16(even, 1);
          odd = _mm256_slli_epi16(odd, 1);
          const __m256i* xv = reinterpret_cast<const __m256i*>(x + 128 * h + 32 * t);
          v[t] = dot_acc(_mm256_madd_epi16(e, _mm256_loadu_si256(xv)), o, _mm256_loadu_si256(xv + 1));
        }
        const int64_t blocks = r * a.nb + j * 16 + 8 * h;
        const __m256 xscale = _mm256_loadu_ps(a.scale.data() + blocks), xsum = _mm256_loadu_ps(a.sum.data() + blocks);
        const __m256 dot = _mm256_fmsub_ps(_mm256_cvtepi32_ps(sub_dots16(v)), xscale, _mm256_mul_ps(offset, xsum));
        acc[r] = _mm256_fmadd_ps(ds[h], dot, acc[r]);
      }
    }
  }
#endif
};

}  // namespace tw
