// The matvec / small-matrix drivers: int16-activation decode rows, fp32 rows, and the
// register-tiled kernel for four rows or more. They reach a weight type only through its row of
// type_table.h (its block size, its dequantiser, its inner loops), never by name.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp.
#pragma once

#include "type_table.h"

namespace tw {

// The integer kernels need AVX2; without it the int16 rows fall back to the fp32 path.
#ifdef TW_AVX2
constexpr bool kInt16Rows = true;
#else
constexpr bool kInt16Rows = false;
#endif

// M >= 4: kRows weight rows dequantised into an L1 buffer, then a kRows x 4 register tile of
// (weight row, activation row) dot products: 12 accumulators, 7 loads per 12 FMAs, so the
// FMA units rather than L2 reads of the activations set the pace.
constexpr int64_t kRows = 3;

// The integer path for many activation rows: groups of kGroupRows (the most a type's integer
// loop takes at once) over chunks of kChunkRows weight rows.
constexpr int64_t kGroupRows = 3;
constexpr int64_t kChunkRows = 64;

void matmul_tiled(const float* x, int64_t M, int64_t K, const uint8_t* w, const TypeRow& type, int64_t n0,
                  int64_t n1, float* out, int64_t N) {
  const int64_t nb = K / type.block, row_bytes = nb * type.block_bytes;
  std::vector<float> buf(kRows * K);
  for (int64_t n = n0; n < n1; n += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, n1 - n);
    for (int64_t r = 0; r < rows; ++r) type.dequant_row(w + (n + r) * row_bytes, nb, buf.data() + r * K);
    // a short last group repeats its first row (computed, not stored)
    const float* w0 = buf.data();
    const float* w1 = rows > 1 ? buf.data() + K : w0;
    const float* w2 = rows > 2 ? buf.data() + 2 * K : w0;
    int64_t m = 0;
#ifdef TW_AVX2
    for (; m + 4 <= M; m += 4) {
      __m256 acc[3][4];
      for (auto& row : acc)
        for (auto& a : row) a = _mm256_setzero_ps();
      const float* x0 = x + m * K;
      for (int64_t k = 0; k + 8 <= K; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k), v2 = _mm256_loadu_ps(w2 + k);
        for (int i = 0; i < 4; ++i) {
          const __m256 xv = _mm256_loadu_ps(x0 + i * K + k);
          acc[0][i] = _mm256_fmadd_ps(v0, xv, acc[0][i]);
          acc[1][i] = _mm256_fmadd_ps(v1, xv, acc[1][i]);
          acc[2][i] = _mm256_fmadd_ps(v2, xv, acc[2][i]);
        }
      }
      // reduce with constant indices first: a runtime index into acc would keep the
      // accumulators in memory, one store each per FMA (measured 9 of 32 flops per cycle)
      float sums[3][4];
      for (int r = 0; r < 3; ++r)
        for (int i = 0; i < 4; ++i) sums[r][i] = hsum(acc[r][i]);
      for (int64_t k = K - K % 8; k < K; ++k)  // the tail where K is not a multiple of 8 (float types' block is 1)
        for (int i = 0; i < 4; ++i) {
          sums[0][i] += w0[k] * x0[i * K + k];
          sums[1][i] += w1[k] * x0[i * K + k];
          sums[2][i] += w2[k] * x0[i * K + k];
        }
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < 4; ++i) out[(m + i) * N + n + r] = sums[r][i];
    }
#endif
    for (; m < M; ++m) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* wr = buf.data() + r * K;
        out[m * N + n + r] = dot(wr, x + m * K, K);
      }
    }
  }
}

// rows [n0, n1) of out [M, N] = x W^T: int16 activations when `qa` is given (M < 4; in the
// format of qtype's row), else fp32. `ldo`: out's row stride when W is a row range of a wider
// output (a projection stacked from weights of several types, decode_stack.h); else N.
void matvec_rows(const float* x, const QuantizedActivations* qa, int64_t M, int64_t K, const at::Tensor& w,
                 int64_t qtype, int64_t n0, int64_t n1, float* out, int64_t ldo = -1) {
  const int64_t N = ldo < 0 ? w.size(0) : ldo;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (n0 >= n1) return;
  const TypeRow& type = type_row(qtype);
  if (qa != nullptr) {
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY(qa->format == type.act);  // callers quantise for this row
    if (type.tiled) return type.tiled(*qa, M, K, wp, n0, n1, out, N, is_laid(type, w.size(0), K));
    if (M <= kGroupRows) return type.matmul_small_i16(*qa, M, K, wp, n0, n1, out, N);
    // More rows: groups of kGroupRows activation rows over chunks of kChunkRows weight rows
    // (kept in L2 while every group passes). A type's integer loop sums each (weight row,
    // activation row) in an order that does not depend on how many activation rows it is
    // given, so every row of a batch or a prefill chunk comes out bit for bit as alone.
    thread_local std::vector<QuantizedActivations> groups;
    const int64_t G = (M + kGroupRows - 1) / kGroupRows;
    groups.resize(G);
    for (int64_t g = 0; g < G; ++g) groups[g].copy_rows(*qa, g * kGroupRows, std::min(kGroupRows, M - g * kGroupRows));
    for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
      const int64_t c1 = std::min(n1, c0 + kChunkRows);
      for (int64_t g = 0; g < G; ++g)
        type.matmul_small_i16(groups[g], std::min(kGroupRows, M - g * kGroupRows), K, wp, c0, c1, out + g * kGroupRows * N, N);
    }
    return;
  }
  // fp32 activations (integer ones switched off): laid-out rows are read back as split rows
  thread_local std::vector<uint8_t> scratch;
  const uint8_t* rows = split_rows_of(wp, type, w.size(0), K, n0, n1, scratch);
  if (M < 4) type.matmul_small(x, M, K, rows, 0, n1 - n0, out + n0, N);
  else matmul_tiled(x, M, K, rows, type, 0, n1 - n0, out + n0, N);
}

}  // namespace tw
