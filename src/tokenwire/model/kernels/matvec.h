// Quantised matrix-vector and small matrix products: int16-activation decode rows, fp32 rows,
// and the register-tiled kernel for four rows or more.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp.
#pragma once

#include "blocks.h"

namespace tw {

// out[m, n] = sum_k x[m, k] * W[n, k] for rows n in [n0, n1), M < 4: blocks dequantised in
// registers and shared by the M activation rows. Each activation row keeps several independent
// accumulators: with one, every FMA waits for the previous one's 4-cycle latency (measured
// 0.8 cycles per weight with one accumulator on a Zen 3 core).
#ifdef TW_AVX2
template <int M>
void matmul_small_avx2(const float* x, int64_t K, const uint8_t* w, int64_t qtype, int64_t n0, int64_t n1,
                       float* out, int64_t N) {
  constexpr int kAcc = M == 1 ? 4 : 2;  // accumulators per activation row (registers: 16)
  const int64_t nb = K / kBlock, bb = block_bytes(qtype), row_bytes = nb * bb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[M][kAcc];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      __m256 wv[4];
      dequant_block_avx2(block_at(row, qtype, nb, j), qtype, wv);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + j * kBlock;
        for (int i = 0; i < 4; ++i)
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

// Decode rows (M < 4) with activations as int16 per 32-value block (scale = max|x| / 32767,
// round to nearest) and integer block dots (vpmaddwd: 16 multiply-adds per instruction). The
// activation rounding error is at most 1.5e-5 of the block's largest value; the minimum (Q4_1)
// and offset (Q4_0) terms use the exact fp32 block sums.
//
// The weights are widened to int16 with shifts and masks on whole 16-bit words, not with
// vpmovzxbw (a shuffle per 16 weights, one shuffle port on Zen 3): for Q4 a word of two quant
// bytes yields its four nibbles as four vectors, for Q8_0 a word its two bytes as two. The
// activations are stored in the matching order once per matvec (q4_slot, q8_slot), so the
// weights stay as the file has them. The integer dots are the same, so results are too (bit for
// bit on whole groups of 8 blocks). Measured on one core, SmolLM2's shapes (us, before -> after):
// gate/up 3072x576 160 -> 133, down 576x1536 73 -> 51, qkv 960x576 57 -> 49.
// A Q4 block pair (32 quant bytes = 16 words) is read as four vectors of 16 nibbles: vector k
// holds nibble k of each word. Word v of a block (v < 8) is quant bytes 2v, 2v+1, whose
// nibbles are weights 2v, 2v+16, 2v+1, 2v+17. Activations of a pair take 64 int16 slots
// [k][word]; a trailing single block takes the first 8 words of each k.
inline int64_t q4_slot(int64_t i) {  // i: index within a block pair (0..63)
  const int64_t block = i / 32, b = i % 32;
  const int64_t byte = b % 16, high = b / 16;         // nibble of quant byte `byte`
  const int64_t word = block * 8 + byte / 2;           // 16-bit word within the pair
  const int64_t k = (byte % 2) * 2 + high;             // nibble of that word
  return k * 16 + word;
}

// A Q8_0 block (32 bytes = 16 words): even bytes then odd bytes.
inline int64_t q8_slot(int64_t b) { return (b % 2) * 16 + b / 2; }

struct QuantizedActivations {
  std::vector<int16_t> q;    // [M, stride], in each qtype's slot order
  std::vector<float> scale;  // [M, nb]
  std::vector<float> sum;    // [M, nb], fp32 sums of the original values
  int64_t stride = 0, nb = 0, qtype = 0;

  // sized for M rows of K features in qtype's slot order (buffers kept between calls)
  void reset(int64_t M, int64_t K, int64_t type) {
    qtype = type;
    nb = K / kBlock;
    stride = type == kQ8_0 ? K : (nb + 1) / 2 * 64;
    q.resize(M * stride);
    scale.resize(M * nb + 8);  // + 8: a row's last group of blocks loads 8 lanes
    sum.resize(M * nb + 8);
  }

  // block j of row m from its 32 fp32 values
  void quantize_block(const float* xb, int64_t m, int64_t j) {
    float mx = 0, total = 0;
    for (int i = 0; i < kBlock; ++i) {
      mx = std::max(mx, std::fabs(xb[i]));
      total += xb[i];
    }
    const float inv = mx > 0 ? 32767.0f / mx : 0.0f;
    int16_t* dst = q.data() + m * stride;
    for (int i = 0; i < kBlock; ++i) {
      const int16_t v = static_cast<int16_t>(std::nearbyint(xb[i] * inv));
      if (qtype == kQ8_0) dst[j * kBlock + q8_slot(i)] = v;
      else dst[j / 2 * 64 + q4_slot((j % 2) * kBlock + i)] = v;
    }
    scale[m * nb + j] = mx / 32767.0f;
    sum[m * nb + j] = total;
  }

  // all of x [M, K] (contiguous)
  void quantize(const float* x, int64_t M, int64_t K, int64_t type) {
    reset(M, K, type);
    for (int64_t r = 0; r < M * nb; ++r) quantize_block(x + r * kBlock, r / nb, r % nb);
  }
};

// The integer kernels below need AVX2; without it the int16 rows fall back to the fp32 path.
#ifdef TW_AVX2
constexpr bool kInt16Rows = true;
#else
constexpr bool kInt16Rows = false;
#endif

#ifdef TW_AVX2
// integer dots of a Q4 block pair: 8 int32 lanes, lanes 0-3 summing to the first block's dot,
// 4-7 to the second's
inline __m256i pair_dot_q4(const uint8_t* q, const int16_t* x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i low = _mm256_set1_epi16(0x0f);
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  __m256i s = _mm256_madd_epi16(_mm256_and_si256(w, low), _mm256_loadu_si256(xv));
  s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), _mm256_loadu_si256(xv + 1)));
  s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 8), low), _mm256_loadu_si256(xv + 2)));
  return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_srli_epi16(w, 12), _mm256_loadu_si256(xv + 3)));
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

// integer dot of a Q8_0 block as 8 int32 lanes: sign-extended even and odd bytes of each word
inline __m256i block_dot_q8(const uint8_t* q, const int16_t* x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), odd = _mm256_srai_epi16(w, 8);
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  return _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256(xv)), _mm256_madd_epi16(odd, _mm256_loadu_si256(xv + 1)));
}

// eight blocks' lane vectors -> one vector of their eight sums (block t in lane t)
inline __m256i sum_lanes8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// the integer dots of blocks j..j+count-1 of a row (count <= 8), block t in lane t, the rest 0
template <int64_t QT>
inline __m256i dots8(const uint8_t* quants, const int16_t* x, int64_t j, int64_t count) {
  if (QT == kQ8_0) {
    __m256i v[8];
    for (int t = 0; t < 8; ++t)
      v[t] = t < count ? block_dot_q8(quants + (j + t) * 32, x + (j + t) * kBlock) : _mm256_setzero_si256();
    return sum_lanes8(v);
  }
  // four pairs (j is even); the hadds leave blocks in lanes [0 2 4 6 | 1 3 5 7]
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

// Per row and activation row: integer block dots, eight blocks at a time scaled by d_w * s_x as
// one vector; the minimum (Q4_1) or offset (Q4_0: -8 d) times the block's exact fp32 sum beside.
template <int M, int64_t QT>
void matmul_small_i16(const QuantizedActivations& a, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                      float* out, int64_t N) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(QT);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    const uint8_t* quants = row_quants(row, QT, nb);
    __m256 acc[M], extra[M];
    for (int m = 0; m < M; ++m) acc[m] = extra[m] = _mm256_setzero_ps();
    // groups of 8 blocks; the last may be short: its absent lanes get zero dots and scales (the
    // loads past the row's blocks stay inside the row, or the padded activation arrays). Full
    // groups are a separate call with a constant count, so their loop has no lane mask and no
    // per-pair branch.
    auto group = [&](int64_t j, int64_t count) __attribute__((always_inline)) {
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * j)));
      __m256 offset = _mm256_setzero_ps();
      if (QT == kQ4_1)
        offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_minimums(row, nb) + 2 * j)));
      else if (QT == kQ4_0)
        offset = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
      if (count < 8) {
        const __m256 present = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        d = _mm256_and_ps(d, present);
        offset = _mm256_and_ps(offset, present);
      }
      for (int m = 0; m < M; ++m) {
        const int64_t r = m * nb + j;
        const __m256i dots = dots8<QT>(quants, a.q.data() + m * a.stride, j, count);
        const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(a.scale.data() + r));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[m]);
        if (QT != kQ8_0) extra[m] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(a.sum.data() + r), extra[m]);
      }
    };
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8) group(j, 8);
    if (j < nb) group(j, nb - j);
    for (int m = 0; m < M; ++m) out[m * N + n] = hsum(acc[m]) + hsum(extra[m]);
  }
}

template <int64_t QT>
void matmul_small_i16_rows(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0,
                           int64_t n1, float* out, int64_t N) {
  if (M == 1) matmul_small_i16<1, QT>(a, K, w, n0, n1, out, N);
  else if (M == 2) matmul_small_i16<2, QT>(a, K, w, n0, n1, out, N);
  else matmul_small_i16<3, QT>(a, K, w, n0, n1, out, N);
}
#endif

void matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t qtype, int64_t n0,
                  int64_t n1, float* out, int64_t N) {
#ifdef TW_AVX2
  switch (M) {
    case 1: return matmul_small_avx2<1>(x, K, w, qtype, n0, n1, out, N);
    case 2: return matmul_small_avx2<2>(x, K, w, qtype, n0, n1, out, N);
    default: return matmul_small_avx2<3>(x, K, w, qtype, n0, n1, out, N);
  }
#else
  const int64_t nb = K / kBlock, bb = block_bytes(qtype), row_bytes = nb * bb;
  float wb[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[3] = {0, 0, 0};
    for (int64_t j = 0; j < nb; ++j) {
      dequant_block_scalar(block_at(w + n * row_bytes, qtype, nb, j), qtype, wb);
      for (int64_t m = 0; m < M; ++m)
        for (int i = 0; i < kBlock; ++i) acc[m] += wb[i] * x[m * K + j * kBlock + i];
    }
    for (int64_t m = 0; m < M; ++m) out[m * N + n] = acc[m];
  }
#endif
}

// M >= 4: kRows weight rows dequantised into an L1 buffer, then a kRows x 4 register tile of
// (weight row, activation row) dot products: 12 accumulators, 7 loads per 12 FMAs, so the
// FMA units rather than L2 reads of the activations set the pace.
constexpr int64_t kRows = 3;

void matmul_tiled(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t qtype, int64_t n0,
                  int64_t n1, float* out, int64_t N) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(qtype);
  std::vector<float> buf(kRows * K);
  for (int64_t n = n0; n < n1; n += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, n1 - n);
    for (int64_t r = 0; r < rows; ++r) dequant_row(w + (n + r) * row_bytes, qtype, nb, buf.data() + r * K);
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
      for (int64_t k = 0; k < K; k += 8) {
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
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < 4; ++i) out[(m + i) * N + n + r] = sums[r][i];
    }
#endif
    for (; m < M; ++m) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* wr = buf.data() + r * K;
        const float* xm = x + m * K;
#ifdef TW_AVX2
        __m256 a = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(xm + k), a);
        out[m * N + n + r] = hsum(a);
#else
        float a = 0;
        for (int64_t k = 0; k < K; ++k) a += wr[k] * xm[k];
        out[m * N + n + r] = a;
#endif
      }
    }
  }
}

// rows [n0, n1) of out [M, N] = x W^T: int16 activations when `qa` is given (M < 4), else fp32
void matvec_rows(const float* x, const QuantizedActivations* qa, int64_t M, int64_t K, const at::Tensor& w,
                 int64_t qtype, int64_t n0, int64_t n1, float* out) {
  const int64_t N = w.size(0);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (n0 >= n1) return;
#ifdef TW_AVX2
  if (qa != nullptr) {
    if (qtype == kQ4_1) matmul_small_i16_rows<kQ4_1>(*qa, M, K, wp, n0, n1, out, N);
    else if (qtype == kQ4_0) matmul_small_i16_rows<kQ4_0>(*qa, M, K, wp, n0, n1, out, N);
    else matmul_small_i16_rows<kQ8_0>(*qa, M, K, wp, n0, n1, out, N);
    return;
  }
#endif
  if (M < 4) matmul_small(x, M, K, wp, qtype, n0, n1, out, N);
  else matmul_tiled(x, M, K, wp, qtype, n0, n1, out, N);
}

}  // namespace tw
