// The AVX2 path: block floats from bfloat16, one group (a face row, 16 values) per 256-bit
// register in 16-bit lanes, the pages of a TT block side by side as on the AVX-512 path; from
// float16 and float32, the portable code compiled for this target. Run only where the CPU
// has AVX2, FMA and F16C (layout_kernel.cpp asks the CPU).
#pragma once

#include <algorithm>

#include "common.h"
#include "pack_portable.h"

#if defined(HAWK_X86)
namespace hawk {

// The shared exponents of the two groups of one tile row (``exp_a``, ``exp_b``: their biased
// exponents in 16-bit lanes), each in the low byte of every lane of ``shared_a`` /
// ``shared_b``; one reduction for both, in bytes, with shifts inside 64-bit lanes where it can.
HAWK_TARGET_AVX2 inline void max_exponents_avx2(__m256i exp_a, __m256i exp_b, __m256i& shared_a,
                                                __m256i& shared_b) {
  __m256i v = _mm256_packus_epi16(exp_a, exp_b);   // 128-bit lane L: a's 8L.., b's 8L.. (bytes)
  v = _mm256_max_epu8(v, _mm256_permute2x128_si256(v, v, 1));   // qword 0: a's, qword 1: b's
  v = _mm256_max_epu8(v, _mm256_srli_epi64(v, 32));
  v = _mm256_max_epu8(v, _mm256_srli_epi64(v, 16));
  v = _mm256_max_epu8(v, _mm256_srli_epi64(v, 8));              // byte 0: a's E, byte 8: b's
  shared_a = _mm256_shuffle_epi8(v, _mm256_set1_epi16(int16_t(0x8000)));   // (E, 0) words
  shared_b = _mm256_shuffle_epi8(v, _mm256_set1_epi16(int16_t(0x8008)));
}

// One group of 16 bfloat16 values (``exp``: their biased exponents, ``shared``: the group's
// E, both in 16-bit lanes) -> 16 code magnitudes in 16-bit lanes, not yet saturated (at
// most 2^MAG), the 16-bit recipe of pack_tile_bf16 without a variable shift (AVX2 has
// none for 16-bit lanes): a = Y >> 1 >> k = (1.mmmmmmm as 8 bits) * 2^(7 - k), the power
// looked up by k with a byte shuffle (k + 0x70, saturated, indexes 2^(7 - k) for k <= 7 and
// 0 above), and the significand zeroed where exp is 0 (sign_epi16 by exp).
template <int MAG>
HAWK_TARGET_AVX2 inline __m256i magnitudes_avx2(__m256i x, __m256i exp, __m256i shared) {
  constexpr int drop = 15 - MAG;
  const __m256i powers = _mm256_setr_epi8(-128, 64, 32, 16, 8, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0,
                                          -128, 64, 32, 16, 8, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i k = _mm256_sub_epi16(shared, exp);
  const __m256i index = _mm256_adds_epu8(k, _mm256_set1_epi16(int16_t(0x8070)));
  const __m256i scale = _mm256_shuffle_epi8(powers, index);               // 2^(7 - k) or 0
  const __m256i y = _mm256_sign_epi16(
      _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x80)),
      exp);
  const __m256i a = _mm256_mullo_epi16(y, scale);
  // half to even: add half - 1, and 1 more where the bit kept last is odd
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(a, drop), _mm256_set1_epi16(1));
  return _mm256_srli_epi16(_mm256_add_epi16(_mm256_add_epi16(a, odd),
                                            _mm256_set1_epi16((1 << (drop - 1)) - 1)),
                           drop);
}

// Two groups' magnitudes (``qa``, ``qb``) and values (``xa``, ``xb``) -> their 32 one-byte
// codes, as packus_epi16 orders them: saturated to 2^MAG - 1, with the sign bit (the values'
// signs, by packs_epi16, which keeps them) where x is negative and the code is not 0.
template <int MAG>
HAWK_TARGET_AVX2 inline __m256i codes_avx2(__m256i qa, __m256i qb, __m256i xa, __m256i xb) {
  const __m256i q = _mm256_min_epu8(_mm256_packus_epi16(qa, qb),
                                    _mm256_set1_epi8((1 << MAG) - 1));
  __m256i sign = _mm256_packs_epi16(xa, xb);                  // negative: bit 7 set
  if constexpr (MAG == 3) sign = _mm256_srli_epi16(sign, 4);  // bit 7 -> bit 3 of each byte
  sign = _mm256_and_si256(sign, _mm256_set1_epi8(1 << MAG));
  return _mm256_or_si256(q, _mm256_sign_epi8(sign, q));       // sign_epi8: 0 where q is 0
}

template <bool STREAM>
HAWK_TARGET_AVX2 inline void store_half_line(uint8_t* to, __m256i v) {
  if constexpr (STREAM) _mm256_stream_si256(reinterpret_cast<__m256i*>(to), v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), v);
}

// Tile rows r0 .. r0 + 7 (r0 a multiple of 8) of one bfloat16 tile into ``page``: they are
// rows r0 % 16 .. + 7 of faces 2h and 2h + 1 (h = r0 / 16), whose codes fill one 64-byte
// line in each face (bfloat4_b) or two (bfloat8_b), written in halves of 32 bytes back to
// back (STREAM: non-temporal stores; ``page`` 32-byte aligned). bfloat8_b: two rows' codes
// make a half line; bfloat4_b: four rows'. Their shared exponents go into ``exps``.
template <int MAG, bool STREAM>
HAWK_TARGET_AVX2 inline void pack_rows_avx2(const uint16_t* layer, const int64_t* rows,
                                            uint8_t* page, const int64_t* ahead, int r0,
                                            uint8_t* exps) {
  constexpr int GROUP_BYTES = FACE * (MAG + 1) / 8, STEP = MAG == 7 ? 2 : 4;
  static const uint16_t zeros[TILE] = {};
  const int g = (r0 / FACE) * 2 * FACE + r0 % FACE;        // face 2h; face 2h + 1 is 16 on
  for (int i = 0; i < 8; i += STEP) {
    __m256i q[2][STEP], x[2][STEP];
    for (int s = 0; s < STEP; ++s) {
      prefetch_row<2>(layer, ahead, r0 + i + s);
      const int64_t src = rows[r0 + i + s];
      const auto* row = reinterpret_cast<const __m256i*>(src < 0 ? zeros : layer + src);
      __m256i exp[2], shared[2];
      for (int fc = 0; fc < 2; ++fc) {
        x[fc][s] = _mm256_loadu_si256(row + fc);
        exp[fc] = _mm256_and_si256(_mm256_srli_epi16(x[fc][s], 7), _mm256_set1_epi16(0xFF));
      }
      max_exponents_avx2(exp[0], exp[1], shared[0], shared[1]);
      for (int fc = 0; fc < 2; ++fc) {
        q[fc][s] = magnitudes_avx2<MAG>(x[fc][s], exp[fc], shared[fc]);
        exps[g + fc * FACE + i + s] =
            uint8_t(_mm_cvtsi128_si32(_mm256_castsi256_si128(shared[fc])));
      }
    }
    for (int fc = 0; fc < 2; ++fc) {
      uint8_t* to = page + GROUPS + (g + fc * FACE + i) * GROUP_BYTES;
      const __m256i ab = codes_avx2<MAG>(q[fc][0], q[fc][1], x[fc][0], x[fc][1]);
      if constexpr (MAG == 7) {     // qwords: row 0's 0..7, row 1's 0..7, row 0's 8..15, ...
        store_half_line<STREAM>(to, _mm256_permute4x64_epi64(ab, _MM_SHUFFLE(3, 1, 2, 0)));
      } else {        // bytes (1, 16) . code pairs -> 2m | 2m + 1 << 4; dwords: row k, 8 codes
        const __m256i nibbles = _mm256_set1_epi16(0x1001);
        const __m256i cd = codes_avx2<MAG>(q[fc][2], q[fc][3], x[fc][2], x[fc][3]);
        store_half_line<STREAM>(to, _mm256_permutevar8x32_epi32(
                                        _mm256_packus_epi16(_mm256_maddubs_epi16(ab, nibbles),
                                                            _mm256_maddubs_epi16(cd, nibbles)),
                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      }
    }
  }
}

// Up to PAGE_GROUP bfloat16 tiles (``rows``: theirs, one after another) into ``pages``, eight
// tile rows of each in turn (see pack_group_avx512); the shared exponents last, as each
// page's first line. ``ahead``: the tile rows of the pages AHEAD on (null: none).
template <int MAG, bool STREAM>
HAWK_TARGET_AVX2 void pack_group_avx2(const uint16_t* layer, const int64_t* rows,
                                      uint8_t* const* pages, int count, const int64_t* ahead) {
  alignas(32) uint8_t exps[PAGE_GROUP][GROUPS];
  for (int r0 = 0; r0 < TILE; r0 += 8)
    for (int j = 0; j < count; ++j)
      pack_rows_avx2<MAG, STREAM>(layer, rows + j * TILE, pages[j],
                                  ahead ? ahead + j * TILE : nullptr, r0, exps[j]);
  for (int j = 0; j < count; ++j)
    for (int half = 0; half < GROUPS; half += 32)
      store_half_line<STREAM>(pages[j] + half, _mm256_load_si256(
                                                   reinterpret_cast<__m256i*>(exps[j] + half)));
}

// Block floats from bfloat16, PAGE_GROUP pages at a time, streamed where every send row is
// 32-byte aligned.
template <int MAG>
HAWK_TARGET_AVX2 void pack_range_avx2(const void* layer, const int64_t* rows,
                                      const int64_t* send_rows, uint8_t* out, int64_t begin,
                                      int64_t end, int64_t stride) {
  const auto* src = static_cast<const uint16_t*>(layer);
  const bool stream = reinterpret_cast<uintptr_t>(out) % 32 == 0 && stride % 32 == 0;
  uint8_t* pages[PAGE_GROUP];
  for (int64_t p = begin; p < end; p += PAGE_GROUP) {
    const int count = int(std::min<int64_t>(PAGE_GROUP, end - p));
    for (int j = 0; j < count; ++j) pages[j] = out + send_rows[p + j] * stride;
    const int64_t* ahead = p + AHEAD + count <= end ? rows + (p + AHEAD) * TILE : nullptr;
    if (stream) pack_group_avx2<MAG, true>(src, rows + p * TILE, pages, count, ahead);
    else pack_group_avx2<MAG, false>(src, rows + p * TILE, pages, count, ahead);
  }
  if (stream) _mm_sfence();               // the streamed stores, visible before returning
}

// Block floats from float16 or float32: the portable code, compiled for this target.
template <int MAG, typename T>
HAWK_TARGET_AVX2 void pack_range_wide_avx2(const void* layer, const int64_t* rows,
                                           const int64_t* send_rows, uint8_t* out,
                                           int64_t begin, int64_t end, int64_t stride) {
  pack_pages_portable<MAG, T>(layer, rows, send_rows, out, begin, end, stride);
}

}  // namespace hawk
#endif
