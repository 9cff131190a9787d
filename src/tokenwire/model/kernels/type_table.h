// The weight-type table: one row per GGUF type the kernels run. qmatmul, dequantize, matvec_rows
// and the fused decode stack call a type's functions through its row and never name a type
// (after ggml's type_traits_cpu). model/weight_types.py mirrors it; tests/model check the two
// agree through the weight_type_info op.
//
// Adding a type: a header and a row.
//   * The header (types_<family>.h) defines a traits struct with: kId (the GGUF type id), kName,
//     kBlock (weights per block), its split-row layout (SplitLayout<bytes of each part...>, whose
//     sum is the bytes per block), the scalar and AVX2 dequantisation of a block, and the
//     activation format its integer dot takes (Act: a struct as in blocks.h) with that dot. A
//     type of the 32-weight block family (an fp16 scale per block) gets its inner loops from
//     type_kernels.h's templates; another shape (K-quants: 256-weight super-blocks) writes its
//     own and fills its TypeRow with them instead of make_row's.
//   * The row here (its #include, make_row<Traits>() in kTypes) and the mirrored row in
//     weight_types.py.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via matvec.h).
#pragma once

#include "blocks.h"
#include "type_kernels.h"
#include "types_q4.h"
#include "types_q8.h"
#include "types_q5_iq4.h"
#include "types_float.h"
#include "types_k.h"
#include "types_k23.h"
#include "tiles_kquants.h"

namespace tw {

struct TypeRow {
  int64_t id;           // GGUF (GGML) type id
  const char* name;
  int64_t block;        // weights per block
  int64_t block_bytes;  // bytes per block
  const int* part_bytes;  // the split-row layout: bytes per block of each part, in row order
  int num_parts;
  const ActFormat* act;  // the activations its integer dot takes (nullptr: fp32 activations only)
  // dequantise a (split) row of nb blocks into nb * block floats
  void (*dequant_row)(const uint8_t* row, int64_t nb, float* out);
  // out[m, n] = x[m] . W[n] for n in [n0, n1), M < 4, fp32 activations x [M, K]
  void (*matmul_small)(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                       float* out, int64_t N);
  // the same from activations quantised in `act`'s format (nullptr where act is)
  void (*matmul_small_i16)(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0,
                           int64_t n1, float* out, int64_t N);
  // a tiled type (tiles.h, int8 activations): its matmul for any number of rows, on split rows
  // or the laid-out form (`laid`), and the laid-out form's conversions (nullptr elsewhere)
  void (*tiled)(const QuantizedActivations& a, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int64_t n1,
                float* out, int64_t N, bool laid) = nullptr;
  bool (*can_lay)(int64_t nb) = nullptr;
  void (*lay_out_group)(const uint8_t* rows, int64_t nb, int64_t row_bytes, uint8_t* image, uint8_t* out) = nullptr;
  void (*laid_row)(const uint8_t* w, int64_t nb, int64_t row_bytes, int64_t n, uint8_t* image, uint8_t* out) = nullptr;
};

// the int8 activation format of tiles.h (one row for every tiled type)
inline const ActFormat& act_format_i8() {
  static const ActFormat row{ActI8::kName, ActI8::kBlock, &ActI8::stride, &quantize_block_i8, ActI8::kBias};
  return row;
}

// Where the CPU has AVX2, a type with tile kernels (tiles_types.h) takes them for every number
// of rows, decode included, with int8 activations, in place of its int16 rows.
template <class T>
TypeRow with_tiles(TypeRow row) {
#ifdef TW_AVX2
  if constexpr (Tile<T>::kHas) {
    row.act = &act_format_i8();
    row.matmul_small_i16 = nullptr;
    row.tiled = &tile_matmul<T>;
    row.can_lay = &Tile<T>::laid;
    row.lay_out_group = &lay_out_group<T>;
    row.laid_row = &laid_row<T>;
  }
#endif
  return row;
}

template <class T>
TypeRow make_row() {
#ifdef TW_AVX2
  const ActFormat* act = &act_format<typename T::Act>();
  auto i16 = &matmul_small_i16_t<T>;
#else  // the integer dots need AVX2; without it every matvec takes fp32 activations
  const ActFormat* act = nullptr;
  decltype(TypeRow::matmul_small_i16) i16 = nullptr;
#endif
  return with_tiles<T>({T::kId, T::kName, T::kBlock, T::kBlockBytes, T::kPartBytes, T::kNumParts,
                        act, &dequant_row_t<T>, &matmul_small_t<T>, i16});
}

// the row of a type that brings its own row functions (types_float.h's F16/BF16, IQ4_XS):
// T::dequant_row, T::matmul_small and, where it has an integer dot (T::kIntDot), its Act and
// T::matmul_small_i16
template <class T>
TypeRow make_own_row() {
  const ActFormat* act = nullptr;
  decltype(TypeRow::matmul_small_i16) i16 = nullptr;
#ifdef TW_AVX2
  if constexpr (T::kIntDot) {
    act = &act_format<typename T::Act>();
    i16 = &T::matmul_small_i16;
  }
#endif
  return with_tiles<T>({T::kId, T::kName, T::kBlock, T::kBlockBytes, T::kPartBytes, T::kNumParts,
                        act, &T::dequant_row, &T::matmul_small, i16});
}

// a K-quant type's row: its own functions (types_k.h's k_* templates over its traits)
template <class T>
TypeRow make_k_row() {
#ifdef TW_AVX2
  const ActFormat* act = &act_format<typename T::Act>();
  auto i16 = &k_matmul_i16<T>;
#else
  const ActFormat* act = nullptr;
  decltype(TypeRow::matmul_small_i16) i16 = nullptr;
#endif
  return with_tiles<T>({T::kId, T::kName, T::kBlock, T::kBlockBytes, T::kPartBytes, T::kNumParts,
                        act, &k_dequant_row<T>, &k_matmul_small<T>, i16});
}

inline const TypeRow kTypes[] = {
    make_row<Q4_0>(),
    make_row<Q4_1>(),
    make_row<Q8_0>(),
    make_row<Q5_0>(),
    make_row<Q5_1>(),
    make_row<IQ4_NL>(),
    make_own_row<IQ4_XS>(),
    make_own_row<F16>(),
    make_own_row<BF16>(),
    make_k_row<Q4_K>(),
    make_k_row<Q6_K>(),
    make_k_row<Q5_K>(),
    make_k_row<Q3_K>(),
    make_k_row<Q2_K>(),
};

// The one dispatch point from a type id to its row.
inline const TypeRow& type_row(int64_t id) {
  for (const TypeRow& row : kTypes)
    if (row.id == id) return row;
  TORCH_CHECK(false, "unsupported quantisation type ", id);
}

// Whether a matrix of N rows of K features is kept laid out (tiles.h): every tiled type's whose
// rows make whole groups and whose reads fall on 4-byte offsets. lay_out (quant_cpu.cpp) and
// every reader decide by this one rule, so the form needs no flag of its own.
inline bool is_laid(const TypeRow& type, int64_t N, int64_t K) {
#ifdef TW_AVX2
  return type.can_lay != nullptr && N % kTileRows == 0 && type.can_lay(K / type.block);
#else
  return false;
#endif
}

// rows [n0, n1) of a matrix as split rows: w itself where it is not laid out, else a copy in
// `scratch`; returns the address of row n0
inline const uint8_t* split_rows_of(const uint8_t* w, const TypeRow& type, int64_t N, int64_t K, int64_t n0, int64_t n1,
                                    std::vector<uint8_t>& scratch) {
  const int64_t nb = K / type.block, row_bytes = nb * type.block_bytes;
  if (!is_laid(type, N, K)) return w + n0 * row_bytes;
  scratch.resize((n1 - n0 + 1) * row_bytes);
  uint8_t* image = scratch.data() + (n1 - n0) * row_bytes;
  for (int64_t n = n0; n < n1; ++n) type.laid_row(w, nb, row_bytes, n, image, scratch.data() + (n - n0) * row_bytes);
  return scratch.data();
}

inline void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  const TypeRow& type = type_row(qtype);
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "packed weight must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(K % type.block == 0, "input features ", K, " are not a multiple of ", type.block);
  TORCH_CHECK(w.size(1) == K / type.block * type.block_bytes, "packed weight has ", w.size(1), " bytes per row; ", K,
              " features of ", type.name, " need ", K / type.block * type.block_bytes);
}

}  // namespace tw
