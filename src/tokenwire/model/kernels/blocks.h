// What every weight type and kernel shares: the split-row layout, fp16 conversion, small vector
// helpers, and activation formats (int16 rows for a type's integer dot). Nothing here names a
// weight type: those are types_*.h, gathered in type_table.h.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TW_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TW_AVX512 1  // tiles.h
#endif
#endif

namespace tw {

// Quantised matmuls take int16 activations, for any number of rows: every (weight row,
// activation row) product is summed in the same order whether the row runs alone, in a batch
// or in a prefill chunk (matvec.h), so a request's results do not depend on its company.
// set_int16_activations(false): the fp32 path instead (tests and quality comparisons).
inline bool g_int16_activations = true;

// A weight type's row in memory is split, not GGUF's array of blocks: each part of a block (its
// fp16 scale, its minimum, its quant bytes...) is stored for all nb blocks of the row before the
// next part (quant.py's split_rows; the same bytes per row). The decode matvec then converts 8
// blocks' scales with one vcvtph2ps and applies them as one vector, instead of two scalar half
// conversions and a broadcast per block: measured 1.4-1.5x faster per core on Q4_1 3072x576,
// 576x1536 and 49152x576 (Zen 3), with the same results. `Parts...`: bytes per block of each
// part, in the order of GGUF's block (which is also the row's order of parts).
template <int... Parts>
struct SplitLayout {
  static constexpr int kNumParts = sizeof...(Parts);
  static constexpr int kPartBytes[kNumParts] = {Parts...};
  static constexpr int kBlockBytes = (Parts + ...);
  static constexpr int64_t part_offset(int p) {
    int64_t offset = 0;
    for (int i = 0; i < p; ++i) offset += kPartBytes[i];
    return offset;
  }
  // part p of a row of nb blocks
  static const uint8_t* part(const uint8_t* row, int64_t nb, int p) { return row + nb * part_offset(p); }
};

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

#ifdef TW_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// the largest of 8 lanes (exact, whatever the order)
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
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

#ifdef TW_AVX2
// acc + the pairwise int16 products of a and b summed into int32 lanes: one vpdpwssd where the
// CPU has AVX-VNNI (-mavxvnni), else vpmaddwd then vpaddd. The same integers either way (both
// wrap modulo 2^32), so results do not depend on the instruction set; VNNI saves the add.
inline __m256i dot_acc(__m256i acc, __m256i a, __m256i b) {
#ifdef __AVXVNNI__
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// eight blocks' lane vectors -> one vector of their eight sums (block t in lane t)
inline __m256i sum_lanes8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// eight consecutive fp16 values as fp32 (a split row's scales or minimums of blocks j..j+7)
inline __m256 halves8(const uint8_t* part, int64_t j) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part + 2 * j)));
}
#endif

// ---------------------------------------------------------------------------------------------
// Activation formats. A weight type's integer dot takes its activations quantised in a format of
// its own: int16 per block of values (scale = max|x| / 32767, round to nearest) stored in the
// slot order its dot reads (so the weights stay as the file has them), with each block's scale
// and exact fp32 sum. A format is a struct F with kName, kBlock, stride(K) (int16 slots per row
// of K values), base(j) (block j's first slot) and slot(i) (where value i of a block goes from
// there, a constant once the loop is unrolled); ActFormat is its row.
struct ActFormat {
  const char* name;
  int64_t block;                  // values per scale
  int64_t (*stride)(int64_t K);   // int16 slots per row of K values
  // block j of a row from its `block` fp32 values: its values into the row (int16, or int8 for
  // tiles.h's format), its scale and sum, and (int8) its `bias` integer sums
  void (*quantize_block)(const float* xb, int16_t* row, int64_t j, float* scale, float* sum, int32_t* bias);
  int64_t bias = 0;  // int32 values per block in QuantizedActivations::bias
};

// The maximum and the rounding in vectors; the sum stays one serial chain in value order (an
// eight-lane sum moved the offset terms' last bits: a 1e-4 logprob bound of the quantised tiny
// model on an AVX2-only build went 1.0e-4 over). Rounding: nearest even, as nearbyint and
// vcvtps2dq in the default mode.
template <class F>
void quantize_block_i16(const float* xb, int16_t* row, int64_t j, float* scale, float* sum, int32_t*) {
  float mx = 0, total = 0;
  for (int i = 0; i < F::kBlock; ++i) total += xb[i];
  int32_t q[F::kBlock];
#ifdef TW_AVX2
  static_assert(F::kBlock % 8 == 0, "blocks of whole vectors");
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int i = 0; i < F::kBlock; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  mx = hmax(vmax);
  const __m256 inv = _mm256_set1_ps(mx > 0 ? 32767.0f / mx : 0.0f);
  for (int i = 0; i < F::kBlock; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv)));
#else
  for (int i = 0; i < F::kBlock; ++i) mx = std::max(mx, std::fabs(xb[i]));
  const float inv = mx > 0 ? 32767.0f / mx : 0.0f;
  for (int i = 0; i < F::kBlock; ++i) q[i] = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
#endif
  int16_t* dst = row + F::base(j);
  for (int i = 0; i < F::kBlock; ++i) dst[F::slot(i)] = static_cast<int16_t>(q[i]);
  *scale = mx / 32767.0f;
  *sum = total;
}

// the one ActFormat row of format F (its address identifies the format)
template <class F>
const ActFormat& act_format() {
  static const ActFormat row{F::kName, F::kBlock, &F::stride, &quantize_block_i16<F>};
  return row;
}

// A matvec input [M, K] in one activation format (buffers kept between calls).
struct QuantizedActivations {
  std::vector<int16_t> q;    // [M, stride], in the format's slot order
  std::vector<float> scale;  // [M, nb]
  std::vector<float> sum;    // [M, nb], fp32 sums of the original values
  std::vector<int32_t> bias;  // [M, nb, format->bias]: the int8 format's integer sums
  int64_t stride = 0, nb = 0;
  const ActFormat* format = nullptr;

  void reset(int64_t M, int64_t K, const ActFormat& f) {
    format = &f;
    nb = K / f.block;
    stride = f.stride(K);
    q.resize(M * stride);
    scale.resize(M * nb + 8);  // + 8: a row's last group of blocks loads 8 lanes
    sum.resize(M * nb + 8);
    bias.resize(M * nb * f.bias);
  }

  // block j of row m from its fp32 values
  void quantize_block(const float* xb, int64_t m, int64_t j) {
    format->quantize_block(xb, q.data() + m * stride, j, &scale[m * nb + j], &sum[m * nb + j],
                           bias.data() + (m * nb + j) * format->bias);
  }

  // all of x [M, K] (contiguous)
  void quantize(const float* x, int64_t M, int64_t K, const ActFormat& f) {
    reset(M, K, f);
    for (int64_t r = 0; r < M * nb; ++r) quantize_block(x + r * f.block, r / nb, r % nb);
  }

  // rows [m0, m0 + count) of `from`, as activations of their own (a copy): the groups of rows
  // a many-row integer matmul hands its type's loop (matvec.h)
  void copy_rows(const QuantizedActivations& from, int64_t m0, int64_t count) {
    format = from.format;
    nb = from.nb;
    stride = from.stride;
    q.assign(from.q.begin() + m0 * stride, from.q.begin() + (m0 + count) * stride);
    scale.assign(from.scale.begin() + m0 * nb, from.scale.begin() + (m0 + count) * nb);
    sum.assign(from.sum.begin() + m0 * nb, from.sum.begin() + (m0 + count) * nb);
    const int64_t nbias = nb * format->bias;
    bias.assign(from.bias.begin() + m0 * nbias, from.bias.begin() + (m0 + count) * nbias);
    scale.resize(count * nb + 8);  // the padding reset() gives
    sum.resize(count * nb + 8);
  }
};

}  // namespace tw
