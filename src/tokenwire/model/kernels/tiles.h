// The register-tiled integer matmul of the tiled types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// IQ4_XS, Q4_K, Q5_K, Q6_K), for any number of activation rows, decode included: ONE arithmetic
// per type whatever M is.
//
// Activations: int8, one scale per 32 values (round to nearest, scale = max|x| / 127), with each
// block's exact fp32 sum and its integer sums (ActI8, one format for every tiled type). Weights:
// kept laid out (LaidSrc below: the rows of a strip of kTileRows, 16 with AVX-512, 8 with AVX2,
// dword-interleaved at load), and read a strip at a time through the type's conversion
// (tiles_types.h): per 32-weight unit, 8 vectors whose dword lane r holds 4 consecutive unsigned
// weights of row r, and two vectors of per-row floats (scale, offset). Many activation rows: the
// strip is converted once into an L1/L2 buffer, and the micro-kernel multiplies it by up to
// kTileTokens activation rows at once: per token one accumulator whose lanes are the strip's rows
// (no horizontal sums), 4 activation bytes broadcast per vpdpbusd (AVX2: vpmaddubsw, as many
// summed in int16 as fit, then vpmaddwd; two strips side by side share each broadcast), the
// buffer shared by every token of the call. Decode rows (M < 4): each unit multiplied as it is
// converted, in registers (decode_tokens).
//
// Batch invariance: per (weight row, activation row) the sum is, unit after unit,
//   acc = fma(float(idot_u), wscale_u * xscale_u, acc)   (Q6_K: its two 16-weight halves, one
//   fma each), offset types also off = fma(woffset_u, xsum_u, off), and acc + off at the end,
// where idot_u is an exact integer. The lanes are rows and the tokens have accumulators of their
// own, so neither the strip a row falls in nor the tokens beside it can change its bits: alone,
// in a batch of 32, a prefill chunk, speculative verification, decode.
//
// Centring: the unsigned weights carry their zero point z (Q4_*: 8, Q6_K: 32, Q8_0: 128 on
// AVX-512) and the integer dot subtracts z * (the activations' integer sum) exactly, so the
// activation rounding errors meet q - z (|q - 8| <= 8) rather than q (<= 15): the int8 error of
// a Q4 dot is about half what it would be uncentred. Q4_1's minimum and Q4_K's (with the 8 d sc
// the centring moved) multiply the exact fp32 block sums.
//
// Measured (Zen 5 EPYC VM, 2 threads, 8192x2048, GFLOP/s, min of calls; old = the int16 kernels
// of the commit before, same sitting; the machine shared with other work; split rows, before
// the laid-out form):
//                      M = 32          M = 256
//   AVX-512  Q4_0     90 -> 424      187 -> 527
//            Q4_1    192 -> 477      153 -> 537
//            Q8_0    171 -> 398      167 -> 598
//            Q4_K    169 -> 380      190 -> 482
//            Q6_K    166 -> 372      201 -> 505
//   AVX2     Q4_0     88 -> 222       91 -> 268
//            Q4_1     96 -> 309      132 -> 318
//            Q8_0     99 -> 167      142 -> 177
//            Q4_K    145 -> 212      145 -> 219
//            Q6_K     94 -> 192       94 -> 230
// One core, M = 256: 250-310 GFLOP/s. Decode: LaidSrc's comment. AVX2 since (one core, laid
// out, M = 256, interleaved with the commit before): Q4_0 180 -> 240, Q4_K 164 -> 220 (int16
// sums of 8 products' pairs, two strips a tile: TileIsa::unit_dots, kTileStrips).
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via type_table.h).
#pragma once

#include "tile_isa.h"

namespace tw {

// The int8 activation format: 32 values a block, stored in order (4 bytes a dword, the order
// the buffers' dword lanes take). Per block also, in QuantizedActivations::bias, its integer
// sums times minus each zero point: [-8 sum, -32 sum(0..15), -32 sum(16..31), -128 sum].
struct ActI8 {
  static constexpr const char* kName = "i8_32";
  static constexpr int kBlock = 32;
  static constexpr int kBias = 4;
  static int64_t stride(int64_t K) { return K / 2; }  // int16 slots: K bytes
};

// 32 int8 values into block j of a row, with their integer sums times minus each zero point
inline void store_block_i8(const int32_t q[32], int16_t* row, int64_t j, int32_t* bias) {
  int8_t* dst = reinterpret_cast<int8_t*>(row) + 32 * j;
  int32_t lo = 0, hi = 0;
  for (int i = 0; i < 32; ++i) {
    dst[i] = static_cast<int8_t>(q[i]);
    (i < 16 ? lo : hi) += q[i];
  }
  bias[0] = -8 * (lo + hi);
  bias[1] = -32 * lo;
  bias[2] = -32 * hi;
  bias[3] = -128 * (lo + hi);
}

inline void quantize_block_i8(const float* xb, int16_t* row, int64_t j, float* scale, float* sum, int32_t* bias) {
  float mx = 0, total = 0;
  for (int i = 0; i < 32; ++i) total += xb[i];  // one serial chain in value order (blocks.h)
  int32_t q[32];
#ifdef TW_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  mx = hmax(vmax);
  const __m256 inv = _mm256_set1_ps(mx > 0 ? 127.0f / mx : 0.0f);
  for (int i = 0; i < 32; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv)));
#else
  for (int i = 0; i < 32; ++i) mx = std::max(mx, std::fabs(xb[i]));
  const float inv = mx > 0 ? 127.0f / mx : 0.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
#endif
  store_block_i8(q, row, j, bias);
  *scale = mx / 127.0f;
  *sum = total;
}

// The lm_head's activations: ~15 bits in two int8 rows. Per block q = round(x * 16256 / max|x|)
// = 128 h + l with h in [-127, 127] and l in [-64, 63] (both inside the +-127 the kernels take,
// AVX2's vpmaddubsw sums included): row m of `out` holds h (scale 128 s,
// the block's exact sum), row M + m holds l (scale s, sum 0: the offset terms count once), so
// one tiled matmul over 2M rows gives both halves and out[m] + out[M + m] is the product with
// x rounded to 1/16256 of its block's maximum instead of 1/127. The integer dots stay exact,
// each half is a row like any other (its bits whatever its company), and the two are added in
// one fixed order. Why the head: `tokenwire bench quality` on the shipped SmolLM2 (Q8_0 head),
// 2,000 tokens, against the exact model: int8 everywhere top-1 96.25%, mean |dlogprob| 6.43e-2;
// the head's input exact (the rest int8) 96.80%, 5.50e-2; llama.cpp on the same file 96.35%,
// 5.96e-2. The head is ~20% of a 32-stream step's arithmetic (this doubles it) and one row of
// a prefill chunk's.
inline void quantize_rows_i8_pair(const float* x, int64_t M, int64_t K, const ActFormat& i8, QuantizedActivations& out) {
  out.reset(2 * M, K, i8);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < out.nb; ++j) {
      const float* xb = x + m * K + 32 * j;
      float mx = 0, total = 0;
      for (int i = 0; i < 32; ++i) total += xb[i];  // the same serial chain as quantize_block_i8
      for (int i = 0; i < 32; ++i) mx = std::max(mx, std::fabs(xb[i]));
      const float inv = mx > 0 ? 16256.0f / mx : 0.0f;
      int32_t h[32], l[32];
      for (int i = 0; i < 32; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
        h[i] = (q + 64) >> 7;  // q / 128 rounded (arithmetic shift)
        l[i] = q - 128 * h[i];
      }
      const int64_t hb = m * out.nb + j, lb = (M + m) * out.nb + j;
      store_block_i8(h, out.q.data() + m * out.stride, j, out.bias.data() + hb * ActI8::kBias);
      store_block_i8(l, out.q.data() + (M + m) * out.stride, j, out.bias.data() + lb * ActI8::kBias);
      out.scale[hb] = mx * 128.0f / 16256.0f;
      out.scale[lb] = mx / 16256.0f;
      out.sum[hb] = total;
      out.sum[lb] = 0.0f;
    }
  }
}

#ifdef TW_AVX2
// A type's tile traits (tiles_types.h): Tile<T>::kHas, kHalves (1: one scale a unit; 2: Q6_K's
// two 16-weight halves, each its own scale), kOffset (an offset times the exact block sums),
// kBias (which of ActI8's integer sums starts the dot: 0 z = 8, 1 z = 32 by halves, 3 z = 128,
// -1 none) and kBiasTimes (that sum taken twice: Q5's z = 16), kSigned (weights signed: Q8_0 on
// AVX2), kSum16 (AVX2: how many vpmaddubsw results of its weights fit one int16 sum), and
// convert(rows, nb, buf).
template <class T>
struct Tile {
  static constexpr bool kHas = false;
};

// how many vpmaddubsw results (each two products of an activation byte, |x| <= 127, and a
// weight byte <= q_max; a signed weight's |w| <= 128) one int16 sum holds, up to a unit's 8
constexpr int sum16_of(int q_max) {
  int g = 8;
  while (g * 2 * q_max * 127 > 32767) g /= 2;
  return g;
}

// ---------------------------------------------------------------------------------------------
// Where a strip's bytes come from. A type's convert (tiles_types.h) reads 16 bytes of every row
// at a byte offset through src.get(off, out): out[k] lane r = dword off / 4 + k of row r.
//   RowsSrc: the kernels' split rows, one pointer a row, transposed on the fly.
//   LaidSrc: the laid-out form (lay_out below): a group of kTileRows rows stored dword-interleaved
//            (dword c of row r at c * sizeof(TI) + 4 r), so the same read is 4 plain loads.
// kImage: the rows are in their laid image (only Q6_K's differs from its split row: tiles_types.h).
struct RowsSrc {
  static constexpr bool kImage = false;
  const uint8_t* const* rows;
  void get(int64_t off, TI out[4]) const { TileIsa::transpose(rows, off, out); }
};

struct LaidSrc {
  static constexpr bool kImage = true;
  const uint8_t* group;  // the group's first byte
  const uint8_t* tail;   // its rows' last row_bytes % 4 bytes, kTileRows of them (Q6_K's odd d)
  bool ahead;            // prefetch along the reads (decode: the strips prefetch whole strips)
  void get(int64_t off, TI out[4]) const {
    const TI* p = reinterpret_cast<const TI*>(group) + off / 4;
    if (ahead) TileIsa::prefetch_ahead(p);
    for (int k = 0; k < 4; ++k) out[k] = TileIsa::load(p + k);
  }
  TF tail_halves() const { return TileIsa::halves(tail); }  // one fp16 a row
};

// The laid-out form of a tiled type's matrix: rows in groups of kTileRows, each group's row
// images dword-interleaved, then their tails; the same bytes (Q6_K: the same bytes reordered),
// so resident weights stay the file's size. Laid out where every read offset is a multiple of 4
// (Tile<T>::laid) and the matrix's rows are whole groups; quant.lay_out does it at load. Why:
// decode reads a strip as it lies, front to back, with no transposition and no buffer. Before
// it, decode-only kernels read split rows (AVX-512: a row's units unpacked by permutes, results
// transposed; AVX2: 8 rows' partial dots folded) at ~10 GB/s a core. Measured M = 1, ten
// 8192x2048 matrices in turn (streamed from DRAM), GB/s of weights: Q4_K one core 11.2-11.9 ->
// 23.8-25.6, two 19.7-20.5 -> 35-49; llama-1b Q4_K_M greedy decode AVX-512 28.6 -> 44-51 tok/s,
// AVX2 build 24.4 -> 41.2 (docs/engine.md).
// Where a group's bytes lie: dword c of row r, and row r's tail (its last row_bytes % 4 bytes)
struct LaidGroup {
  int64_t row_bytes, dwords = row_bytes / 4, rest = row_bytes % 4;
  int64_t bytes() const { return kTileRows * row_bytes; }
  int64_t dword_at(int64_t c, int64_t r) const { return (c * kTileRows + r) * 4; }
  int64_t tail_at(int64_t r) const { return dwords * kTileRows * 4 + r * rest; }
};

inline LaidSrc laid_src(const uint8_t* w, int64_t row_bytes, int64_t group, bool ahead) {
  const LaidGroup L{row_bytes};
  const uint8_t* g = w + group * L.bytes();
  return {g, g + L.tail_at(0), ahead};
}

// kTileRows split rows -> their group in the laid-out form (`image` scratch: kTileRows rows)
template <class T>
void lay_out_group(const uint8_t* rows, int64_t nb, int64_t row_bytes, uint8_t* image, uint8_t* out) {
  const LaidGroup L{row_bytes};
  for (int r = 0; r < kTileRows; ++r) {
    const uint8_t* row = image + r * row_bytes;
    Tile<T>::to_image(rows + r * row_bytes, nb, image + r * row_bytes);
    for (int64_t c = 0; c < L.dwords; ++c) std::memcpy(out + L.dword_at(c, r), row + 4 * c, 4);
    std::memcpy(out + L.tail_at(r), row + 4 * L.dwords, L.rest);
  }
}

// row n of a laid-out matrix -> its split row
template <class T>
void laid_row(const uint8_t* w, int64_t nb, int64_t row_bytes, int64_t n, uint8_t* image, uint8_t* out) {
  const LaidGroup L{row_bytes};
  const uint8_t* g = w + n / kTileRows * L.bytes();
  const int64_t r = n % kTileRows;
  for (int64_t c = 0; c < L.dwords; ++c) std::memcpy(image + 4 * c, g + L.dword_at(c, r), 4);
  std::memcpy(image + 4 * L.dwords, g + L.tail_at(r), L.rest);
  Tile<T>::from_image(image, nb, out);
}

// The activation rows a step reads: tokens [m0, m0 + NT) of a
struct TokenRows {
  const int8_t* x;
  int64_t xstride, nb;
  const float *xs, *xsum;
  const int32_t* bias;
  TokenRows(const QuantizedActivations& a, int64_t m0)
      : x(reinterpret_cast<const int8_t*>(a.q.data()) + m0 * a.stride * 2), xstride(a.stride * 2), nb(a.nb),
        xs(a.scale.data() + m0 * a.nb), xsum(a.sum.data() + m0 * a.nb), bias(a.bias.data() + m0 * a.nb * ActI8::kBias) {}
};

// unit u of S strips side by side (S x kUnitVecs vectors at w) into NT tokens' accumulators:
// the one arithmetic of every path (strips, laid-out decode); a strip's lanes take the same
// operations whatever strip is beside it
template <class T, int S, int NT>
inline void unit_step(const TI* w, int64_t u, const TokenRows& x, TF acc[S][NT], TF off[S][NT]) {
  using V = TileIsa;
  using Tr = Tile<T>;
  constexpr int H = Tr::kHalves;
  TI ia[S][NT][H];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < H; ++h) {
      const int32_t* b = x.bias + (t * x.nb + u) * ActI8::kBias;
      const TI start = Tr::kBias < 0 ? V::set1(0) : V::set1(Tr::kBiasTimes * b[H == 2 ? 1 + h : Tr::kBias]);
      for (int j = 0; j < S; ++j) ia[j][t][h] = start;
    }
  V::template unit_dots<Tr, S, NT, H>(w, x.x + 32 * u, x.xstride, ia);
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    const TF xs = V::bcastf(x.xs + t * x.nb + u);
    for (int j = 0; j < S; ++j) {
      const TF s0 = V::as_f(w[j * kUnitVecs + 8]), s1 = V::as_f(w[j * kUnitVecs + 9]);
      acc[j][t] = V::fma(V::cvt(ia[j][t][0]), V::mul(s0, xs), acc[j][t]);
      if constexpr (H == 2) acc[j][t] = V::fma(V::cvt(ia[j][t][1]), V::mul(s1, xs), acc[j][t]);
      if constexpr (Tr::kOffset) off[j][t] = V::fma(s1, V::bcastf(x.xsum + t * x.nb + u), off[j][t]);
    }
  }
}

// res[j][t][r]: strip j, token t (kTileTokens of them a strip), row r
template <class T, int S, int NT>
inline void store_tokens(const TF acc[S][NT], const TF off[S][NT], float* res) {
  for (int j = 0; j < S; ++j)
    for (int t = 0; t < NT; ++t)
      TileIsa::storef(res + (j * kTileTokens + t) * kTileRows, Tile<T>::kOffset ? TileIsa::add(acc[j][t], off[j][t]) : acc[j][t]);
}

// Strips a tile takes side by side, sharing each activation broadcast. AVX2 with one scale a
// unit: 2, so 16 rows x 3 tokens instead of 8 x 4 (an L1-resident unit loop: 113 -> 130 GMAC/s
// a core, broadcast loads halved; Q6_K's two halves need the registers); AVX-512: 1.
template <class T>
constexpr int kTileStrips = kTileRows == 8 && Tile<T>::kHalves == 1 ? 2 : 1;
template <int S>
constexpr int kStripTokens = S == 2 ? 3 : kTileTokens;

// out[j][t][r] for tokens [m0, m0 + NT) against S strips' converted units (unit u of strip j at
// buf + (u S + j) kUnitVecs)
template <class T, int S, int NT>
void tile_tokens(const TI* buf, int64_t units, const QuantizedActivations& a, int64_t m0, float* res) {
  const TokenRows x(a, m0);
  TF acc[S][NT], off[S][NT];
  for (int j = 0; j < S; ++j)
    for (int t = 0; t < NT; ++t) acc[j][t] = off[j][t] = TileIsa::zerof();
  for (int64_t u = 0; u < units; ++u) unit_step<T, S, NT>(buf + u * S * kUnitVecs, u, x, acc, off);
  store_tokens<T, S, NT>(acc, off, res);
}

// Decode rows (M < kDecodeTokens): each unit of a strip converted into registers and multiplied
// at once, with no buffer; the same unit_step as the strips, so the same bits. From the laid-out
// form that is plain loads; split rows (a matrix that cannot be laid out) pay the transposes.
constexpr int64_t kDecodeTokens = 4;
template <class T, int NT, class Src>
void decode_tokens(const Src& src, int64_t nb, const QuantizedActivations& a, float* res) {
  const TokenRows x(a, 0);
  TF acc[1][NT], off[1][NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = off[0][t] = TileIsa::zerof();
  Tile<T>::convert(src, nb, [&](int64_t u, const TI* w) { unit_step<T, 1, NT>(w, u, x, acc, off); });
  store_tokens<T, 1, NT>(acc, off, res);
}

template <class T, class Src>
void decode_strip(const Src& src, int64_t nb, const QuantizedActivations& a, int64_t M, float* res) {
  switch (M) {
    case 1: decode_tokens<T, 1>(src, nb, a, res); break;
    case 2: decode_tokens<T, 2>(src, nb, a, res); break;
    default: decode_tokens<T, 3>(src, nb, a, res); break;
  }
}

// out[m, n] = x[m] . W[n] for n in [n0, n1), any M, in strips of kTileRows rows: decode rows
// straight from each strip (decode_tokens), more rows from the strip converted once into an
// L1/L2 buffer and run against every group of kTileTokens activation rows. Split rows: a short
// last strip repeats its last row (computed, not stored). Laid out: strips are the groups (a
// range that starts or ends inside one computes it whole and stores its own rows).
template <class T>
void tile_matmul(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                 float* out, int64_t N, bool laid) {
  constexpr int S = kTileStrips<T>;
  const int64_t nb = K / T::kBlock, row_bytes = nb * T::kBlockBytes, units = K / 32;
  thread_local std::vector<uint8_t> storage;  // the strips' units, 64-byte aligned
  if (M >= kDecodeTokens) storage.resize(S * units * kUnitVecs * sizeof(TI) + 64);
  TI* buf = reinterpret_cast<TI*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  alignas(64) float res[2 * kTileTokens * kTileRows];
  // a strip's rows inside [n0, n1) into out: one copy a token (element stores, with n0 and n1
  // reloaded after each for aliasing, were 8 % of a llama-1b prefill; a call of memcpy each, 3 %)
  auto put = [out, N, n0, n1](const float* from, int64_t s, int64_t m, int64_t count) {
    const int64_t lo = std::max(s, n0), hi = std::min(s + kTileRows, n1);
    for (int64_t t = 0; t < count; ++t) {
      if (hi - lo == kTileRows) TileIsa::storef(out + (m + t) * N + lo, TileIsa::loadf(from + t * kTileRows));
      else std::memcpy(out + (m + t) * N + lo, from + t * kTileRows + lo - s, (hi - lo) * sizeof(float));
    }
  };
  // a strip's rows from the one form or the other, to `use` (decode_strip or convert)
  auto with_strip = [&](int64_t s, auto&& use) {
    if (laid) return use(laid_src(w, row_bytes, s / kTileRows, M < kDecodeTokens));
    const uint8_t* ptrs[kTileRows];
    for (int r = 0; r < kTileRows; ++r) ptrs[r] = w + (s + std::min<int64_t>(r, n1 - 1 - s)) * row_bytes;
    use(RowsSrc{ptrs});
  };
  const int64_t first = laid ? n0 - n0 % kTileRows : n0;
  if (M < kDecodeTokens) {
    for (int64_t s = first; s < n1; s += kTileRows) {
      with_strip(s, [&](const auto& src) { decode_strip<T>(src, nb, a, M, res); });
      put(res, s, 0, M);
    }
    return;
  }
  // S strips (one where fewer are left) converted into buf, then run against every group of
  // their tokens
  auto strips = [&](auto count_of_strips, int64_t s) {
    constexpr int SS = decltype(count_of_strips)::value;
    // the next strips into L2 while these convert and multiply (split rows: 16 read side by side
    // outrun the hardware's stream prefetchers; laid out, a prefill measured the same with and
    // without it)
    const int64_t next = s + SS * kTileRows;
    if (next < n1)
      for (int64_t o = 0; o < std::min<int64_t>(SS * kTileRows, n1 - next) * row_bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + next * row_bytes + o), _MM_HINT_T1);
    for (int j = 0; j < SS; ++j)
      with_strip(s + j * kTileRows, [&](const auto& src) {
        Tile<T>::convert(src, nb, [&](int64_t u, const TI* v) {
          for (int i = 0; i < kUnitVecs; ++i) TileIsa::store(buf + (u * SS + j) * kUnitVecs + i, v[i]);
        });
      });
    constexpr int NT = kStripTokens<SS>;
    for (int64_t m = 0; m < M; m += NT) {
      const int64_t count = std::min<int64_t>(NT, M - m);
      switch (count) {
#define TW_TILE_CASE(n) \
  case n: tile_tokens<T, SS, (n <= NT ? n : NT)>(buf, units, a, m, res); break;
        TW_TILE_CASE(1) TW_TILE_CASE(2) TW_TILE_CASE(3) TW_TILE_CASE(4) TW_TILE_CASE(5) TW_TILE_CASE(6)
        TW_TILE_CASE(7) TW_TILE_CASE(8)
#undef TW_TILE_CASE
      }
      for (int j = 0; j < SS; ++j) put(res + j * kTileTokens * kTileRows, s + j * kTileRows, m, count);
    }
  };
  for (int64_t s = first; s < n1;) {
    if (S == 2 && s + kTileRows < n1) {
      strips(std::integral_constant<int, S>{}, s);
      s += S * kTileRows;
    } else {
      strips(std::integral_constant<int, 1>{}, s);
      s += kTileRows;
    }
  }
}
#endif

}  // namespace tw
