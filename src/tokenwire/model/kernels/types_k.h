// Weight types Q4_K, Q5_K and Q6_K: 256-weight super-blocks with a scale (Q4_K, Q5_K: and a
// minimum) per sub-block, weighed exactly as gguf's reference dequantiser:
//   Q4_K, Q5_K: fp16 d, dmin; 12 bytes of 6-bit scales sc[8] and minimums m[8]; (Q5_K: 32 bytes
//     qh, bit s of qh[i] the fifth bit of weight i of sub-block s;) 128 bytes qs, whose 32-byte
//     chunk c holds sub-block 2c in its low nibbles and 2c+1 in its high ones. Weight i of
//     sub-block s is (d*sc[s]) * q - dmin*m[s] (d*sc*q is exact in fp32: one rounding).
//   Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 weights), fp16 d. In each half
//     of 128 weights, weight r is the (r / 64)th nibble of ql byte r % 64 with bits 2 (r / 32)
//     and up of qh byte r % 32 above it, minus 32; it weighs (d*scale) * q (exact).
// These types write their own inner loops (type_kernels.h's fit 32-weight blocks) and fill
// their rows with them (make_k_row, type_table.h).
//
// Split-row layout: none (one part, the file's blocks). Splitting a row into its fields (Q4_K:
// d, dmin, scales, qs) lets the 32-weight types convert 8 blocks' scales at once; but a super-
// block's own 8 (Q6_K, Q2_K, Q3_K: 16) sub-block scales already fill a vector, and d and dmin are
// one conversion per 256 weights either way. Measured (decode matvec below, one core, us, split
// -> one part, Q4_0 82.6 -> 80.3 in the same runs): 2048x2048 Q4_K 96.4 -> 92.2, Q5_K 156 ->
// 147, Q6_K 149 -> 139, Q3_K 165 -> 158, Q2_K 113 -> 103; 8192x2048 Q4_K 385 -> 369, Q6_K 581 ->
// 541: one part is no slower (a few % faster: one stream per row, d and dmin in one load).
//
// Decode matvec (M = 1, int16 activations: qmatmul(x, w, type, True)), us per call and weight
// bytes / time; min over 8 rounds of 30 calls, the types interleaved in each round; Zen 5 EPYC,
// 2 cores, shared with other work (types_k23.h has Q2_K, Q3_K from the same runs):
//                 one thread                       two threads
//            2048x2048       8192x2048        2048x2048       8192x2048
//   Q4_0     80.3 29.4 GB/s  308 30.7 GB/s    53.6 44.0 GB/s  186 50.6 GB/s   (the reference)
//   Q4_K     92.2 25.6 GB/s  369 25.6 GB/s    52.6 44.9 GB/s  191 49.5 GB/s
//   Q5_K      147 19.6 GB/s  582 19.8 GB/s    79.8 36.1 GB/s  305 37.8 GB/s
//   Q6_K      139 24.8 GB/s  541 25.4 GB/s    75.2 45.7 GB/s  289 47.7 GB/s
// One core is compute-bound, as Q4_0 is (Q8_0 streams 48 GB/s on one): int16 activations take
// 16 vpmaddwd per 256 weights whatever the type, plus the unpacking; a super-block's scales and
// reductions cost Q4_K ~15% over Q4_0, Q5_K's fifth bit three operations per 16 weights.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include <type_traits>

#include "blocks.h"

namespace tw {

constexpr int kQK = 256;  // weights per super-block

// A K-type's fields (bytes of each, in GGUF's order) and where a row keeps them: split into
// parts (SplitLayout: each field of all nb blocks together) or as the file's array of blocks.
template <bool kSplit, int... Fields>
struct KLayout : std::conditional_t<kSplit, SplitLayout<Fields...>, SplitLayout<(Fields + ...)>> {
  static constexpr int kFieldBytes[] = {Fields...};
  static constexpr int64_t field_offset(int f) {
    int64_t offset = 0;
    for (int i = 0; i < f; ++i) offset += kFieldBytes[i];
    return offset;
  }
  // field f of super-block j of a row of nb
  static const uint8_t* field(const uint8_t* row, int64_t nb, int64_t j, int f) {
    if constexpr (kSplit) return row + nb * field_offset(f) + j * kFieldBytes[f];
    else return row + j * (Fields + ...) + field_offset(f);
  }
};
constexpr bool kSplitK = false;  // see the header comment

// ---------------------------------------------------------------------------------------------
// Activation formats. The integer dots widen quant bytes to int16 as types_q4.h's do: a 32-byte
// chunk is read as 16 words, and vector k (0..3) of a chunk holds nibble k of every word: k = 0
// and 2 the low nibbles of its even and odd bytes, 1 and 3 the high ones. Values land in slots
// [k][word] of the chunk's 64 (a word v is the weights 2v, 2v + 1 of a 32-weight block, so a
// block's value i sits at (i % 2) * 32 + i / 2 from the block's first slot). One int16 scale
// (and exact fp32 sum) per 32 activation values, as the 32-weight types take.
constexpr int64_t k_slot(int64_t i) { return (i % 2) * 32 + i / 2; }

// Q4_K, Q5_K: chunk c of a super-block holds blocks 2c (low nibbles) and 2c + 1 (high ones)
struct ActI16KPairs {
  static constexpr const char* kName = "i16_k_pairs";
  static constexpr int kBlock = 32;
  static int64_t stride(int64_t K) { return K; }
  static int64_t base(int64_t j) { return j / 2 * 64 + (j % 2) * 16; }
  static constexpr int64_t slot(int64_t i) { return k_slot(i); }
};

// Q6_K: in each 128 weights, chunk c (c = 0, 1) holds 32-weight blocks c (low nibbles) and
// c + 2 (high ones). One scale and sum per 16 values, Q6_K's sub-blocks: the -32 of every weight
// then goes with the exact sums (one FMA per 8 sub-blocks instead of a subtraction per 16
// weights) and the 16 values' rounding is to their own maximum.
struct ActI16KQuads {
  static constexpr const char* kName = "i16_k_quads";
  static constexpr int kBlock = 16;
  static int64_t stride(int64_t K) { return K; }
  static int64_t base(int64_t j) {  // half j % 2 of 32-value block b = j / 2 % 4 of a group of 8
    const int64_t b = j / 2 % 4;
    return j / 8 * 128 + (b % 2) * 64 + (b / 2) * 16 + (j % 2) * 8;
  }
  static constexpr int64_t slot(int64_t i) { return k_slot(i); }
};

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums: sc[0..3] and m[0..3] are the low 6
// bits of bytes 0..3 and 4..7; sc[4..7] the low nibbles of bytes 8..11 with the top 2 bits of
// bytes 0..3 above, m[4..7] their high nibbles with the top bits of bytes 4..7. Bytes out.
inline void k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t m[8]) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t sc_lo = a & 0x3f3f3f3fu, m_lo = b & 0x3f3f3f3fu;
  const uint32_t sc_hi = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
  const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(m, &m_lo, 4);
  std::memcpy(m + 4, &m_hi, 4);
}

#ifdef TW_AVX2
inline __m256 bytes8_to_floats(const uint8_t* p) {  // 8 unsigned bytes as 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Four 32-weight blocks' integer dots (8 lanes each, the first 16 weights in lanes 0-3) -> the
// sums of their eight 16-weight halves, in order (two rounds of hadd leave [0 2 4 6 | 1 3 5 7]:
// one permute, rather than one on each of the scales, activation scales and sums)
inline __m256i sub_dots16(const __m256i v[4]) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 int8 weights (one vector) -> 4 vectors of 8 floats times their scale, stored
inline void store_scaled_i8(__m256i q, __m256 lo_scale, __m256 hi_scale, float* out) {
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  _mm256_storeu_ps(out, _mm256_mul_ps(lo_scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a))));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(lo_scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)))));
  _mm256_storeu_ps(out + 16, _mm256_mul_ps(hi_scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
  _mm256_storeu_ps(out + 24, _mm256_mul_ps(hi_scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))));
}

// 32 unsigned bytes (one vector) -> d * q - m for 32 weights, stored (d_lo, m_lo for the first
// 16, d_hi, m_hi for the rest); d * q is exact, so the fused form rounds once, as gguf's d * q - m
inline void store_affine_u8(__m256i q, __m256 d_lo, __m256 neg_m_lo, __m256 d_hi, __m256 neg_m_hi, float* out) {
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
  for (int i = 0; i < 4; ++i) {
    const __m256 d = i < 2 ? d_lo : d_hi, neg_m = i < 2 ? neg_m_lo : neg_m_hi;
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), neg_m));
  }
}

// a K type's fp16 d and dmin (fields kD, kDmin of layout L), broadcast: the file's blocks keep
// them side by side, one conversion
template <class L, int kD, int kDmin>
inline void d_dmin(const uint8_t* row, int64_t nb, int64_t j, __m256& d, __m256& dmin) {
  if constexpr (kSplitK) {
    d = _mm256_set1_ps(half_to_float(L::field(row, nb, j, kD)));
    dmin = _mm256_set1_ps(half_to_float(L::field(row, nb, j, kDmin)));
  } else {
    static_assert(L::field_offset(kDmin) == L::field_offset(kD) + 2, "dmin follows d");
    uint32_t pair;
    std::memcpy(&pair, L::field(row, nb, j, kD), 4);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)));
    d = _mm256_broadcastss_ps(both);
    dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Q4_K and Q5_K (kHighBits): the same header and nibbles, Q5_K with a fifth bit per weight.
template <bool kHighBits>
struct K45Traits;

template <>
struct K45Traits<false> : KLayout<kSplitK, 2, 2, 12, 128> {
  static constexpr int64_t kId = 12;
  static constexpr const char* kName = "Q4_K";
  static constexpr int kD = 0, kDmin = 1, kScales = 2, kQs = 3, kQh = -1;
};

template <>
struct K45Traits<true> : KLayout<kSplitK, 2, 2, 12, 32, 128> {
  static constexpr int64_t kId = 13;
  static constexpr const char* kName = "Q5_K";
  static constexpr int kD = 0, kDmin = 1, kScales = 2, kQh = 3, kQs = 4;
};

template <bool kHighBits>
struct K45 : K45Traits<kHighBits> {
  using B = K45Traits<kHighBits>;
  using Act = ActI16KPairs;
  static constexpr int kBlock = kQK;

  static void dequant_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(B::field(row, nb, j, B::kD)), dmin = half_to_float(B::field(row, nb, j, B::kDmin));
    uint8_t sc[8], m[8];
    k4_scales(B::field(row, nb, j, B::kScales), sc, m);
    const uint8_t* qs = B::field(row, nb, j, B::kQs);
    for (int s = 0; s < 8; ++s) {
      const float ds = d * static_cast<float>(sc[s]), ms = dmin * static_cast<float>(m[s]);
      for (int i = 0; i < 32; ++i) {
        int q = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0f;
        if constexpr (kHighBits) q |= ((B::field(row, nb, j, B::kQh)[i] >> s) & 1) << 4;
        out[32 * s + i] = ds * static_cast<float>(q) - ms;
      }
    }
  }

#ifdef TW_AVX2
  static void dequant_avx2(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const __m256 d = _mm256_set1_ps(half_to_float(B::field(row, nb, j, B::kD)));
    const __m256 dmin = _mm256_set1_ps(half_to_float(B::field(row, nb, j, B::kDmin)));
    uint8_t sc[8], m[8];
    k4_scales(B::field(row, nb, j, B::kScales), sc, m);
    alignas(32) float ds[8], ms[8];
    _mm256_store_ps(ds, _mm256_mul_ps(d, bytes8_to_floats(sc)));
    _mm256_store_ps(ms, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, bytes8_to_floats(m))));
    const uint8_t* qs = B::field(row, nb, j, B::kQs);
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i hb = _mm256_setzero_si256();
    if constexpr (kHighBits) hb = load256(B::field(row, nb, j, B::kQh));
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      if constexpr (kHighBits) {  // bits 2c and 2c + 1 of each qh byte, to bit 4
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
        hb = _mm256_srli_epi16(hb, 2);
      }
      const __m256 d_a = _mm256_set1_ps(ds[2 * c]), m_a = _mm256_set1_ps(ms[2 * c]);
      const __m256 d_b = _mm256_set1_ps(ds[2 * c + 1]), m_b = _mm256_set1_ps(ms[2 * c + 1]);
      store_affine_u8(lo, d_a, m_a, d_a, m_a, out + 64 * c);
      store_affine_u8(hi, d_b, m_b, d_b, m_b, out + 64 * c + 32);
    }
  }

  // acc[m] += the super-block's dot with activation row m (int16, ActI16KPairs): per sub-block
  // an integer dot times d*sc[s] * (the block's activation scale), less dmin*m[s] times the
  // block's exact fp32 sum
  template <int M>
  static void dot_i16(const uint8_t* row, int64_t nb, int64_t j, const QuantizedActivations& a, __m256 acc[M]) {
    __m256 d, dmin;
    d_dmin<B, B::kD, B::kDmin>(row, nb, j, d, dmin);
    uint8_t sc[8], m[8];
    k4_scales(B::field(row, nb, j, B::kScales), sc, m);
    // B, the high nibbles, are masked in place (16 q, no shift): ds's odd lanes carry the 1/16
    const __m256 ds = _mm256_mul_ps(_mm256_mul_ps(d, bytes8_to_floats(sc)),
                                    _mm256_setr_ps(1, 0.0625f, 1, 0.0625f, 1, 0.0625f, 1, 0.0625f));
    const __m256 ms = _mm256_mul_ps(dmin, bytes8_to_floats(m));
    const uint8_t* qs = B::field(row, nb, j, B::kQs);
    const uint8_t* qh = nullptr;
    if constexpr (kHighBits) qh = B::field(row, nb, j, B::kQh);
    const __m256i low = _mm256_set1_epi16(0x0f), high = _mm256_set1_epi16(0xf0);
    for (int r = 0; r < M; ++r) {
      const int16_t* x = a.q.data() + r * a.stride + j * kQK;
      __m256i hb = _mm256_setzero_si256();
      if constexpr (kHighBits) hb = load256(qh);
      __m256i h[4];  // chunk c's A and B lanes, pairwise summed
      for (int c = 0; c < 4; ++c) {
        const __m256i w = load256(qs + 32 * c), w8 = _mm256_srli_epi16(w, 8);
        __m256i k0 = _mm256_and_si256(w, low), k1 = _mm256_and_si256(w, high);
        __m256i k2 = _mm256_and_si256(w8, low), k3 = _mm256_and_si256(w8, high);
        if constexpr (kHighBits) {  // word v: bits 2c, 2c + 1 (even byte), 2c + 8, 2c + 9 (odd byte)
          const __m256i bit4 = _mm256_set1_epi16(0x10), bit8 = _mm256_set1_epi16(0x100);
          k0 = _mm256_or_si256(k0, _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
          k1 = _mm256_or_si256(k1, _mm256_and_si256(_mm256_slli_epi16(hb, 7), bit8));
          k2 = _mm256_or_si256(k2, _mm256_and_si256(_mm256_srli_epi16(hb, 4), bit4));
          k3 = _mm256_or_si256(k3, _mm256_and_si256(_mm256_srli_epi16(hb, 1), bit8));
          hb = _mm256_srli_epi16(hb, 2);
        }
        const __m256i* xv = reinterpret_cast<const __m256i*>(x + 64 * c);
        h[c] = _mm256_hadd_epi32(dot_acc(_mm256_madd_epi16(k0, _mm256_loadu_si256(xv)), k2, _mm256_loadu_si256(xv + 2)),
                                 dot_acc(_mm256_madd_epi16(k1, _mm256_loadu_si256(xv + 1)), k3, _mm256_loadu_si256(xv + 3)));
      }
      // [A0 B0 A1 B1 | the same] halves of the sub-block dots, then the two halves summed
      const __m256i h01 = _mm256_hadd_epi32(h[0], h[1]), h23 = _mm256_hadd_epi32(h[2], h[3]);
      const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h01, h23, 0x20),
                                            _mm256_permute2x128_si256(h01, h23, 0x31));
      const int64_t blocks = r * a.nb + j * 8;
      const __m256 dots = _mm256_cvtepi32_ps(sums);
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(ds, _mm256_loadu_ps(a.scale.data() + blocks)), acc[r]);
      acc[r] = _mm256_fnmadd_ps(ms, _mm256_loadu_ps(a.sum.data() + blocks), acc[r]);
    }
  }
#endif
};
using Q4_K = K45<false>;
using Q5_K = K45<true>;

// ---------------------------------------------------------------------------------------------
struct Q6_K : KLayout<kSplitK, 128, 64, 16, 2> {
  static constexpr int64_t kId = 14;
  static constexpr const char* kName = "Q6_K";
  static constexpr int kBlock = kQK;
  static constexpr int kQl = 0, kQh = 1, kScales = 2, kD = 3;
  using Act = ActI16KQuads;

  static void dequant_scalar(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(field(row, nb, j, kD));
    const int8_t* scales = reinterpret_cast<const int8_t*>(field(row, nb, j, kScales));
    const uint8_t* ql = field(row, nb, j, kQl);
    const uint8_t* qh = field(row, nb, j, kQh);
    for (int w = 0; w < kQK; ++w) {
      const int h = w / 128, r = w % 128;
      const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
      const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      out[w] = (d * static_cast<float>(scales[w / 16])) * static_cast<float>((low | high << 4) - 32);
    }
  }

#ifdef TW_AVX2
  static void dequant_avx2(const uint8_t* row, int64_t nb, int64_t j, float* out) {
    const float d = half_to_float(field(row, nb, j, kD));
    const int8_t* scales = reinterpret_cast<const int8_t*>(field(row, nb, j, kScales));
    const uint8_t* ql = field(row, nb, j, kQl);
    const uint8_t* qh = field(row, nb, j, kQh);
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load256(ql + 64 * h), l1 = load256(ql + 64 * h + 32), hb = load256(qh + 32 * h);
      const __m256i q[4] = {  // weights 32t.. of this half: nibble t / 2 of ql's t % 2 chunk, qh bits 2t
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two)),
          _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(hb, 2), two))};
      for (int t = 0; t < 4; ++t) {
        const int s = 8 * h + 2 * t;  // the first of the 32 weights' two 16-weight sub-blocks
        store_scaled_i8(_mm256_sub_epi8(q[t], offset), _mm256_set1_ps(d * static_cast<float>(scales[s])),
                        _mm256_set1_ps(d * static_cast<float>(scales[s + 1])), out + 128 * h + 32 * t);
      }
    }
  }

  // acc[m] += the super-block's dot with activation row m (int16, ActI16KQuads, 16 values a
  // block). A 32-weight block's integer dot leaves its first 16 weights in lanes 0-3, its second
  // 16 in lanes 4-7; two rounds of hadd over 4 blocks give the 8 sub-block dots, of q in [0, 63]:
  // each times d*scale and the sub-block's activation scale, less 32 d*scale times its sum.
  template <int M>
  static void dot_i16(const uint8_t* row, int64_t nb, int64_t j, const QuantizedActivations& a, __m256 acc[M]) {
    const __m256 d = _mm256_set1_ps(half_to_float(field(row, nb, j, kD)));
    const uint8_t* ql = field(row, nb, j, kQl);
    const uint8_t* qh = field(row, nb, j, kQh);
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(field(row, nb, j, kScales)));
    // blocks c + 2 (the high nibbles) are masked in place, 16 q: their lanes carry the 1/16
    const __m256 dq = _mm256_mul_ps(d, _mm256_setr_ps(1, 1, 1, 1, 0.0625f, 0.0625f, 0.0625f, 0.0625f));
    const __m256 ds[2] = {_mm256_mul_ps(dq, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s))),
                          _mm256_mul_ps(dq, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))))};
    const __m256i low = _mm256_set1_epi16(0x0f), high = _mm256_set1_epi16(0xf0);
    const __m256i bits45 = _mm256_set1_epi16(0x30), bits89 = _mm256_set1_epi16(0x300);
    for (int r = 0; r < M; ++r) {
      const int16_t* x = a.q.data() + r * a.stride + j * kQK;
      for (int h = 0; h < 2; ++h) {
        __m256i hb = load256(qh + 32 * h), v[4];
        for (int c = 0; c < 2; ++c) {  // 32-weight blocks c and c + 2 of the half
          // word v's qh bits 2c.. (even byte) and 2c + 8.. (odd byte) go to block c's bits 4-5;
          // 2c + 4.. and 2c + 12.. to block c + 2's bits 8-9 (16 q): one shift left, one right
          const __m256i w = load256(ql + 64 * h + 32 * c), w8 = _mm256_srli_epi16(w, 8);
          const __m256i left = _mm256_slli_epi16(hb, 4), right = _mm256_srli_epi16(hb, 4);
          const __m256i k0 = _mm256_or_si256(_mm256_and_si256(w, low), _mm256_and_si256(left, bits45));
          const __m256i k1 = _mm256_or_si256(_mm256_and_si256(w, high), _mm256_and_si256(left, bits89));
          const __m256i k2 = _mm256_or_si256(_mm256_and_si256(w8, low), _mm256_and_si256(right, bits45));
          const __m256i k3 = _mm256_or_si256(_mm256_and_si256(w8, high), _mm256_and_si256(right, bits89));
          hb = _mm256_srli_epi16(hb, 2);
          const __m256i* xv = reinterpret_cast<const __m256i*>(x + 128 * h + 64 * c);
          v[c] = dot_acc(_mm256_madd_epi16(k0, _mm256_loadu_si256(xv)), k2, _mm256_loadu_si256(xv + 2));
          v[c + 2] = dot_acc(_mm256_madd_epi16(k1, _mm256_loadu_si256(xv + 1)), k3, _mm256_loadu_si256(xv + 3));
        }
        const __m256i sub = sub_dots16(v);
        const int64_t blocks = r * a.nb + j * 16 + 8 * h;
        const __m256 xscale = _mm256_loadu_ps(a.scale.data() + blocks), xsum = _mm256_loadu_ps(a.sum.data() + blocks);
        // ds * (dot * xscale - 32 * xsum), where blocks c + 2's dots are of 16 q: 512 * xsum
        const __m256 offset = _mm256_mul_ps(_mm256_setr_ps(32, 32, 32, 32, 512, 512, 512, 512), xsum);
        acc[r] = _mm256_fmadd_ps(ds[h], _mm256_fmsub_ps(_mm256_cvtepi32_ps(sub), xscale, offset), acc[r]);
      }
    }
  }
#endif
};

// ---------------------------------------------------------------------------------------------
// The row functions of a super-block type T (T::dequant_scalar / dequant_avx2 of super-block j
// into 256 floats, T::dot_i16<M>): filled into its TypeRow by make_own_row (type_table.h).
template <class T>
inline void k_dequant(const uint8_t* row, int64_t nb, int64_t j, float* out) {
#ifdef TW_AVX2
  T::dequant_avx2(row, nb, j, out);
#else
  T::dequant_scalar(row, nb, j, out);
#endif
}

template <class T>
void k_dequant_row(const uint8_t* row, int64_t nb, float* out) {
  for (int64_t j = 0; j < nb; ++j) k_dequant<T>(row, nb, j, out + j * kQK);
}

// fp32 activations, M < 4: each super-block dequantised into an L1 buffer (as dequant_row does)
// and shared by the M rows, each with four accumulators (type_kernels.h says why)
template <class T, int M>
void k_matmul_small_m(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t N) {
  const int64_t nb = K / kQK, row_bytes = nb * T::kBlockBytes;
  alignas(32) float wb[kQK];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
#ifdef TW_AVX2
    __m256 acc[M][4];
    for (auto& accs : acc)
      for (auto& v : accs) v = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      k_dequant<T>(row, nb, j, wb);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + j * kQK;
        for (int i = 0; i < kQK / 8; ++i)
          acc[m][i % 4] = _mm256_fmadd_ps(_mm256_load_ps(wb + 8 * i), _mm256_loadu_ps(xb + 8 * i), acc[m][i % 4]);
      }
    }
    for (int m = 0; m < M; ++m)
      out[m * N + n] = hsum(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
#else
    float acc[M] = {};
    for (int64_t j = 0; j < nb; ++j) {
      k_dequant<T>(row, nb, j, wb);
      for (int m = 0; m < M; ++m)
        for (int i = 0; i < kQK; ++i) acc[m] += wb[i] * x[m * K + j * kQK + i];
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = acc[m];
#endif
  }
}

template <class T>
void k_matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                    int64_t N) {
  if (M == 1) k_matmul_small_m<T, 1>(x, K, w, n0, n1, out, N);
  else if (M == 2) k_matmul_small_m<T, 2>(x, K, w, n0, n1, out, N);
  else k_matmul_small_m<T, 3>(x, K, w, n0, n1, out, N);
}

#ifdef TW_AVX2
template <class T, int M>
void k_matmul_i16_m(const QuantizedActivations& a, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                    int64_t N) {
  const int64_t nb = K / kQK, row_bytes = nb * T::kBlockBytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[M];
    for (auto& v : acc) v = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) T::template dot_i16<M>(row, nb, j, a, acc);
    for (int m = 0; m < M; ++m) out[m * N + n] = hsum(acc[m]);
  }
}

template <class T>
void k_matmul_i16(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                  float* out, int64_t N) {
  if (M == 1) k_matmul_i16_m<T, 1>(a, K, w, n0, n1, out, N);
  else if (M == 2) k_matmul_i16_m<T, 2>(a, K, w, n0, n1, out, N);
  else k_matmul_i16_m<T, 3>(a, K, w, n0, n1, out, N);
}
#endif

}  // namespace tw
