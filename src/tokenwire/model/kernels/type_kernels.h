// The inner loops of a weight type, templated on its traits struct (types_*.h) and instantiated
// once per row of type_table.h: dequantise a row, and out = x W^T for rows [n0, n1) of W with
// fewer than 4 activation rows, from fp32 activations or from int16 ones in the type's format.
// They fit the 32-weight block family (Q4_0, Q4_1, Q8_0: an fp16 scale per block, integer dots
// of 8 blocks at a time); a type of another shape (K-quants' 256-weight super-blocks) brings
// its own functions for its row instead.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "blocks.h"

namespace tw {

template <class T>
void dequant_row_t(const uint8_t* row, int64_t nb, float* out) {
  for (int64_t j = 0; j < nb; ++j) {
#ifdef TW_AVX2
    __m256 w[T::kBlock / 8];
    T::dequant_block_avx2(row, nb, j, w);
    for (int i = 0; i < T::kBlock / 8; ++i) _mm256_storeu_ps(out + j * T::kBlock + 8 * i, w[i]);
#else
    T::dequant_block_scalar(row, nb, j, out + j * T::kBlock);
#endif
  }
}

// out[m, n] = sum_k x[m, k] * W[n, k] for rows n in [n0, n1), M < 4: blocks dequantised in
// registers and shared by the M activation rows. Each activation row keeps several independent
// accumulators: with one, every FMA waits for the previous one's 4-cycle latency (measured
// 0.8 cycles per weight with one accumulator on a Zen 3 core).
#ifdef TW_AVX2
template <class T, int M>
void matmul_small_avx2(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out, int64_t N) {
  constexpr int kAcc = M == 1 ? 4 : 2;  // accumulators per activation row (registers: 16)
  constexpr int kVecs = T::kBlock / 8;
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBlockBytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[M][kAcc];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      __m256 wv[kVecs];
      T::dequant_block_avx2(row, nb, j, wv);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + j * T::kBlock;
        for (int i = 0; i < kVecs; ++i)
          acc[m][i % kAcc] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb + 8 * i), acc[m][i % kAcc]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 total = acc[m][0];
      for (int a = 1; a < kAcc; ++a) total = _mm256_add_ps(total, acc[m][a]);
      out[m * N + n] = hsum(total);
    }
  }
}
#endif

template <class T>
void matmul_small_t(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* out,
                    int64_t N) {
#ifdef TW_AVX2
  switch (M) {
    case 1: return matmul_small_avx2<T, 1>(x, K, w, n0, n1, out, N);
    case 2: return matmul_small_avx2<T, 2>(x, K, w, n0, n1, out, N);
    default: return matmul_small_avx2<T, 3>(x, K, w, n0, n1, out, N);
  }
#else
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBlockBytes;
  float wb[T::kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[3] = {0, 0, 0};
    for (int64_t j = 0; j < nb; ++j) {
      T::dequant_block_scalar(w + n * row_bytes, nb, j, wb);
      for (int64_t m = 0; m < M; ++m)
        for (int i = 0; i < T::kBlock; ++i) acc[m] += wb[i] * x[m * K + j * T::kBlock + i];
    }
    for (int64_t m = 0; m < M; ++m) out[m * N + n] = acc[m];
  }
#endif
}

#ifdef TW_AVX2
// Decode rows (M < 4) from activations in the type's int16 format (T::Act) with integer block
// dots (vpmaddwd: 16 multiply-adds per instruction). The activation rounding error is at most
// 1.5e-5 of the block's largest value; the offset term (Q4_1's minimum, Q4_0's -8d) uses the
// exact fp32 block sums. Per row and activation row: integer block dots, eight blocks at a time
// scaled by d_w * s_x as one vector; the offset times the block's sum beside.
template <class T, int M>
void matmul_small_i16(const QuantizedActivations& a, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                      float* out, int64_t N) {
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBlockBytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    const uint8_t* scales = T::part(row, nb, T::kScalePart);
    const uint8_t* quants = T::part(row, nb, T::kQuantPart);
    __m256 acc[M], extra[M];
    for (int m = 0; m < M; ++m) acc[m] = extra[m] = _mm256_setzero_ps();
    // groups of 8 blocks; the last may be short: its absent lanes get zero dots and scales (the
    // loads past the row's blocks stay inside the row, or the padded activation arrays). Full
    // groups are a separate call with a constant count, so their loop has no lane mask and no
    // per-pair branch.
    auto group = [&](int64_t j, int64_t count) __attribute__((always_inline)) {
      __m256 d = halves8(scales, j);
      __m256 offset = T::offset8(row, nb, j, d);
      if (count < 8) {
        const __m256 present = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        d = _mm256_and_ps(d, present);
        offset = _mm256_and_ps(offset, present);
      }
      for (int m = 0; m < M; ++m) {
        const int64_t r = m * nb + j;
        const __m256i dots = T::dots8(quants, a.q.data() + m * a.stride, j, count);
        const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(a.scale.data() + r));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[m]);
        if (T::kHasOffset) extra[m] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(a.sum.data() + r), extra[m]);
      }
    };
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8) group(j, 8);
    if (j < nb) group(j, nb - j);
    for (int m = 0; m < M; ++m) out[m * N + n] = hsum(acc[m]) + hsum(extra[m]);
  }
}

template <class T>
void matmul_small_i16_t(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0,
                        int64_t n1, float* out, int64_t N) {
  if (M == 1) matmul_small_i16<T, 1>(a, K, w, n0, n1, out, N);
  else if (M == 2) matmul_small_i16<T, 2>(a, K, w, n0, n1, out, N);
  else matmul_small_i16<T, 3>(a, K, w, n0, n1, out, N);
}
#endif

}  // namespace tw
