// The AVX-512 (F, BW, VL) path: block floats from bfloat16, one tile row per vector register,
// the pages of a TT block side by side; from float16 and float32, the portable code compiled
// for this target. Run only where the CPU has those extensions (layout_kernel.cpp asks).
#pragma once

#include <algorithm>

#include "common.h"
#include "pack_portable.h"

#if defined(HAWK_X86)
namespace hawk {

// Four vectors of 16 values 0..255 in 32-bit lanes -> 64 bytes. The packs work within 128-bit
// lanes: dword 4L + k holds a, b, c, d's (k = 0..3) values 4L .. 4L + 3.
HAWK_TARGET_AVX512 inline __m512i pack4(__m512i a, __m512i b, __m512i c, __m512i d) {
  return _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
}

template <bool STREAM>
HAWK_TARGET_AVX512 inline void store_line(uint8_t* to, __m512i line) {
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
HAWK_TARGET_AVX512 inline __m512i encode_row(__m512i x, __m512i exp, __m512i e) {
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
HAWK_TARGET_AVX512 inline __m512i max_exponents(const __m512i* exp) {
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
HAWK_TARGET_AVX512 inline void pack_rows_avx512(const uint16_t* layer, const int64_t* rows,
                                                uint8_t* page, const int64_t* ahead, int h,
                                                int r0, __m512i& exps) {
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
HAWK_TARGET_AVX512 void pack_group_avx512(const uint16_t* layer, const int64_t* rows,
                                          uint8_t* const* pages, int count,
                                          const int64_t* ahead) {
  __m512i exps[PAGE_GROUP][2];
  for (int j = 0; j < count; ++j) exps[j][0] = exps[j][1] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h)
    for (int r0 = 0; r0 < FACE; r0 += 8)
      for (int j = 0; j < count; ++j)
        pack_rows_avx512<MAG, STREAM>(layer, rows + j * TILE, pages[j],
                                      ahead ? ahead + j * TILE : nullptr, h, r0, exps[j][h]);
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  for (int j = 0; j < count; ++j)
    store_line<STREAM>(pages[j], _mm512_permutexvar_epi64(
                                     order, _mm512_packus_epi16(exps[j][0], exps[j][1])));
}

// Pages [begin, end) of block floats from bfloat16, PAGE_GROUP at a time.
template <int MAG, bool STREAM>
HAWK_TARGET_AVX512 void pack_pages_avx512(const uint16_t* layer, const int64_t* rows,
                                          const int64_t* send_rows, uint8_t* out,
                                          int64_t begin, int64_t end, int64_t stride) {
  uint8_t* pages[PAGE_GROUP];
  for (int64_t p = begin; p < end; p += PAGE_GROUP) {
    const int count = int(std::min<int64_t>(PAGE_GROUP, end - p));
    for (int j = 0; j < count; ++j) pages[j] = out + send_rows[p + j] * stride;
    pack_group_avx512<MAG, STREAM>(layer, rows + p * TILE, pages, count,
                                   p + AHEAD + count <= end ? rows + (p + AHEAD) * TILE
                                                            : nullptr);
  }
  if constexpr (STREAM) _mm_sfence();     // the streamed stores, visible before returning
}

// Block floats from bfloat16, streamed where every send row is 64-byte aligned.
template <int MAG>
HAWK_TARGET_AVX512 void pack_range_avx512(const void* layer, const int64_t* rows,
                                          const int64_t* send_rows, uint8_t* out,
                                          int64_t begin, int64_t end, int64_t stride) {
  const auto* src = static_cast<const uint16_t*>(layer);
  if (reinterpret_cast<uintptr_t>(out) % 64 == 0 && stride % 64 == 0)
    pack_pages_avx512<MAG, true>(src, rows, send_rows, out, begin, end, stride);
  else
    pack_pages_avx512<MAG, false>(src, rows, send_rows, out, begin, end, stride);
}

// Block floats from float16 or float32: the portable code, compiled for this target.
template <int MAG, typename T>
HAWK_TARGET_AVX512 void pack_range_wide_avx512(const void* layer, const int64_t* rows,
                                               const int64_t* send_rows, uint8_t* out,
                                               int64_t begin, int64_t end, int64_t stride) {
  pack_pages_portable<MAG, T>(layer, rows, send_rows, out, begin, end, stride);
}

}  // namespace hawk
#endif
