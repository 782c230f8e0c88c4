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
#include <ATen/Parallel.h>
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
#include <vector>

namespace {

constexpr int TILE = 32, FACE = 16, GROUPS = 64;
constexpr int64_t AHEAD = 16;       // pages asked for ahead (two TT blocks of 8 pages)
constexpr int PAGE_GROUP = 8;       // bfloat16 block floats: pages built together (a TT block)
constexpr int64_t GRAIN = 256;      // pages one thread takes at least

// float32 bit pattern of a source element (bfloat16 and float16 widen exactly).
inline uint32_t f32_bits(uint16_t bf16) { return uint32_t(bf16) << 16; }
inline uint32_t f32_bits(c10::Half h) {
  float f = static_cast<float>(h);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline uint32_t f32_bits(uint32_t f32) { return f32; }

// Ask for tile row r of the page ``ahead`` (32 elements: one or two 64-byte lines), into
// every cache level (LEVEL 3) or into L2 and below (LEVEL 2: sixteen pages ahead fill the L1).
template <int LEVEL = 3, typename T>
inline void prefetch_row(const T* layer, const int64_t* ahead, int r) {
  if (ahead && ahead[r] >= 0) {
    __builtin_prefetch(layer + ahead[r], 0, LEVEL);
    if (sizeof(T) * TILE > 64) __builtin_prefetch(layer + ahead[r] + TILE - 1, 0, LEVEL);
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
// groups in the two 256-bit halves (``exp``: their biased exponents; ``e``: each half's
// maximum E in all its lanes). A bfloat16's significand with the hidden bit is 8 bits;
// put at the top of a 16-bit lane (Y = 1.mmmmmmm << 8), Y >> (E - exp) keeps all its bits
// whenever the code can be non-zero (E - exp <= 7) and is below half otherwise, so rounding
// from 16 bits (dropping 16 - MAG) gives the 24-bit recipe's codes. The sum before the drop
// saturates at 0xFFFF only where the code saturates anyway, and 0xFFFF >> (16 - MAG) is the
// largest code, so no clamp is needed. Branch-free; srlv gives 0 for shifts of 16 or more.
template <int MAG>
inline __m512i encode_row(__m512i x, __m512i exp, __m512i e) {
  constexpr int drop = 16 - MAG;
  const __m512i y = _mm512_or_si512(_mm512_slli_epi16(x, 8), _mm512_set1_epi16(0x8000));
  const __m512i aligned = _mm512_maskz_srlv_epi16(_mm512_test_epi16_mask(exp, exp), y,
                                                  _mm512_sub_epi16(e, exp));
  // half to even: add half - 1, or half where the bit kept last is odd
  const __mmask32 odd = _mm512_test_epi16_mask(aligned, _mm512_set1_epi16(1 << drop));
  const __m512i up = _mm512_mask_blend_epi16(odd, _mm512_set1_epi16((1 << (drop - 1)) - 1),
                                             _mm512_set1_epi16(1 << (drop - 1)));
  const __m512i q = _mm512_srli_epi16(_mm512_adds_epu16(aligned, up), drop);
  // the sign bit (added: q < 1 << MAG) where x is negative and q is not 0
  const __mmask32 negative = _mm512_movepi16_mask(x) & _mm512_test_epi16_mask(q, q);
  return _mm512_mask_add_epi16(q, negative, q, _mm512_set1_epi16(1 << MAG));
}

// The maximum exponents of eight tile rows' sixteen groups at once (``exp[w]``: row w's
// exponents), a tree of blends and maxima over the rows together instead of a butterfly per
// row: word w (and 8 + w) of the result is row w's E of its first group, 16 + w (and 24 + w)
// that of its second.
inline __m512i max_exponents(const __m512i* exp) {
  __m512i pairs[4], quads[2];
  for (int k = 0; k < 4; ++k) {  // dword: rows 2k (low word), 2k + 1 (high), over 2 lanes
    const __m512i a = exp[2 * k], b = exp[2 * k + 1];
    pairs[k] = _mm512_max_epu16(_mm512_mask_blend_epi16(0xAAAAAAAA, a, b),
                                _mm512_rol_epi32(_mm512_mask_blend_epi16(0xAAAAAAAA, b, a), 16));
  }
  for (int k = 0; k < 2; ++k) {  // qword: rows 4k .. 4k + 3, over 4 lanes
    const __m512i a = pairs[2 * k], b = pairs[2 * k + 1];
    quads[k] = _mm512_max_epu16(_mm512_mask_blend_epi32(0xAAAA, a, b),
                                _mm512_shuffle_epi32(_mm512_mask_blend_epi32(0xAAAA, b, a),
                                                     _MM_PERM_CDAB));
  }
  const __m512i eights =          // 128 bits: rows 0 .. 7, over 8 lanes
      _mm512_max_epu16(_mm512_mask_blend_epi64(0xAA, quads[0], quads[1]),
                       _mm512_shuffle_epi32(_mm512_mask_blend_epi64(0xAA, quads[1], quads[0]),
                                            _MM_PERM_BADC));
  return _mm512_max_epu16(eights, _mm512_shuffle_i64x2(eights, eights, _MM_SHUFFLE(2, 3, 0, 1)));
}

// Tile rows h * 16 + r0 .. + 7 of one bfloat16 tile into ``page``, each 64-byte line of codes
// written once (STREAM: non-temporal stores, which skip reading the far-apart send rows' lines
// first; ``page`` 64-byte aligned). The eight rows make two lines of codes in each of faces
// 2h and 2h + 1 (bfloat8_b: 4 groups of 16 bytes a line) or one (bfloat4_b: 8 groups of 8
// bytes). Their shared exponents go into ``exps`` (lane i: face 2h row i, 16 + i: face 2h + 1).
template <int MAG, bool STREAM>
inline void pack_rows_vector(const uint16_t* layer, const int64_t* rows, uint8_t* page,
                             const int64_t* ahead, int h, int r0, __m512i& exps) {
  constexpr int GROUP_BYTES = FACE * (MAG + 1) / 8;
  static const uint16_t zeros[TILE] = {};
  const __m512i nibbles = _mm512_set1_epi32(0xFF);
  const __m512i halves = _mm512_setr_epi64(0, 0, 0, 0, 0x0010001000100010, 0x0010001000100010,
                                           0x0010001000100010, 0x0010001000100010);
  __m512i x[8], exp[8], c[8];
  for (int i = 0; i < 8; ++i) {
    prefetch_row<2>(layer, ahead, h * FACE + r0 + i);
    const int64_t src = rows[h * FACE + r0 + i];
    x[i] = _mm512_loadu_si512(src < 0 ? zeros : layer + src);
    exp[i] = _mm512_and_si512(_mm512_srli_epi16(x[i], 7), _mm512_set1_epi16(0xFF));
  }
  const __m512i shared = max_exponents(exp);
  exps = _mm512_mask_mov_epi16(exps, r0 ? 0xFF00FF00 : 0x00FF00FF, shared);
  for (int i = 0; i < 8; ++i) {     // row i's E: word i of the first half, 16 + i of the second
    const __m512i e = _mm512_permutexvar_epi16(_mm512_add_epi16(halves, _mm512_set1_epi16(i)),
                                               shared);
    c[i] = encode_row<MAG>(x[i], exp[i], e);
    if constexpr (MAG == 3)     // 16-bit codes (2m, 2m + 1) -> one byte in a 32-bit lane
      c[i] = _mm512_ternarylogic_epi32(c[i], _mm512_srli_epi32(c[i], 12), nibbles, 0xA8);
  }
  const int g = 2 * h * FACE + r0;                        // face 2h; face 2h + 1 is 16 on
  if constexpr (MAG == 7) {      // qword 2L (2L + 1) of a pack: row 2k (2k + 1), chunk L
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
  } else {                       // dword 4L + k of a pack: row k, bytes 4L .. 4L + 3
    const __m512i a = pack4(c[0], c[1], c[2], c[3]), b = pack4(c[4], c[5], c[6], c[7]);
    const __m512i lo = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7,
                                         16, 20, 17, 21, 18, 22, 19, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    store_line<STREAM>(page + GROUPS + g * GROUP_BYTES, _mm512_permutex2var_epi32(a, lo, b));
    store_line<STREAM>(page + GROUPS + (g + FACE) * GROUP_BYTES,
                       _mm512_permutex2var_epi32(a, hi, b));
  }
}

// Up to PAGE_GROUP bfloat16 tiles (``rows``: theirs, one after another) into ``pages``, eight
// tile rows of each in turn: consecutive pages of a TT block are the same 32 tokens' rows side
// by side, so the loads walk each GPU block forward (a few KB at a time) instead of striding
// over it once per page. The shared exponents are written last, as each page's first line.
// ``ahead``: the tile rows of the pages PAGE_GROUP... on (null: none), asked for into L2.
template <int MAG, bool STREAM>
void pack_group_vector(const uint16_t* layer, const int64_t* rows, uint8_t* const* pages,
                       int count, const int64_t* ahead) {
  __m512i exps[PAGE_GROUP][2];
  for (int j = 0; j < count; ++j) exps[j][0] = exps[j][1] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h)
    for (int r0 = 0; r0 < FACE; r0 += 8)
      for (int j = 0; j < count; ++j)
        pack_rows_vector<MAG, STREAM>(layer, rows + j * TILE, pages[j],
                                      ahead ? ahead + j * TILE : nullptr, h, r0, exps[j][h]);
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  for (int j = 0; j < count; ++j)
    store_line<STREAM>(pages[j], _mm512_permutexvar_epi64(
                                     order, _mm512_packus_epi16(exps[j][0], exps[j][1])));
}

// Pages [begin, end) of block floats from bfloat16, PAGE_GROUP at a time.
template <int MAG, bool STREAM>
void pack_pages_vector(const uint16_t* layer, const int64_t* rows, const int64_t* send_rows,
                       uint8_t* out, int64_t begin, int64_t end, int64_t stride) {
  uint8_t* pages[PAGE_GROUP];
  for (int64_t p = begin; p < end; p += PAGE_GROUP) {
    const int count = int(std::min<int64_t>(PAGE_GROUP, end - p));
    for (int j = 0; j < count; ++j) pages[j] = out + send_rows[p + j] * stride;
    pack_group_vector<MAG, STREAM>(layer, rows + p * TILE, pages, count,
                                   p + AHEAD + count <= end ? rows + (p + AHEAD) * TILE
                                                            : nullptr);
  }
  if constexpr (STREAM) _mm_sfence();     // the streamed stores, visible before returning
}
#endif

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

// Visit pages [begin, end) in order; each tile function asks for the tile rows of the page
// AHEAD pages on while it builds this one, one row per row it builds (``ahead``, null near the
// end): the rows of a TT block are scattered over GPU blocks, so the hardware prefetcher alone
// leaves the loads waiting on memory, and spread out the requests do not queue up behind each
// other.
template <typename T, typename Tile>
void each_page(const T* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
               int64_t begin, int64_t end, int64_t stride, Tile tile) {
  for (int64_t p = begin; p < end; ++p)
    tile(layer, rows + p * TILE, out + send_rows[p] * stride,
         p + AHEAD < end ? rows + (p + AHEAD) * TILE : nullptr);
}

// Fills the send rows of pages [begin, end).
using Range = void (*)(const void* layer, const int64_t* rows, const int64_t* send_rows,
                       uint8_t* out, int64_t begin, int64_t end, int64_t stride);

// Values as they are; STREAM: non-temporal stores (every send row 32-byte aligned).
template <typename T, bool STREAM>
void copy_range(const void* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
                int64_t begin, int64_t end, int64_t stride) {
  each_page(static_cast<const T*>(layer), rows, send_rows, out, begin, end, stride,
            copy_tile<T, STREAM>);
#if defined(__AVX__)
  if constexpr (STREAM) _mm_sfence();      // the streamed stores, visible before returning
#endif
}

// Block floats: from bfloat16 with AVX-512 (VECTOR) a group of pages at a time, streamed
// where every send row is 64-byte aligned; else (float16, float32 too) page by page.
template <int MAG, typename T, bool VECTOR>
void pack_range(const void* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
                int64_t begin, int64_t end, int64_t stride) {
  const T* src = static_cast<const T*>(layer);
#if defined(HAWK_AVX512)
  if constexpr (VECTOR && std::is_same_v<T, uint16_t>) {
    if (reinterpret_cast<uintptr_t>(out) % 64 == 0 && stride % 64 == 0)
      pack_pages_vector<MAG, true>(src, rows, send_rows, out, begin, end, stride);
    else
      pack_pages_vector<MAG, false>(src, rows, send_rows, out, begin, end, stride);
    return;
  }
#endif
  each_page(src, rows, send_rows, out, begin, end, stride, pack_tile_scalar<MAG, T>);
}

template <typename T, bool VECTOR>
Range block_float_range(int64_t mag_bits) {
  return mag_bits == 7 ? pack_range<7, T, VECTOR> : pack_range<3, T, VECTOR>;
}

// layer: the GPU layer (contiguous); sources: [n, 32] int64; send_rows: [n] int64, each row
// at most once; out: uint8 [rows, >= tile bytes] with contiguous rows; mag_bits: 0 (values
// as they are), 7 (bfloat8_b) or 3 (bfloat4_b).
// vector: the AVX-512 block-float path where built with it (pack_layer), else the portable
// one (pack_layer_portable, which tests compare against it).
// Pages are split over torch's intra-op threads (at::parallel_for, in PAGE_GROUP units of at
// least GRAIN pages: in this thread where torch has one or the layer is small); no two pages
// write the same send row, so the bytes do not depend on the split.
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
  std::vector<uint8_t> filled(out.size(0), 0);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(dest[p] >= 0 && dest[p] < out.size(0), "send row ", dest[p], " out of range");
    TORCH_CHECK(!filled[dest[p]]++, "send row ", dest[p], " is given to two pages");
  }
  uint8_t* dst = out.data_ptr<uint8_t>();
  Range range = nullptr;
  if (mag_bits == 0) {
    TORCH_CHECK(esize == 2 || esize == 4, "values of ", esize, " bytes");
    range = esize == 2 ? copy_range<uint16_t, false> : copy_range<uint32_t, false>;
#if defined(__AVX__)
    if (reinterpret_cast<uintptr_t>(dst) % 32 == 0 && stride % 32 == 0)   // streamed
      range = esize == 2 ? copy_range<uint16_t, true> : copy_range<uint32_t, true>;
#endif
  } else {
    switch (layer.scalar_type()) {
      case at::kBFloat16:
        range = vector ? block_float_range<uint16_t, true>(mag_bits)
                       : block_float_range<uint16_t, false>(mag_bits);
        break;
      case at::kHalf: range = block_float_range<c10::Half, false>(mag_bits); break;
      case at::kFloat: range = block_float_range<uint32_t, false>(mag_bits); break;
      default: TORCH_CHECK(false, "block floats from ", layer.scalar_type(), " are not supported");
    }
  }
  const void* src = layer.data_ptr();
  at::parallel_for(0, (n + PAGE_GROUP - 1) / PAGE_GROUP, GRAIN / PAGE_GROUP,
                   [&](int64_t begin, int64_t end) {
                     range(src, rows, dest, dst, begin * PAGE_GROUP,
                           std::min(end * PAGE_GROUP, n), stride);
                   });
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
