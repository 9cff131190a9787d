// GGUF block formats (Q4_0, Q4_1, Q8_0) in tokenwire's split-row layout: dequantisation and
// the small vector helpers every kernel shares.
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
#endif

namespace tw {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
// The fused decode stack's matvecs take int16 activations (set_int16_activations(false): the
// fp32 path). qmatmul, which prefill chunks and unfused steps use, is always fp32: a prompt's
// KV then comes out the same (up to summation order) whether part of it came from the prefix
// cache (a few rows) or not (one chunk), as on the fp32 path; int16 rows there changed greedy
// continuations after a cache hit.
inline bool g_int16_activations = true;
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

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "packed weight must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(K % kBlock == 0, "input features ", K, " are not a multiple of ", kBlock);
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(qtype), "packed weight has ", w.size(1),
              " bytes per row; ", K, " features of this type need ", K / kBlock * block_bytes(qtype));
}

}  // namespace tw
