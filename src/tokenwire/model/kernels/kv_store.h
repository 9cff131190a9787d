// The KV cache's storage types (--kv-dtype): how a new key or value row is stored, and how the
// attention reads one back. A row is one position's D values of one KV head.
// - fp32, fp16, bf16: the values, rounded to nearest-even as torch's .to() rounds them (the eager
//   path writes its cache with torch, the fused step with store_row: the same bits).
// - q8: int8 values with one fp16 scale per 32 (llama.cpp's q8_0 numbers: d = amax / 127, q =
//   round(x / d)), the scales in a tensor of their own beside the int8 one.
// Readers (KvF32 ... KvQ8) give a row as fp32: 16 or 8 values into a vector (AVX-512, AVX2) or
// the whole row into memory; all give the same floats (a q8 value is its fp16 scale times its integer, one
// rounding either way).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via attention.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "blocks.h"

namespace tw {

enum KvType : int64_t { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2, kKvQ8 = 3 };
constexpr int64_t kKvQ8Block = 32;  // values per scale in a q8 row

inline float half_bits(uint16_t h) { return half_to_float(reinterpret_cast<const uint8_t*>(&h)); }

struct KvF32 {
  using Elem = float;
  const float* p;
  static KvF32 at(const void* base, const uint16_t*, int64_t i) { return {static_cast<const float*>(base) + i}; }
  void to_floats(int64_t D, float* out) const { std::memcpy(out, p, D * sizeof(float)); }
#ifdef TW_AVX2  // 8 values in a vector (the AVX2 attention, attention.h)
  __m256 load8(int64_t i) const { return _mm256_loadu_ps(p + i); }
#endif
#ifdef TW_AVX512
  __m512 load16(int64_t i) const { return _mm512_loadu_ps(p + i); }
#endif
};

struct KvF16 {
  using Elem = uint16_t;
  const uint16_t* p;
  static KvF16 at(const void* base, const uint16_t*, int64_t i) { return {static_cast<const uint16_t*>(base) + i}; }
  void to_floats(int64_t D, float* out) const {
    int64_t i = 0;
#ifdef TW_AVX2  // F16C, 8 at a time: exact as the scalar conversion (a third of AVX2's attention)
    for (; i + 8 <= D; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
    for (; i < D; ++i) out[i] = half_bits(p[i]);
  }
#ifdef TW_AVX2  // 8 values in a vector (the AVX2 attention, attention.h)
  __m256 load8(int64_t i) const { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))); }
#endif
#ifdef TW_AVX512
  __m512 load16(int64_t i) const { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))); }
#endif
};

struct KvBF16 {
  using Elem = uint16_t;
  const uint16_t* p;
  static KvBF16 at(const void* base, const uint16_t*, int64_t i) { return {static_cast<const uint16_t*>(base) + i}; }
  void to_floats(int64_t D, float* out) const {
    int64_t i = 0;
#ifdef TW_AVX2
    for (; i + 8 <= D; i += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(wide, 16));
    }
#endif
    for (; i < D; ++i) {
      const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      std::memcpy(out + i, &bits, 4);
    }
  }
#ifdef TW_AVX2  // 8 values in a vector (the AVX2 attention, attention.h)
  __m256 load8(int64_t i) const {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
#endif
#ifdef TW_AVX512
  __m512 load16(int64_t i) const {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
#endif
};

struct KvQ8 {
  using Elem = int8_t;
  const int8_t* q;
  const uint16_t* s;  // the row's scales, one per kKvQ8Block values
  static KvQ8 at(const void* base, const uint16_t* scales, int64_t i) {
    return {static_cast<const int8_t*>(base) + i, scales + i / kKvQ8Block};
  }
  void to_floats(int64_t D, float* out) const {
#ifdef TW_AVX2  // D is a multiple of 32 (check_kv): a block's scale once, its values 8 at a time
    for (int64_t b = 0; b < D; b += kKvQ8Block) {
      const __m256 d = _mm256_set1_ps(half_bits(s[b / kKvQ8Block]));
      for (int64_t i = b; i < b + kKvQ8Block; i += 8) {
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight))));
      }
    }
#else
    for (int64_t i = 0; i < D; ++i) out[i] = half_bits(s[i / kKvQ8Block]) * static_cast<float>(q[i]);
#endif
  }
#ifdef TW_AVX2  // 8 values in a vector (the AVX2 attention, attention.h)
  __m256 load8(int64_t i) const {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i))));
    return _mm256_mul_ps(_mm256_set1_ps(half_bits(s[i / kKvQ8Block])), v);
  }
#endif
#ifdef TW_AVX512
  __m512 load16(int64_t i) const {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    return _mm512_mul_ps(_mm512_set1_ps(half_bits(s[i / kKvQ8Block])), v);
  }
#endif
};

// One layer's K or V cache: rows of `row_values` (kv_heads * D) values per slot
struct KvCacheView {
  KvType type;
  void* data;
  uint16_t* scales;  // q8 only
  int64_t row_values;

  // x [D] as the row of slot `slot`, KV head `head`
  void store_row(int64_t slot, int64_t head, int64_t D, const float* x) const {
    const int64_t i = slot * row_values + head * D;
    switch (type) {
      case kKvF32: std::memcpy(static_cast<float*>(data) + i, x, D * sizeof(float)); return;
      case kKvF16: {
        auto* out = static_cast<c10::Half*>(data) + i;
        for (int64_t j = 0; j < D; ++j) out[j] = c10::Half(x[j]);
        return;
      }
      case kKvBF16: {
        auto* out = static_cast<c10::BFloat16*>(data) + i;
        for (int64_t j = 0; j < D; ++j) out[j] = c10::BFloat16(x[j]);  // round to nearest even
        return;
      }
      case kKvQ8: {
        auto* out = static_cast<int8_t*>(data) + i;
        for (int64_t b = 0; b < D; b += kKvQ8Block) {
          float amax = 0;
          for (int64_t j = b; j < b + kKvQ8Block; ++j) amax = std::max(amax, std::fabs(x[j]));
          const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
          for (int64_t j = b; j < b + kKvQ8Block; ++j) out[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
          const c10::Half h(d);
          std::memcpy(scales + (i + b) / kKvQ8Block, &h, 2);
        }
        return;
      }
    }
  }
};

// The view of layer `layer` of a [layers, blocks, block_size, kv_heads, D] cache (and its q8
// scales [layers, blocks, block_size, kv_heads, D / 32]), checked
inline KvType kv_type_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat: return kKvF32;
    case at::kHalf: return kKvF16;
    case at::kBFloat16: return kKvBF16;
    case at::kChar: return kKvQ8;
    default: TORCH_CHECK(false, "KV cache must be float32, float16, bfloat16 or int8 (q8), not ", cache.scalar_type());
  }
}

inline void check_kv(const at::Tensor& cache, const std::optional<at::Tensor>& scales, int64_t kv_heads, int64_t D,
                     const char* what) {
  TORCH_CHECK(cache.is_contiguous() && cache.size(-2) == kv_heads && cache.size(-1) == D, what,
              " must be contiguous [..., blocks, block_size, kv_heads, head_dim]");
  if (kv_type_of(cache) == kKvQ8) {
    TORCH_CHECK(D % kKvQ8Block == 0, "a q8 KV cache needs a head size that is a multiple of ", kKvQ8Block, ", not ", D);
    TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kHalf && scales->is_contiguous() &&
                    scales->numel() * kKvQ8Block == cache.numel(),
                what, "'s q8 scales must be contiguous float16, one per ", kKvQ8Block, " values");
  }
}

inline KvCacheView kv_view(const at::Tensor& cache, const std::optional<at::Tensor>& scales, int64_t layer) {
  const KvType type = kv_type_of(cache);
  const int64_t per_layer = cache.dim() == 5 ? cache.stride(0) : 0;
  char* data = static_cast<char*>(cache.data_ptr()) + layer * per_layer * cache.element_size();
  uint16_t* s = nullptr;
  if (type == kKvQ8) s = reinterpret_cast<uint16_t*>(scales->data_ptr()) + layer * per_layer / kKvQ8Block;
  return {type, data, s, cache.size(-2) * cache.size(-1)};
}

}  // namespace tw
