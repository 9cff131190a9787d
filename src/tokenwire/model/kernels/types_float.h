// Weight types F16 and BF16: a matrix of 16-bit floats as the file has it (GGUF: a "block" of one
// value in 2 bytes). No integer dot: their row's activation format is none (act = nullptr), so
// qmatmul and the fused decode stack give them fp32 activations; the fp32 matvec converts 8
// weights at a time (F16: vcvtph2ps; BF16: the 16 bits widened and shifted into a float's top
// half) and multiplies with fp32 FMAs. Exact as gguf's dequantiser: both conversions are exact.
// K need not be a multiple of 8 (a tail of single values).
//
// The decode matvec streams at the memory's pace: one thread, M=1, 2048x2048 (in L3) 138 us
// (61 GB/s), 8192x2048 (32 MiB: DRAM) 826 us (41 GB/s); types_q5_iq4.h has the table.
//
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "blocks.h"

namespace tw {

inline float bf16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The traits of a float type: kId, kName, a block of 1 value in 2 bytes, one split part (the
// values), the scalar conversion of value i and the AVX2 one of values i..i+7, and the row
// functions make_own_row takes (no integer dot).
struct F16 : SplitLayout<2> {
  static constexpr int64_t kId = 1;
  static constexpr const char* kName = "F16";
  static constexpr int kBlock = 1;
  static constexpr bool kIntDot = false;
  static void dequant_row(const uint8_t* row, int64_t n, float* out);
  static void matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                           int64_t N);
  static float value(const uint8_t* row, int64_t i) { return half_to_float(row + 2 * i); }
#ifdef TW_AVX2
  static __m256 values8(const uint8_t* row, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  }
#endif
};

struct BF16 : SplitLayout<2> {
  static constexpr int64_t kId = 30;
  static constexpr const char* kName = "BF16";
  static constexpr int kBlock = 1;
  static constexpr bool kIntDot = false;
  static void dequant_row(const uint8_t* row, int64_t n, float* out);
  static void matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                           int64_t N);
  static float value(const uint8_t* row, int64_t i) { return bf16_to_float(row + 2 * i); }
#ifdef TW_AVX2
  static __m256 values8(const uint8_t* row, int64_t i) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
#endif
};

// a row of n values into floats
template <class T>
void float_dequant_row(const uint8_t* row, int64_t n, float* out) {
  int64_t i = 0;
#ifdef TW_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, T::values8(row, i));
#endif
  for (; i < n; ++i) out[i] = T::value(row, i);
}

// out[m, n] = x[m] . W[n] for rows n in [n0, n1), M < 4, fp32 activations: each 8 weights
// converted once for the M rows; several accumulators per activation row (as matmul_small_avx2)
template <class T, int M>
void float_matmul_small_m(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t N) {
  const int64_t row_bytes = 2 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float total[M];
    int64_t k = 0;
#ifdef TW_AVX2
    constexpr int kAcc = M == 1 ? 4 : 2;
    __m256 acc[M][kAcc];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm256_setzero_ps();
    for (; k + 8 * kAcc <= K; k += 8 * kAcc)
      for (int a = 0; a < kAcc; ++a) {
        const __m256 wv = T::values8(row, k + 8 * a);
        for (int m = 0; m < M; ++m) acc[m][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * a), acc[m][a]);
      }
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = T::values8(row, k);
      for (int m = 0; m < M; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      __m256 sum = acc[m][0];
      for (int a = 1; a < kAcc; ++a) sum = _mm256_add_ps(sum, acc[m][a]);
      total[m] = hsum(sum);
    }
#else
    for (int m = 0; m < M; ++m) total[m] = 0;
#endif
    for (; k < K; ++k) {
      const float wk = T::value(row, k);
      for (int m = 0; m < M; ++m) total[m] += wk * x[m * K + k];
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = total[m];
  }
}

template <class T>
void float_matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                        int64_t N) {
  switch (M) {
    case 1: return float_matmul_small_m<T, 1>(x, K, w, n0, n1, out, N);
    case 2: return float_matmul_small_m<T, 2>(x, K, w, n0, n1, out, N);
    default: return float_matmul_small_m<T, 3>(x, K, w, n0, n1, out, N);
  }
}

inline void F16::dequant_row(const uint8_t* row, int64_t n, float* out) { float_dequant_row<F16>(row, n, out); }
inline void BF16::dequant_row(const uint8_t* row, int64_t n, float* out) { float_dequant_row<BF16>(row, n, out); }
inline void F16::matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                              float* out, int64_t N) {
  float_matmul_small<F16>(x, M, K, w, n0, n1, out, N);
}
inline void BF16::matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                               float* out, int64_t N) {
  float_matmul_small<BF16>(x, M, K, w, n0, n1, out, N);
}

}  // namespace tw
