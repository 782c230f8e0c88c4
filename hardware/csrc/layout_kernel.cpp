// The HAWK transformation's per-layer pass on the CPU, fused: every page (one tile) is built
// by reading its 32 tile rows straight from the layer's scattered GPU blocks and writing its
// send row once, tilized and packed (bfloat16 / float32 bits as they are, or bfloat8_b /
// bfloat4_b). Byte-exact with hardware.tiles (docs/facts.md 1-2). Pages are visited in page order,
// so the tiles of one TT block (the same 32 tokens) follow each other while those tokens are
// in cache; their send rows (grouped by DRAM bank) are far apart, each written whole.
//
// Layout of one tile (1024 elements): four 16x16 faces (top-left, top-right, bottom-left,
// bottom-right), each row-major. Tile row r (0..31) holds elements 0..31 of one token's head
// row; its columns 0..15 are face row (r / 16) * 2 + 0, row r % 16, and columns 16..31 are
// face (r / 16) * 2 + 1, row r % 16. A face row of 16 elements is one block-float group:
// group g = face * 16 + row owns exponent byte g and codes g * 16 .. g * 16 + 15.
//
// sources [n, 32] (int64): element offset in the layer of each page's tile rows, or -1 for
// tile padding (tokens past the request), which reads as zeros; send_rows [n]: the row of
// ``out`` each page fills.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int TILE = 32, FACE = 16, GROUPS = 64;
constexpr int64_t AHEAD = 16;       // pages asked for ahead (two TT blocks of 8 pages)

// float32 bit pattern of a source element (bfloat16 and float16 widen exactly).
inline uint32_t f32_bits(uint16_t bf16) { return uint32_t(bf16) << 16; }
inline uint32_t f32_bits(c10::Half h) {
  float f = static_cast<float>(h);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline uint32_t f32_bits(uint32_t f32) { return f32; }

// Ask for tile row r of the page ``ahead`` (32 elements: one or two 64-byte lines).
template <typename T>
inline void prefetch_row(const T* layer, const int64_t* ahead, int r) {
  if (ahead && ahead[r] >= 0) {
    __builtin_prefetch(layer + ahead[r]);
    if (sizeof(T) * TILE > 64) __builtin_prefetch(layer + ahead[r] + TILE - 1);
  }
}

// One group of 16 values -> its shared exponent and 16 one-byte sign-magnitude codes, the
// integer recipe of hardware.tiles.bfp_encode: E = max biased exponent; each 24-bit
// significand is shifted right by E - exp (dropped bits are lost), rounded half to even to
// MAG bits and saturated; negative zero and zero magnitudes give code 0.
template <int MAG, typename T>
inline uint8_t encode_group(const T* x, uint8_t* codes) {
  constexpr uint32_t drop = 24 - MAG, half = 1u << (drop - 1), lim = (1u << MAG) - 1;
  uint32_t bits[FACE], exp[FACE], code[FACE], shared = 0;
  for (int i = 0; i < FACE; ++i) {
    bits[i] = f32_bits(x[i]);
    exp[i] = (bits[i] >> 23) & 0xFF;
  }
  for (int i = 0; i < FACE; ++i) shared = std::max(shared, exp[i]);
  for (int i = 0; i < FACE; ++i) {
    uint32_t mant = exp[i] ? (bits[i] & 0x7FFFFF) | 0x800000 : 0;
    uint32_t aligned = mant >> std::min(shared - exp[i], 31u);
    uint32_t q = std::min((aligned + (half - 1) + ((aligned >> drop) & 1)) >> drop, lim);
    code[i] = q ? ((bits[i] >> 31) << MAG) | q : 0;
  }
  for (int i = 0; i < FACE; ++i) codes[i] = uint8_t(code[i]);
  return uint8_t(shared);
}

// One tile of block floats into ``page`` (64 exponent bytes, then the codes), portable.
template <int MAG, typename T>
void pack_tile_scalar(const T* layer, const int64_t* rows, uint8_t* page,
                      const int64_t* ahead) {
  static const T zeros[TILE] = {};
  uint8_t codes[FACE];
  for (int r = 0; r < TILE; ++r) {
    prefetch_row(layer, ahead, r);
    const T* x = rows[r] < 0 ? zeros : layer + rows[r];
    for (int fc = 0; fc < 2; ++fc) {
      const int g = ((r / FACE) * 2 + fc) * FACE + r % FACE;
      if (MAG == 7) {
        page[g] = encode_group<MAG>(x + fc * FACE, page + GROUPS + g * FACE);
      } else {                  // bfloat4_b: element 2m in the low nibble, 2m + 1 in the high
        page[g] = encode_group<MAG>(x + fc * FACE, codes);
        uint8_t* out = page + GROUPS + g * (FACE / 2);
        for (int m = 0; m < FACE / 2; ++m) out[m] = codes[2 * m] | (codes[2 * m + 1] << 4);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAWK_AVX512 1
// Four vectors of 16 values 0..255 in 32-bit lanes -> 64 bytes. The packs work within 128-bit
// lanes: dword 4L + k holds a, b, c, d's (k = 0..3) values 4L .. 4L + 3.
inline __m512i pack4(__m512i a, __m512i b, __m512i c, __m512i d) {
  return _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
}

template <bool STREAM>
inline void store_line(uint8_t* to, __m512i line) {
  if constexpr (STREAM) _mm512_stream_si512(reinterpret_cast<__m512i*>(to), line);
  else _mm512_storeu_si512(to, line);
}

// bfloat16 sources: one tile row, 32 values, in the 16-bit lanes of one __m512i, its two
// groups in the two 256-bit halves. A bfloat16's significand with the hidden bit is 8 bits;
// put at the top of a 16-bit lane (Y = 1.mmmmmmm << 8), Y >> (E - exp) keeps all its bits
// whenever the code can be non-zero (E - exp <= 7) and is below half otherwise, so rounding
// from 16 bits (dropping 16 - MAG) gives the 24-bit recipe's codes. The sum before the drop
// saturates at 0xFFFF only where the code saturates anyway. Branch-free: four butterfly steps
// leave each half's maximum exponent E in all its lanes; srlv gives 0 for shifts of 16 or more.
template <int MAG>
inline __m512i encode_row(__m512i x, __m512i* shared) {
  constexpr int drop = 16 - MAG;
  const __m512i exp = _mm512_and_si512(_mm512_srli_epi16(x, 7), _mm512_set1_epi16(0xFF));
  __m512i e = _mm512_max_epu16(exp, _mm512_shuffle_i64x2(exp, exp, _MM_SHUFFLE(2, 3, 0, 1)));
  e = _mm512_max_epu16(e, _mm512_shuffle_epi32(e, _MM_PERM_BADC));
  e = _mm512_max_epu16(e, _mm512_shuffle_epi32(e, _MM_PERM_CDAB));
  e = _mm512_max_epu16(e, _mm512_rol_epi32(e, 16));      // E in all 16 lanes of each half
  *shared = e;
  const __m512i y = _mm512_or_si512(_mm512_slli_epi16(x, 8), _mm512_set1_epi16(0x8000));
  const __m512i aligned = _mm512_maskz_srlv_epi16(_mm512_test_epi16_mask(exp, exp), y,
                                                  _mm512_sub_epi16(e, exp));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(aligned, drop), _mm512_set1_epi16(1));
  const __m512i up = _mm512_add_epi16(odd, _mm512_set1_epi16((1 << (drop - 1)) - 1));
  const __m512i q = _mm512_min_epu16(_mm512_srli_epi16(_mm512_adds_epu16(aligned, up), drop),
                                     _mm512_set1_epi16((1 << MAG) - 1));
  // q | sign << MAG (ternary logic A | (B & C): 0xF8), then 0 where q is 0
  const __m512i code = _mm512_ternarylogic_epi32(q, _mm512_srli_epi16(x, 15 - MAG),
                                                 _mm512_set1_epi16(1 << MAG), 0xF8);
  return _mm512_maskz_mov_epi16(_mm512_test_epi16_mask(q, q), code);
}

// One bfloat16 tile into ``page``, each 64-byte line written once (STREAM: non-temporal
// stores, which skip reading the far-apart send rows' lines first; ``page`` 64-byte aligned).
// Tile rows r .. r + 7 of one half (faces 2h, 2h + 1) make two lines of codes in each face
// (bfloat8_b: 4 groups of 16 bytes a line) or one (bfloat4_b: 8 groups of 8 bytes). The
// shared exponents are kept in one lane per face row and written last, as the page's first
// line.
template <int MAG, bool STREAM>
void pack_tile_vector(const uint16_t* layer, const int64_t* rows, uint8_t* page,
                      const int64_t* ahead) {
  constexpr int GROUP_BYTES = FACE * (MAG + 1) / 8;
  static const uint16_t zeros[TILE] = {};
  const __m512i nibbles = _mm512_set1_epi32(0xFF);
  __m512i exps[2];                      // per half: lane i face 2h row i, 16 + i face 2h + 1
  for (int h = 0; h < 2; ++h) {
    __m512i acc = _mm512_setzero_si512();
    for (int r0 = 0; r0 < FACE; r0 += 8) {
      __m512i c[8], e;
      for (int i = 0; i < 8; ++i) {
        prefetch_row(layer, ahead, h * FACE + r0 + i);
        const int64_t src = rows[h * FACE + r0 + i];
        c[i] = encode_row<MAG>(_mm512_loadu_si512(src < 0 ? zeros : layer + src), &e);
        acc = _mm512_mask_mov_epi16(acc, __mmask32(0x10001u << (r0 + i)), e);
        if constexpr (MAG == 3)     // 16-bit codes (2m, 2m + 1) -> one byte in a 32-bit lane
          c[i] = _mm512_ternarylogic_epi32(c[i], _mm512_srli_epi32(c[i], 12), nibbles, 0xA8);
      }
      const int g = 2 * h * FACE + r0;                    // face 2h; face 2h + 1 is 16 on
      if constexpr (MAG == 7) {  // qword 2L (2L + 1) of a pack: row 2k (2k + 1), chunk L
        for (int k = 0; k < 8; k += 4) {
          const __m512i a = _mm512_packus_epi16(c[k], c[k + 1]);
          const __m512i b = _mm512_packus_epi16(c[k + 2], c[k + 3]);
          const __m512i lo = _mm512_setr_epi64(0, 2, 1, 3, 8, 10, 9, 11);
          const __m512i hi = _mm512_add_epi64(lo, _mm512_set1_epi64(4));
          store_line<STREAM>(page + GROUPS + (g + k) * GROUP_BYTES,
                             _mm512_permutex2var_epi64(a, lo, b));
          store_line<STREAM>(page + GROUPS + (g + FACE + k) * GROUP_BYTES,
                             _mm512_permutex2var_epi64(a, hi, b));
        }
      } else {                   // dword 4L + k of a pack: row k, bytes 4L .. 4L + 3
        const __m512i a = pack4(c[0], c[1], c[2], c[3]), b = pack4(c[4], c[5], c[6], c[7]);
        const __m512i lo = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7,
                                             16, 20, 17, 21, 18, 22, 19, 23);
        const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
        store_line<STREAM>(page + GROUPS + g * GROUP_BYTES, _mm512_permutex2var_epi32(a, lo, b));
        store_line<STREAM>(page + GROUPS + (g + FACE) * GROUP_BYTES,
                           _mm512_permutex2var_epi32(a, hi, b));
      }
    }
    exps[h] = acc;
  }
  store_line<STREAM>(page, _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                                    _mm512_packus_epi16(exps[0], exps[1])));
}
#endif

// One tile of block floats into ``page``: from bfloat16 with AVX-512 (VECTOR) line by line,
// streamed where ``page`` is 64-byte aligned; else (float16, float32 too) group by group.
template <int MAG, bool VECTOR, typename T>
void pack_tile(const T* layer, const int64_t* rows, uint8_t* page, const int64_t* ahead) {
#if defined(HAWK_AVX512)
  if constexpr (VECTOR && std::is_same_v<T, uint16_t>) {
    if (reinterpret_cast<uintptr_t>(page) % 64 == 0)
      pack_tile_vector<MAG, true>(layer, rows, page, ahead);
    else
      pack_tile_vector<MAG, false>(layer, rows, page, ahead);
    return;
  }
#endif
  pack_tile_scalar<MAG>(layer, rows, page, ahead);
}

// Copy one face row (16 elements, 32 or 64 bytes). STREAM: with non-temporal stores, which
// skip reading the destination's cache lines first (``to`` must be 32-byte aligned).
template <int BYTES, bool STREAM>
inline void copy_face_row(uint8_t* to, const uint8_t* from) {
#if defined(__AVX__)
  if constexpr (STREAM) {
    for (int i = 0; i < BYTES; i += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i)));
    return;
  }
#endif
  std::memcpy(to, from, BYTES);
}

// One tile with the values as they are (T: an unsigned integer of the element's size): two
// face rows per tile row.
template <typename T, bool STREAM>
void copy_tile(const T* layer, const int64_t* rows, uint8_t* page, const int64_t* ahead) {
  constexpr int ESIZE = sizeof(T), face_row = FACE * ESIZE;
  for (int r = 0; r < TILE; ++r) {
    prefetch_row(layer, ahead, r);
    uint8_t* lo = page + ((r / FACE) * 2 * FACE * FACE + (r % FACE) * FACE) * ESIZE;
    uint8_t* hi = lo + FACE * FACE * ESIZE;      // the face to the right
    if (rows[r] < 0) {
      std::memset(lo, 0, face_row);
      std::memset(hi, 0, face_row);
    } else {
      const auto* x = reinterpret_cast<const uint8_t*>(layer + rows[r]);
      copy_face_row<face_row, STREAM>(lo, x);
      copy_face_row<face_row, STREAM>(hi, x + face_row);
    }
  }
}

// Visit the pages in order; each tile function asks for the tile rows of the page AHEAD pages
// on while it builds this one, one row per row it builds (``ahead``, null near the end): the
// rows of a TT block are scattered over GPU blocks, so the hardware prefetcher alone leaves
// the loads waiting on memory, and spread out the requests do not queue up behind each other.
template <typename T, typename Tile>
void each_page(const T* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
               int64_t n, int64_t stride, Tile tile) {
  for (int64_t p = 0; p < n; ++p)
    tile(layer, rows + p * TILE, out + send_rows[p] * stride,
         p + AHEAD < n ? rows + (p + AHEAD) * TILE : nullptr);
}

template <typename T, bool VECTOR>
void pack_all(const void* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
              int64_t n, int64_t stride, int64_t mag_bits) {
  const T* src = static_cast<const T*>(layer);
  if (mag_bits == 7) each_page(src, rows, send_rows, out, n, stride,
                               [](auto... a) { pack_tile<7, VECTOR, T>(a...); });
  else each_page(src, rows, send_rows, out, n, stride,
                 [](auto... a) { pack_tile<3, VECTOR, T>(a...); });
#if defined(HAWK_AVX512)
  if (VECTOR) _mm_sfence();                  // the streamed stores, visible before returning
#endif
}

// layer: the GPU layer (contiguous); sources: [n, 32] int64; send_rows: [n] int64; out:
// uint8 [rows, >= tile bytes] with contiguous rows; mag_bits: 0 (values as they are), 7
// (bfloat8_b) or 3 (bfloat4_b).
// vector: the AVX-512 block-float path where built with it (pack_layer), else the portable
// one (pack_layer_portable, which tests compare against it).
void pack(const at::Tensor& layer, const at::Tensor& sources, const at::Tensor& send_rows,
          const at::Tensor& out, int64_t mag_bits, bool vector) {
  TORCH_CHECK(layer.is_cpu() && layer.is_contiguous(), "layer must be contiguous on the CPU");
  TORCH_CHECK(sources.scalar_type() == at::kLong && sources.is_contiguous() &&
                  sources.dim() == 2 && sources.size(1) == TILE,
              "sources must be contiguous int64 [n, 32]");
  TORCH_CHECK(send_rows.scalar_type() == at::kLong && send_rows.is_contiguous() &&
                  send_rows.numel() == sources.size(0),
              "send_rows must be contiguous int64, one per page");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 2 && out.stride(1) == 1,
              "out must be uint8 [rows, bytes] with contiguous rows");
  TORCH_CHECK(mag_bits == 0 || mag_bits == 7 || mag_bits == 3, "mag_bits ", mag_bits);
  const int64_t n = sources.size(0), stride = out.stride(0), esize = layer.element_size();
  const int64_t need = mag_bits ? GROUPS + TILE * TILE * (mag_bits + 1) / 8 : TILE * TILE * esize;
  TORCH_CHECK(out.size(1) >= need, "send rows of ", out.size(1), " bytes, need ", need);
  const int64_t* rows = sources.data_ptr<int64_t>();
  const int64_t* dest = send_rows.data_ptr<int64_t>();
  const int64_t last = layer.numel() - TILE;
  for (int64_t i = 0; i < n * TILE; ++i)
    TORCH_CHECK(rows[i] <= last, "source offset ", rows[i], " past the layer");
  for (int64_t p = 0; p < n; ++p)
    TORCH_CHECK(dest[p] >= 0 && dest[p] < out.size(0), "send row ", dest[p], " out of range");
  uint8_t* dst = out.data_ptr<uint8_t>();
  const void* src = layer.data_ptr();
  if (mag_bits == 0) {
    TORCH_CHECK(esize == 2 || esize == 4, "values of ", esize, " bytes");
    const auto* u16 = static_cast<const uint16_t*>(src);
    const auto* u32 = static_cast<const uint32_t*>(src);
#if defined(__AVX__)
    if (reinterpret_cast<uintptr_t>(dst) % 32 == 0 && stride % 32 == 0) {   // streamed
      if (esize == 2) each_page(u16, rows, dest, dst, n, stride, copy_tile<uint16_t, true>);
      else each_page(u32, rows, dest, dst, n, stride, copy_tile<uint32_t, true>);
      _mm_sfence();                          // the streamed stores, visible before returning
      return;
    }
#endif
    if (esize == 2) each_page(u16, rows, dest, dst, n, stride, copy_tile<uint16_t, false>);
    else each_page(u32, rows, dest, dst, n, stride, copy_tile<uint32_t, false>);
    return;
  }
  auto blocks = vector ? pack_all<uint16_t, true> : pack_all<uint16_t, false>;
  switch (layer.scalar_type()) {
    case at::kBFloat16: break;
    case at::kHalf: blocks = vector ? pack_all<c10::Half, true> : pack_all<c10::Half, false>;
      break;
    case at::kFloat: blocks = vector ? pack_all<uint32_t, true> : pack_all<uint32_t, false>;
      break;
    default: TORCH_CHECK(false, "block floats from ", layer.scalar_type(), " are not supported");
  }
  blocks(src, rows, dest, dst, n, stride, mag_bits);
}

void pack_layer(const at::Tensor& layer, const at::Tensor& sources,
                const at::Tensor& send_rows, const at::Tensor& out, int64_t mag_bits) {
  pack(layer, sources, send_rows, out, mag_bits, true);
}

void pack_layer_portable(const at::Tensor& layer, const at::Tensor& sources,
                         const at::Tensor& send_rows, const at::Tensor& out, int64_t mag_bits) {
  pack(layer, sources, send_rows, out, mag_bits, false);
}

bool vectorized() {                      // block floats from bfloat16
#if defined(HAWK_AVX512)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(hawk_layout, m) {
  m.def("pack_layer(Tensor layer, Tensor sources, Tensor send_rows, Tensor(a!) out, "
        "int mag_bits) -> ()");
  m.def("pack_layer_portable(Tensor layer, Tensor sources, Tensor send_rows, Tensor(a!) out, "
        "int mag_bits) -> ()");
  m.def("vectorized", &vectorized);          // whether block floats take the AVX-512 path
}

TORCH_LIBRARY_IMPL(hawk_layout, CPU, m) {
  m.impl("pack_layer", &pack_layer);
  m.impl("pack_layer_portable", &pack_layer_portable);
}
