// CPU kernels for GGUF block-quantised weights (Q4_0, Q4_1, Q8_0), kept in the file's own
// block layout, and a fused decode step of one Llama decoder layer.
//
// Why our own kernels (measured on the 2-core AVX2 machine, SmolLM2-135M, all matmuls of one
// decode step): torch's int4 weight-only kernel takes 134 ms with fp32 activations and 10.8 ms
// with bf16 ones (which also changes the numerics); fp32 MKL takes 38.6 ms and runs a matvec on
// one core. Dequantising a block in registers and multiplying with fp32 activations reads 4.5
// bits per weight, uses both cores and keeps the fp32 path's numerics up to summation order.
// The fused layer removes ~30 framework dispatches per layer (8.5 ms of a 30-layer step).
//
// Numerics: a weight is dequantised exactly as gguf's reference (d*q, d*(q-8), d*q+m: the
// product d*q is exact in fp32, so d*q+m rounds once whether fused or not), then multiplied
// by fp32 activations with fp32 accumulation. Compiled with -ffp-contract=off so scalar code
// rounds where it is written (RoPE, RMSNorm match the PyTorch expressions operation for
// operation).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TW_AVX2 1
#endif

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
// The fused decode layer's matvecs take int16 activations (set_int16_activations(false): the
// fp32 path). qmatmul, which prefill chunks and unfused steps use, is always fp32: a prompt's
// KV then comes out the same (up to summation order) whether part of it came from the prefix
// cache (a few rows) or not (one chunk), as on the fp32 path; int16 rows there changed greedy
// continuations after a cache hit.
bool g_int16_activations = true;
constexpr int kBlock = 32;

// In memory a weight row is split, not GGUF's array of blocks: [nb fp16 scales d][nb fp16
// minimums m (Q4_1 only)][nb x 16 or 32 quant bytes] (quant.py's split_rows; the same bytes per
// row). The decode matvec then converts 8 blocks' scales with one vcvtph2ps and applies them as
// one vector, instead of two scalar half conversions and a broadcast per block: measured 1.4-1.5x
// faster per core on Q4_1 3072x576, 576x1536 and 49152x576 (Zen 3), with the same results.
struct Block {
  const uint8_t* d;  // fp16 scale
  const uint8_t* m;  // fp16 minimum (Q4_1)
  const uint8_t* q;  // 16 bytes of nibbles (Q4_0, Q4_1) or 32 int8 (Q8_0)
};

inline int64_t quant_bytes(int64_t qtype) { return qtype == kQ8_0 ? 32 : 16; }

inline const uint8_t* row_minimums(const uint8_t* row, int64_t nb) { return row + 2 * nb; }

inline const uint8_t* row_quants(const uint8_t* row, int64_t qtype, int64_t nb) {
  return row + (qtype == kQ4_1 ? 4 : 2) * nb;
}

inline Block block_at(const uint8_t* row, int64_t qtype, int64_t nb, int64_t j) {
  return {row + 2 * j, qtype == kQ4_1 ? row_minimums(row, nb) + 2 * j : nullptr,
          row_quants(row, qtype, nb) + j * quant_bytes(qtype)};
}

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  TORCH_CHECK(false, "unsupported quantisation type ", qtype);
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef TW_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      int e = -1;
      uint32_t m = mant;
      do { ++e; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// One block of 32 weights as exact fp32 values (scalar reference; also the portable path).
inline void dequant_block_scalar(const Block& b, int64_t qtype, float* out) {
  const float d = half_to_float(b.d);
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b.q);
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(q[i]);
  } else if (qtype == kQ4_0) {
    const uint8_t* q = b.q;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
      out[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
    }
  } else {
    const float m = half_to_float(b.m);
    const uint8_t* q = b.q;
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(q[i] & 0x0f) + m;
      out[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
    }
  }
}

#ifdef TW_AVX2
// One block as four vectors of 8 exact fp32 weights (w[0] = weights 0..7, ...).
inline void dequant_block_avx2(const Block& b, int64_t qtype, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_to_float(b.d));
  if (qtype == kQ8_0) {
    const uint8_t* q = b.q;
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    }
    return;
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(packed, mask);                     // weights 0..15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // weights 16..31
  __m256i ints[4] = {
      _mm256_cvtepu8_epi32(lo),
      _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
      _mm256_cvtepu8_epi32(hi),
      _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)),
  };
  if (qtype == kQ4_1) {
    const __m256 m = _mm256_set1_ps(half_to_float(b.m));
    // d*q is exact in fp32 (11-bit by 4-bit mantissas): the fused form rounds once, like d*q+m
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(ints[i]), m);
  } else {
    const __m256i eight = _mm256_set1_epi32(8);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ints[i], eight)));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef TW_AVX2
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
  }
#endif
  float acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// y += alpha * x
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#ifdef TW_AVX2
  if (n % 8 == 0) {
    const __m256 a = _mm256_set1_ps(alpha);
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void dequant_row(const uint8_t* row, int64_t qtype, int64_t nb, float* out) {
  for (int64_t j = 0; j < nb; ++j) {
#ifdef TW_AVX2
    __m256 w[4];
    dequant_block_avx2(block_at(row, qtype, nb, j), qtype, w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + j * kBlock + 8 * i, w[i]);
#else
    dequant_block_scalar(block_at(row, qtype, nb, j), qtype, out + j * kBlock);
#endif
  }
}

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
// round to nearest): one vpmaddwd does 16 multiply-adds where the fp32 path needs a convert and
// an FMA per 8 weights, so a block costs ~16 instructions instead of ~30 (measured ~2x faster
// per core on Q4_1 3072x576). The activation rounding error is at most 1.5e-5 of the block's
// largest value; the minimum (Q4_1) and offset (Q4_0) terms use the exact fp32 block sums.
#ifdef TW_AVX2
struct QuantizedActivations {
  std::vector<int16_t> q;    // [M, K]
  std::vector<float> scale;  // [M, K/32]
  std::vector<float> sum;    // [M, K/32], fp32 sums of the original values
};

QuantizedActivations quantize_activations(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  QuantizedActivations a{std::vector<int16_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t r = 0; r < M * nb; ++r) {
    const float* xb = x + r * kBlock;
    float mx = 0, total = 0;
    for (int i = 0; i < kBlock; ++i) {
      mx = std::max(mx, std::fabs(xb[i]));
      total += xb[i];
    }
    const float s = mx / 32767.0f, inv = mx > 0 ? 32767.0f / mx : 0.0f;
    for (int i = 0; i < kBlock; ++i) a.q[r * kBlock + i] = static_cast<int16_t>(std::nearbyint(xb[i] * inv));
    a.scale[r] = s;
    a.sum[r] = total;
  }
  return a;
}

// sum over the block of q_i * xq_i as 8 int32 lanes (q: the stored integers, 0..15 or -128..127)
inline __m256i block_dot_i16(const uint8_t* q, int64_t qtype, const int16_t* xq) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
  __m256i w0, w1;
  if (qtype == kQ8_0) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0f);
    w0 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
    w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  }
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
}

// eight blocks' lane vectors -> one vector of their eight sums (block t in lane t)
inline __m256i sum_lanes8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_hadd_epi32(s, s);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
}

// Per row and activation row: integer block dots, eight blocks at a time scaled by d_w * s_x as
// one vector; the minimum (Q4_1) or offset (Q4_0: -8 d) times the block's exact fp32 sum beside.
template <int M, int64_t QT>
void matmul_small_i16(const QuantizedActivations& a, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                      float* out, int64_t N) {
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(QT), qb = quant_bytes(QT);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    const uint8_t* quants = row_quants(row, QT, nb);
    __m256 acc[M], extra[M];
    float tail[M];
    for (int m = 0; m < M; ++m) {
      acc[m] = extra[m] = _mm256_setzero_ps();
      tail[m] = 0;
    }
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * j)));
      __m256 offset = _mm256_setzero_ps();
      if (QT == kQ4_1)
        offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_minimums(row, nb) + 2 * j)));
      else if (QT == kQ4_0)
        offset = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
      for (int m = 0; m < M; ++m) {
        const int64_t r = m * nb + j;
        __m256i dots[8];
        for (int t = 0; t < 8; ++t) dots[t] = block_dot_i16(quants + (j + t) * qb, QT, a.q.data() + (r + t) * kBlock);
        const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(a.scale.data() + r));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes8(dots)), scale, acc[m]);
        if (QT != kQ8_0) extra[m] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(a.sum.data() + r), extra[m]);
      }
    }
    for (; j < nb; ++j) {
      const float d = half_to_float(row + 2 * j);
      const float offset = QT == kQ4_1 ? half_to_float(row_minimums(row, nb) + 2 * j) : (QT == kQ4_0 ? -8.0f * d : 0.0f);
      for (int m = 0; m < M; ++m) {
        const int64_t r = m * nb + j;
        const int32_t dot = sum_lanes(block_dot_i16(quants + j * qb, QT, a.q.data() + r * kBlock));
        tail[m] += d * a.scale[r] * static_cast<float>(dot) + offset * a.sum[r];
      }
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = hsum(acc[m]) + hsum(extra[m]) + tail[m];
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

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "packed weight must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(K % kBlock == 0, "input features ", K, " are not a multiple of ", kBlock);
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(qtype), "packed weight has ", w.size(1),
              " bytes per row; ", K, " features of this type need ", K / kBlock * block_bytes(qtype));
}

// Work below which a parallel region costs more than it saves. A fork/join is a few us on an
// idle core pair but, when the other core is busy, a barrier waits for its time slice: measured
// with every matvec of a SmolLM2 decode step split over 2 threads, 98 tok/s with the second core
// free but 9 tok/s with it taken, against 40-52 on one thread. Splitting only the large matvecs
// (gate/up, down, lm_head) keeps most of the gain with a third of the regions.
constexpr int64_t kMinParallelWeights = 1 << 19;

inline int64_t rows_per_task(int64_t K, int64_t M) {
  return std::max<int64_t>(16, kMinParallelWeights / std::max<int64_t>(1, K * M));
}

// x [M, K] fp32 contiguous -> [M, N]
void qmatmul_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& out, bool int16_rows) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (M < 4) {
#ifdef TW_AVX2
    if (int16_rows) {
      const QuantizedActivations acts = quantize_activations(xp, M, K);
      at::parallel_for(0, N, rows_per_task(K, M), [&](int64_t a, int64_t b) {
        if (qtype == kQ4_1) matmul_small_i16_rows<kQ4_1>(acts, M, K, wp, a, b, op, N);
        else if (qtype == kQ4_0) matmul_small_i16_rows<kQ4_0>(acts, M, K, wp, a, b, op, N);
        else matmul_small_i16_rows<kQ8_0>(acts, M, K, wp, a, b, op, N);
      });
      return;
    }
#endif
    at::parallel_for(0, N, rows_per_task(K, M), [&](int64_t a, int64_t b) {
      matmul_small(xp, M, K, wp, qtype, a, b, op, N);
    });
  } else {
    // tasks are groups of kRows weight rows (the tile's height)
    at::parallel_for(0, (N + kRows - 1) / kRows, 8, [&](int64_t a, int64_t b) {
      matmul_tiled(xp, M, K, wp, qtype, kRows * a, std::min(N, kRows * b), op, N);
    });
  }
}

// int16_rows: rows below 4 take the int16-activation matvec (when set_int16_activations is on):
// the lm_head of a fused decode step: SmolLM2 5.4 -> 3.4 ms (min of 60, one thread, loaded machine)
at::Tensor qmatmul(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, bool int16_rows) {
  TORCH_CHECK(x_in.dtype() == at::kFloat, "activations must be float32");
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  check_weight(w, qtype, x.size(1));
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) > 0) qmatmul_into(x, w, qtype, out, int16_rows && g_int16_activations);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = w.size(0);
  return out.view(shape);
}

at::Tensor qmatmul_meta(const at::Tensor& x, const at::Tensor& w, int64_t, bool) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return at::empty(shape, x.options());
}

// rows [R] of W -> [R, K] fp32 (all rows when `rows` is empty): embedding lookups and the
// dequantise-then-GEMM path of large batches
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& rows) {
  check_weight(w, qtype, K);
  const bool all = rows.numel() == 0;
  const int64_t R = all ? w.size(0) : rows.numel();
  at::Tensor idx = all ? rows : rows.to(at::kLong).contiguous();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  at::Tensor out = at::empty({R, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1), N = w.size(0);
  at::parallel_for(0, R, 64, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const int64_t src = ip ? ip[r] : r;
      TORCH_CHECK(src >= 0 && src < N, "row ", src, " out of range for ", N, " rows");
      dequant_row(wp + src * row_bytes, qtype, K / kBlock, op + r * K);
    }
  });
  return out;
}

void rms_norm_rows(const float* x, const float* weight, float eps, int64_t M, int64_t H, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) out[m * H + i] = weight[i] * (xr[i] * r);
  }
}

// One decode token per row m (row m is its own sequence): the whole decoder layer, x updated
// in place. KV cache [blocks, block_size, kv_heads, D]; block_tables [M, max_blocks] int64;
// positions [M] (the new token's position, so the row attends to positions 0..pos).
void decode_layer(at::Tensor x, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                  const at::Tensor& qkv_w, int64_t qkv_type, const std::optional<at::Tensor>& qkv_bias,
                  const at::Tensor& o_w, int64_t o_type, const at::Tensor& gate_up_w, int64_t gate_up_type,
                  const at::Tensor& down_w, int64_t down_type, const at::Tensor& cos, const at::Tensor& sin,
                  at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& positions,
                  const at::Tensor& block_tables, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x must be contiguous float32 [M, H]");
  TORCH_CHECK(k_cache.dtype() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous float32");
  const int64_t M = x.size(0), H = x.size(1);
  const int64_t D = k_cache.size(3), bs = k_cache.size(1), rep = num_heads / num_kv_heads;
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D, qkv_n = q_size + 2 * kv_size;
  const int64_t inter = gate_up_w.size(0) / 2, half = D / 2, max_blocks = block_tables.size(1);
  float* xp = x.data_ptr<float>();
  auto opts = x.options();

  at::Tensor h = at::empty({M, H}, opts);
  rms_norm_rows(xp, input_norm.data_ptr<float>(), static_cast<float>(eps), M, H, h.data_ptr<float>());
  at::Tensor qkv = at::empty({M, qkv_n}, opts);
  qmatmul_into(h, qkv_w, qkv_type, qkv, g_int16_activations);
  float* qp = qkv.data_ptr<float>();
  if (qkv_bias.has_value()) {
    const float* bp = qkv_bias->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < qkv_n; ++i) qp[m * qkv_n + i] += bp[i];
  }
  // RoPE on the q and k heads, as x*cos + roll(x, D/2)*signed_sin (two multiplies and an add)
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cp + m * D;
    const float* s = sp + m * D;
    for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
      float* v = qp + m * qkv_n + head * D;
      for (int64_t i = 0; i < D; ++i) tmp[i] = v[i] * c[i] + v[(i + half) % D] * s[i];
      std::memcpy(v, tmp.data(), D * sizeof(float));
    }
  }
  // the new keys/values into their cache slots
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const int64_t p = pos[m], slot = tables[m * max_blocks + p / bs] * bs + p % bs;
    std::memcpy(kc + slot * kv_size, qp + m * qkv_n + q_size, kv_size * sizeof(float));
    std::memcpy(vc + slot * kv_size, qp + m * qkv_n + q_size + kv_size, kv_size * sizeof(float));
  }
  // attention: one (row, head) per task; softmax(q.k / sqrt(D)) over positions 0..pos
  at::Tensor attn = at::empty({M, q_size}, opts);
  float* ap = attn.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  int64_t attended = 0;  // key positions over all rows: short contexts stay on one thread
  for (int64_t m = 0; m < M; ++m) attended += (pos[m] + 1) * num_heads * D;
  const int64_t grain = attended >= kMinParallelWeights ? 1 : M * num_heads;
  at::parallel_for(0, M * num_heads, grain, [&](int64_t a, int64_t b) {
    std::vector<float> scores;
    for (int64_t task = a; task < b; ++task) {
      const int64_t m = task / num_heads, head = task % num_heads, kvh = head / rep;
      const int64_t len = pos[m] + 1;
      const float* q = qp + m * qkv_n + head * D;
      scores.resize(len);
      float mx = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        const float* key = kc + (tables[m * max_blocks + t / bs] * bs + t % bs) * kv_size + kvh * D;
        scores[t] = dot(q, key, D) * scale;
        mx = std::max(mx, scores[t]);
      }
      float total = 0;
      for (int64_t t = 0; t < len; ++t) {
        scores[t] = std::exp(scores[t] - mx);
        total += scores[t];
      }
      float* o = ap + m * q_size + head * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* val = vc + (tables[m * max_blocks + t / bs] * bs + t % bs) * kv_size + kvh * D;
        axpy(scores[t] / total, val, o, D);
      }
    }
  });
  at::Tensor proj = at::empty({M, H}, opts);
  qmatmul_into(attn, o_w, o_type, proj, g_int16_activations);
  const float* pp = proj.data_ptr<float>();
  for (int64_t i = 0; i < M * H; ++i) xp[i] += pp[i];
  rms_norm_rows(xp, post_norm.data_ptr<float>(), static_cast<float>(eps), M, H, h.data_ptr<float>());
  at::Tensor gu = at::empty({M, 2 * inter}, opts);
  qmatmul_into(h, gate_up_w, gate_up_type, gu, g_int16_activations);
  at::Tensor act = at::empty({M, inter}, opts);
  float* gp = gu.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < inter; ++i) {
      const float g = gp[m * 2 * inter + i];
      actp[m * inter + i] = g / (1.0f + std::exp(-g)) * gp[m * 2 * inter + inter + i];
    }
  qmatmul_into(act, down_w, down_type, proj, g_int16_activations);
  for (int64_t i = 0; i < M * H; ++i) xp[i] += pp[i];
}

void set_int16_activations(bool on) { g_int16_activations = on; }

}  // namespace

TORCH_LIBRARY(tokenwire, m) {
  m.def("set_int16_activations(bool on) -> ()");
  m.def("qmatmul(Tensor x, Tensor w, int qtype, bool int16_rows=False) -> Tensor");
  m.def("dequantize(Tensor w, int qtype, int k, Tensor rows) -> Tensor");
  m.def(
      "decode_layer(Tensor(a!) x, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_w, int qkv_type, "
      "Tensor? qkv_bias, Tensor o_w, int o_type, Tensor gate_up_w, int gate_up_type, Tensor down_w, "
      "int down_type, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor positions, "
      "Tensor block_tables, int num_heads, int num_kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(tokenwire, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("dequantize", &dequantize);
  m.impl("decode_layer", &decode_layer);
}

TORCH_LIBRARY_IMPL(tokenwire, CatchAll, m) { m.impl("set_int16_activations", &set_int16_activations); }

TORCH_LIBRARY_IMPL(tokenwire, Meta, m) { m.impl("qmatmul", &qmatmul_meta); }
